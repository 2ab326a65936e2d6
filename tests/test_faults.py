"""Faults of `moerun serve`: the model file truncated, written over or replaced while the server runs (the
experts are read from it on cache misses), a RAM budget too small, SIGTERM with requests running and waiting."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moerun.runtime import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from soak import read_stream
from toolkit import ServerProcess, free_port

# a server started for each fault (~45 s in all): `python -m pytest -m slow`, and CI
pytestmark = pytest.mark.slow

PROMPT = {"prompt": "def fib(n):", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def mapped_server(tmp_path, model: Path, *extra) -> ServerProcess:
    """The experts' home is the file: one cache slot per layer, so prompts and decode steps read it."""
    return ServerProcess(["-m", str(model), "--mmap", "--expert-cache-mib", "1", "-c", "256", "-np", "2", "-t", "1",
                          "--log-interval", "0", *extra], tmp_path / "serve.log")


def model_copy(tmp_path) -> Path:
    path = tmp_path / "m.gguf"
    shutil.copy(default_model_path(), path)
    return path


def stream_error(server, body) -> dict | None:
    conn = server.connect("POST", "/v1/completions", {**body, "stream": True})
    try:
        r = conn.getresponse()
        assert r.status == 200
        return read_stream(r, time.perf_counter())["error"]
    finally:
        conn.close()


def truncate(path: Path) -> str:
    os.truncate(path, 4096)
    return "truncated"


def overwrite(path: Path) -> str:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(b"\0" * 65536)
    return "changed while in use"


@pytest.mark.parametrize("damage", [truncate, overwrite])
def test_a_damaged_model_file_fails_the_requests_that_read_it_and_health_says_unhealthy(tmp_path, damage):
    path = model_copy(tmp_path)
    server = mapped_server(tmp_path, path)
    try:
        assert server.request("POST", "/v1/completions", PROMPT).status == 200
        phrase = damage(path)
        r = server.request("POST", "/v1/completions", {**PROMPT, "prompt": "class Parser:\n    def"})
        assert r.status == 500, r.text
        err = r.json()["error"]
        assert str(path) in err["message"] and phrase in err["message"], err
        health = server.request("GET", "/health")
        assert health.status == 503, health.text
        assert health.json()["error"]["type"] == "unavailable_error"
        assert phrase in health.json()["error"]["message"] and "restart" in health.json()["error"]["message"]
        refused = server.request("POST", "/v1/completions", PROMPT)
        assert refused.status == 503 and "restart the server" in refused.json()["error"]["message"]
        slots = server.request("GET", "/slots").json()
        assert not any(s["is_processing"] for s in slots)
        assert server.request("GET", "/v1/models").status == 200 and server.proc.poll() is None
    finally:
        assert server.stop() in (0, -signal.SIGTERM)
    log = (tmp_path / "serve.log").read_text()
    assert "reading the model failed" in log and "Traceback" not in log


def test_a_stream_that_hits_the_damage_gets_an_error_event(tmp_path):
    path = model_copy(tmp_path)
    server = mapped_server(tmp_path, path)
    try:
        truncate(path)
        err = stream_error(server, {**PROMPT, "prompt": "import os\nimport sys\n"})
        assert err is not None and err["code"] == 500 and "truncated" in err["message"] and str(path) in err["message"]
        refused = server.connect("POST", "/v1/completions", {**PROMPT, "stream": True})
        assert refused.getresponse().status == 503
        refused.close()
    finally:
        server.stop()


def test_a_model_file_replaced_by_a_new_one_keeps_serving_the_one_loaded(tmp_path):
    """Replacing the file (a new file renamed over it, as downloads and copies with a temporary do) leaves the
    server reading the file it opened: same answers, healthy."""
    path = model_copy(tmp_path)
    server = mapped_server(tmp_path, path)
    try:
        before = [server.request("POST", "/v1/completions", {**PROMPT, "prompt": p}).json()["choices"][0]["text"]
                  for p in ("def fib(n):", "while True:\n")]
        other = tmp_path / "other.gguf"
        other.write_bytes(b"GGUF" + b"\0" * 100)
        os.replace(other, path)
        after = [server.request("POST", "/v1/completions", {**PROMPT, "prompt": p}).json()["choices"][0]["text"]
                 for p in ("def fib(n):", "while True:\n")]
        assert after == before
        assert server.request("GET", "/health").json() == {"status": "ok"}
    finally:
        server.stop()


