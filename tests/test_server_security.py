"""Security defaults of `moerun serve`: loopback bind, the warning for other addresses without a key, the key
compared in constant time, and no request field or path that makes the server touch a file it names."""

import hmac
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from moerun.runtime import default_model_path
from moerun.server.errors import Guard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from toolkit import ServerProcess, free_port

KEY = "sk-security"
MARK = "probe-7c1e"

# Every file-system audit event (PEP 578) whose arguments name the probe file, or /etc/passwd, goes to stderr.
AUDIT = textwrap.dedent(f"""
    import os, sys
    WATCH = {{"open", "os.listdir", "os.scandir", "os.remove", "os.rename", "os.mkdir", "os.truncate",
             "os.chmod", "os.utime", "shutil.copyfile", "shutil.rmtree", "glob.glob", "subprocess.Popen",
             "os.system", "os.exec", "os.posix_spawn"}}
    def hook(event, args):
        if event in WATCH and ({MARK!r} in repr(args) or "passwd" in repr(args)):
            os.write(2, ("AUDIT " + event + " " + repr(args) + "\\n").encode())
    sys.addaudithook(hook)
    sys.argv[0] = "moerun"
    from moerun.cli import main
    main()
""")


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """A server on a copy of the built-in model named with the probe mark, every file access audited."""
    root = tmp_path_factory.mktemp("security")
    model = root / f"{MARK}.gguf"
    model.write_bytes(default_model_path().read_bytes())
    server = ServerProcess(["-m", str(model), "-c", "256", "-np", "2", "-t", "1", "--log-interval", "0"],
                           root / "serve.log", key=KEY, launcher=("-c", AUDIT))
    yield server, model
    server.stop()


def audited(server) -> list[str]:
    return [line for line in server.log_path.read_text().splitlines() if line.startswith("AUDIT ")]


def test_the_default_bind_is_loopback(probed):
    server, _ = probed
    listening = [c.laddr for c in psutil.Process(server.proc.pid).net_connections("inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
    assert f"http://127.0.0.1:{server.port}" in server.log_path.read_text()


def _serve_broken(tmp_path, *args) -> str:
    """stderr of a server on a file that fails to load (it exits at once, after its startup lines)."""
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    env = {k: v for k, v in os.environ.items() if k != "MOERUN_API_KEY"}
    r = subprocess.run([sys.executable, "-m", "moerun", "serve", "-m", str(bad), "--port", str(free_port()), *args],
                       capture_output=True, text=True, timeout=120, check=False, env=env)
    assert r.returncode == 1 and "broken.gguf" in r.stderr
    return r.stderr


@pytest.mark.parametrize("args,warned", [
    ((), False),
    (("--host", "127.0.0.1"), False),
    (("--host", "0.0.0.0"), True),
    (("--host", "0.0.0.0", "--api-key", KEY), False),
])
def test_a_warning_when_listening_beyond_loopback_without_a_key(tmp_path, args, warned):
    stderr = _serve_broken(tmp_path, *args)
    assert ("without --api-key: anyone who can reach this port can use the model" in stderr) == warned, stderr


def test_the_api_key_is_compared_with_hmac_compare_digest(monkeypatch):
    calls, real = [], hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr("moerun.server.errors.hmac.compare_digest", spy)
    guard = Guard(app=None, api_key=KEY, max_body_bytes=1, open_paths=frozenset())
    assert guard._authorized({b"authorization": f"Bearer {KEY}".encode()})
    assert not guard._authorized({b"authorization": f"Bearer {KEY}x".encode()})
    assert not guard._authorized({b"authorization": b"Bearer sk"})
    assert guard._authorized({b"x-api-key": KEY.encode()})
    assert not guard._authorized({})
    assert calls == [(KEY.encode(), KEY.encode()), ((KEY + "x").encode(), KEY.encode()), (b"sk", KEY.encode()),
                     (KEY.encode(), KEY.encode()), (b"", KEY.encode())]
    monkeypatch.setattr("moerun.server.errors.hmac.compare_digest", lambda a, b: True)
    assert guard._authorized({b"authorization": b"Bearer anything"})  # the decision is compare_digest's


def _path_requests(model: Path) -> list[tuple[str, str, object, int]]:
    """(method, path, body, expected status): every field and route that could name a file, naming one."""
    path, name = str(model), model.name
    chat = {"messages": [{"role": "user", "content": path}], "max_tokens": 2}
    done = {"prompt": path, "max_tokens": 2}
    return [
        # a model name is a name: the one model served answers any (llama-server's way), no file is opened
        ("POST", "/v1/completions", {**done, "model": path}, 200),
        ("POST", "/v1/completions", {**done, "model": f"../{model.parent.name}/{name}"}, 200),
        ("POST", "/v1/completions", {**done, "model": "/etc/passwd"}, 200),
        ("POST", "/v1/chat/completions", {**chat, "model": f"./{name}"}, 200),
        ("POST", "/v1/completions", done, 200),
        ("POST", "/v1/completions", {**done, "stop": [path], "seed": 1}, 200),
        ("POST", "/v1/chat/completions", {**chat, "chat_template_kwargs": {"path": path, "template": path}}, 200),
        ("POST", "/v1/chat/completions", {**chat, "chat_template": path, "tokenizer": path, "grammar_file": path,
                                          "slot_save_path": path, "filename": path, "response_format": None}, 200),
        ("POST", "/v1/completions", {**done, "lora": [{"path": path, "scale": 1.0}]}, 400),
        ("POST", "/tokenize", {"content": path, "model": path}, 200),
        ("POST", "/tokenize", {"content": path}, 200),
        ("POST", f"/slots/0?action=restore&filename={path}", None, 400),
        ("POST", f"/slots/0?action=save&filename=../{name}", None, 400),
        ("GET", f"/v1/models/{name}", None, 200),  # the served model's own name: answered from memory
        ("GET", f"/v1/models/{path}", None, 404),
        ("GET", f"/v1/models/../{model.parent.name}/{name}", None, 404),
        ("GET", "/../../../etc/passwd", None, 404),
        ("GET", f"/static/..%2f..%2f{name}", None, 404),
    ]


def test_no_request_opens_a_file_it_names(probed):
    server, model = probed
    assert audited(server), "the audit hook saw the model file opened at startup"
    at_start = len(audited(server))
    got = [(m, p, server.request(m, p, body).status) for m, p, body, _ in _path_requests(model)]
    assert got == [(m, p, status) for m, p, _, status in _path_requests(model)]
    assert audited(server)[at_start:] == []
    assert server.request("GET", "/health").status == 200