def test_a_failed_page_in_leaves_no_slot_claiming_the_expert(tmp_path):
    """A slot the failed read was writing into must not be a hit afterwards (it holds part of the bytes)."""
    from moerun.errors import ModelFormatError
    from moerun.experts.cache import ExpertCache
    from moerun.loading import load_model

    path = model_copy(tmp_path)
    store = load_model(path, home="mmap").model.store
    cache = ExpertCache(store, slots=2, prefill="cache")
    layer = store.layers[0]
    cache.fetch(layer, [0], "decode")
    assert cache.tables[layer].resident == {0: 0}
    os.truncate(path, 4096)
    with pytest.raises(ModelFormatError, match="truncated: expert 1 of layer"):
        cache.fetch(layer, [1], "decode")
    assert cache.tables[layer].resident == {}


def serve_exits(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moerun", "serve", "--port", str(free_port()), *args],
                          capture_output=True, text=True, timeout=180, check=False)


@pytest.mark.parametrize("args,phrases", [
    (("--ram-budget", "1MiB"), ("RAM budget is 1.00 MiB", "dense weights need", "--ctx-size")),
    (("--ram-budget", "6MiB", "-c", "512", "-np", "4"), ("-np 4 slots of 512 tokens", "it fits -np 1 with -c 512")),
])
def test_a_ram_budget_too_small_is_a_startup_error_saying_what_fits(args, phrases):
    r = serve_exits(*args)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == r.stderr.strip().splitlines()[-1], r.stderr
    assert all(p in errors[0] for p in phrases), errors[0]
    assert "Traceback" not in r.stderr


def test_a_ram_budget_that_fits_the_slots_starts(tmp_path):
    server = ServerProcess(["--ram-budget", "64MiB", "-c", "256", "-np", "2", "-t", "1"], tmp_path / "serve.log")
    try:
        assert server.request("POST", "/v1/completions", PROMPT).status == 200
    finally:
        server.stop()


def test_sigterm_tells_running_and_waiting_requests_then_exits(tmp_path):
    server = ServerProcess(["-c", "2048", "-np", "2", "-t", "1", "--log-interval", "0"], tmp_path / "serve.log")
    long = {"prompt": "x", "max_tokens": 2047, "temperature": 0, "ignore_eos": True}
    results = {}

    def whole(name):
        results[name] = server.request("POST", "/v1/completions", long, timeout=120)

    stream = server.connect("POST", "/v1/completions", {**long, "stream": True})
    resp = stream.getresponse()
    threads = [threading.Thread(target=whole, args=(n,)) for n in ("a", "b")]  # one runs, one waits
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while time.time() < deadline:
        m = server.metrics()
        if m["llamacpp:requests_processing"] == 2 and m["llamacpp:requests_deferred"] == 1:
            break
        time.sleep(0.02)
    assert (m["llamacpp:requests_processing"], m["llamacpp:requests_deferred"]) == (2, 1)
    server.proc.send_signal(signal.SIGTERM)
    err = read_stream(resp, time.perf_counter())["error"]
    stream.close()
    for t in threads:
        t.join(timeout=60)
    assert err is not None and err["code"] == 503 and "shutting down" in err["message"]
    for name in ("a", "b"):
        r = results[name]
        assert r.status == 503 and "shutting down" in json.loads(r.text)["error"]["message"], (name, r)
    assert server.proc.wait(timeout=60) in (0, -signal.SIGTERM)
    log = (tmp_path / "serve.log").read_text()
    assert "Finished server process" in log and "Traceback" not in log
