"""`moerun run` and `moerun chat` end to end (chat driven through stdin)."""

import gc
import json
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from moerun.cli import main

TIMING = re.compile(r"prompt eval time = +[\d.]+ ms / +\d+ tokens \( +[\d.]+ ms per token, +[\d.]+ tokens per second\)")


def invoke(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input, catch_exceptions=False)


def test_commands_collect_young_objects_less_often_than_pythons_default():
    """Start-up's ~3 x 10^5 long-lived objects: the group sets a young threshold of 20,000 before any command."""
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        assert invoke("run", "--help").exit_code == 0
        assert gc.get_threshold() == (20_000, 20, 50) and gc.isenabled()
    finally:
        gc.set_threshold(*before)


def test_run_streams_text_and_prints_timings(hf_model):
    _, folder = hf_model("qwen3moe")
    r = invoke("run", "-m", folder, "-p", "Hello", "-n", "12", "--temp", "0", "--ignore-eos")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("Hello") and len(r.stdout) > len("Hello\n")
    assert TIMING.search(r.stderr)
    assert re.search(r"^ +eval time = +[\d.]+ ms / +12 tokens", r.stderr, re.MULTILINE)
    assert re.search(r"^ +total time = ", r.stderr, re.MULTILINE)


def test_run_json_and_seed(hf_model):
    _, folder = hf_model("qwen3moe")
    args = ("run", "-m", folder, "-p", "Hi", "-n", "10", "--seed", "5", "--ignore-eos", "--json")
    a, b = json.loads(invoke(*args).stdout), json.loads(invoke(*args).stdout)
    assert a["text"] == b["text"] and a["tokens"] == b["tokens"] and len(a["tokens"]) == 10
    assert a["seed"] == 5
    keys = {"prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n", "predicted_ms",
            "predicted_per_token_ms", "predicted_per_second"}
    assert keys <= set(a["timings"]) and a["timings"]["predicted_n"] == 10


def test_chat_two_turns_through_stdin(hf_model):
    _, folder = hf_model("mixtral")
    r = invoke("chat", "-m", folder, "-n", "6", "--temp", "0", "--ignore-eos", input="hello\nand again\n")
    assert r.exit_code == 0, r.output
    assert len(TIMING.findall(r.stderr)) == 2  # one reply per turn, then EOF (Ctrl-D) ends the session
    assert len(r.stdout.strip().splitlines()) >= 1


def test_chat_context_overflow_is_reported_and_session_continues(hf_model):
    _, folder = hf_model("qwen3moe")
    r = invoke("chat", "-m", folder, "-c", "32", "-n", "4", "--temp", "0", input="x " * 40 + "\nhi\n")
    assert r.exit_code == 0
    assert "error: the prompt has" in r.stderr and "context size is 32" in r.stderr
    assert len(TIMING.findall(r.stderr)) == 1  # the second, short turn still ran


EVAL = re.compile(r"^ +eval time = +[\d.]+ ms / +(\d+) tokens", re.MULTILINE)
PROMPT_EVAL = re.compile(r"prompt eval time = +[\d.]+ ms / +(\d+) tokens")


def test_chat_past_a_full_context_drops_the_oldest_turns_once_noted():
    """Ten turns through -c 96: the history outgrows it after a few; every later turn is still answered, with
    room for its whole reply (-n), and the drop is said once."""
    turns = "".join(f"tell me about item number {i}, please\n" for i in range(10))
    r = invoke("chat", "-c", "96", "-n", "8", "--temp", "0", "--ignore-eos", "--system", "be brief", input=turns)
    assert r.exit_code == 0, r.output
    assert "error" not in r.stderr
    assert EVAL.findall(r.stderr) == ["8"] * 10
    assert r.stderr.count("outgrew the context (-c 96)") == 1 and "the system prompt stays" in r.stderr


def test_conversation_drops_its_oldest_turns_and_keeps_the_system_prompt():
    from moerun.text.conversation import Conversation

    def turn(role, n):
        return {"role": role, "content": "x" * n}

    def chars(messages):  # one token per character
        return [0] * sum(len(m["content"]) for m in messages)

    c = Conversation("s" * 5, [turn("user", 10), turn("assistant", 10), turn("user", 10), turn("assistant", 10),
                               turn("user", 10)])
    ids, dropped = c.fit(chars, 55)
    assert (len(ids), dropped, len(c.turns)) == (55, 0, 5)  # it fits: nothing goes
    ids, dropped = c.fit(chars, 35)
    assert (len(ids), dropped, len(c.turns)) == (35, 2, 3)  # the oldest user message and its reply go
    assert c.messages[0] == {"role": "system", "content": "s" * 5} and c.turns[0]["role"] == "user"
    ids, dropped = c.fit(chars, 1)  # never the last message, nor the system prompt
    assert (len(ids), dropped, c.turns) == (15, 2, [turn("user", 10)])
    c.clear()
    assert c.messages == [{"role": "system", "content": "s" * 5}]
    assert Conversation().messages == []


def test_chat_clear_forgets_the_history_and_its_kv():
    """After /clear the same message gets the same reply as the first time, and its whole prompt is run again;
    without /clear, the second message sees the first turn and reuses its KV. ChatML, whose history holds the
    reply as generated (Qwen3's, the built-in model's, reads it for reasoning, which drops its leading
    whitespace)."""
    chatml = ("--chat-template", "chatml")
    cleared = invoke("chat", "-n", "6", "--temp", "0", "--ignore-eos", *chatml, input="hello\n/clear\nhello\n")
    assert cleared.exit_code == 0, cleared.output
    out = cleared.stdout
    assert out[: len(out) // 2] == out[len(out) // 2:] and out.strip()
    first, second = PROMPT_EVAL.findall(cleared.stderr)
    assert first == second
    kept = invoke("chat", "-n", "6", "--temp", "0", "--ignore-eos", *chatml, input="hello\nhello\n")
    first, second = PROMPT_EVAL.findall(kept.stderr)
    assert int(second) < int(first) + 6  # the first turn's prompt and reply came from the KV cache


def test_chat_ctrl_d_ends_the_prompt_line():
    """On a terminal, Ctrl-D at the prompt leaves a newline after '> ', so the shell's prompt starts afresh."""
    import os
    import pty

    leader, follower = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "moerun", "chat", "-n", "2"], stdin=follower,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    os.close(follower)
    try:
        assert p.stdout.read(2) == b"> "
        os.write(leader, b"\x04")
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
        os.close(leader)
    assert p.returncode == 0, err.decode()
    assert out == b"\n"


@pytest.mark.parametrize("args,phrase", [
    (("run", "-p", "x", "-m", "/no/such/model"), "no such file or directory"),
    (("run", "-p", "x", "--top-p", "2"), "top_p"),
])
def test_bad_input_is_one_line_error(args, phrase):
    r = subprocess.run([sys.executable, "-m", "moerun", *args], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr and phrase in r.stderr, r.stderr


@pytest.mark.parametrize("started", ["plain", "sigint-ignored"])
def test_chat_ctrl_c_stops_the_reply_and_the_session_goes_on(hf_model, started):
    """SIGINT during a reply ends that reply only; the next turn is answered; EOF (Ctrl-D) exits cleanly. Also where
    the chat starts with SIGINT ignored, as a shell's background job without job control (or nohup) starts it."""
    import os
    import signal
    import time

    _, folder = hf_model("qwen3moe")
    # a context far longer than a reply gets before its interrupt, however slowly this process is scheduled beside the
    # chat's threads
    cmd = [sys.executable, "-m", "moerun", "chat", "-m", str(folder), "-n", "100000", "--ignore-eos", "-c", "65536"]
    if started == "sigint-ignored":  # an ignored signal stays ignored across exec
        cmd = ["sh", "-c", "trap '' INT; exec " + shlex.join(cmd)]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = b""

    def read_until(done) -> None:
        nonlocal out
        deadline = time.monotonic() + 120
        while not done() and time.monotonic() < deadline:
            out += p.stdout.read() or b""
            time.sleep(0.05)

    try:
        os.set_blocking(p.stdout.fileno(), False)
        for turn, line in enumerate((b"tell me a long story\n", b"hi\n")):
            start = len(out)
            p.stdin.write(line)
            p.stdin.flush()
            read_until(lambda start=start: len(out) - start >= 20)  # the reply is streaming
            assert len(out) - start >= 20, f"turn {turn}: no streamed output"
            p.send_signal(signal.SIGINT)
            read_until(lambda turn=turn: out.count(b"[interrupted]") > turn)
            assert out.count(b"[interrupted]") > turn, f"turn {turn}: the reply went on after Ctrl-C"
        p.stdin.close()  # EOF (Ctrl-D): the chat ends
        p.wait(timeout=120)
        stderr = p.stderr.read().decode()
        out += p.stdout.read() or b""
    finally:
        p.kill()
    assert p.returncode == 0, stderr
    assert out.count(b"[interrupted]") == 2  # each reply stopped, and the session answered the next turn
    assert len(TIMING.findall(stderr)) == 2 and "Traceback" not in stderr


def test_default_model_runs_without_m():
    """The README's first command: the built-in model generates Python-looking text."""
    r = invoke("run", "-p", "import os\n", "-n", "40", "--seed", "0", "--no-display-prompt")
    assert r.exit_code == 0, r.output
    assert len(r.stdout.strip()) > 20
    assert TIMING.search(r.stderr)


def test_run_with_expert_cache_reports_hit_rate_and_same_text(hf_model):
    _, folder = hf_model("qwen3moe")
    base = ("run", "-m", folder, "-p", "Hello", "-n", "12", "--temp", "0", "--ignore-eos")
    plain = json.loads(invoke(*base, "--json").stdout)
    cached = json.loads(invoke(*base, "--json", "--expert-cache-slots", "1", "--cache-policy", "lfu").stdout)
    assert cached["tokens"] == plain["tokens"]
    decode = cached["expert_cache"]
    assert "decode" in json.dumps(decode)
    r = invoke(*base, "--expert-cache-mib", "0.05", "-v")
    assert re.search(r"^expert cache: prefill hit rate .*decode hit rate [\d.]+% \(\d+/\d+\)", r.stderr, re.MULTILINE)
    assert re.search(r"^layer +0: ", r.stderr, re.MULTILINE)


def test_trace_routing_records_every_decision_and_replays(hf_model, tmp_path):
    from moerun.experts.trace import read_trace

    _, folder = hf_model("qwen2moe")
    path = tmp_path / "routes.jsonl"
    r = invoke("run", "-m", folder, "-p", "Hello there", "-n", "6", "--temp", "0", "--ignore-eos", "--json",
               "--trace-routing", path)
    out = json.loads(r.stdout)
    trace = read_trace(path)
    n_tokens = out["timings"]["prompt_n"] + out["timings"]["predicted_n"] - 1  # the last token is not run
    assert trace.header.n_layers == 2 and trace.header.k == 2
    assert len(trace.records) == n_tokens * 2
    assert {r.phase for r in trace.records} == {"prefill", "decode"}
    assert all(len(r.experts) == 2 and abs(sum(r.weights)) > 0 for r in trace.records)
    sim = invoke("trace", "simulate", path, "--slots", "1,2", "--policy", "lru,belady")
    assert sim.exit_code == 0 and "belady" in sim.output
    again = invoke("run", "-m", folder, "-p", "x", "-n", "2", "--trace-routing", path)
    assert again.exit_code != 0 and "already exists" in again.stderr


def test_ram_budget_below_the_model_plans_a_disk_home_and_a_cache():
    """The built-in model (9.6 MB) under an 8 MiB RAM budget: experts stay on disk, the plan sizes a cache."""
    r = invoke("run", "-p", "import os", "-n", "8", "-c", "256", "--ram-budget", "8MiB", "--print-plan",
               "--temp", "0", "--no-display-prompt")
    assert r.exit_code == 0, r.output
    assert "home (disk)" in r.stderr
    assert re.search(r"^expert cache: .*decode hit rate", r.stderr, re.MULTILINE)
    plain = invoke("run", "-p", "import os", "-n", "8", "-c", "256", "--temp", "0", "--no-display-prompt")
    assert r.stdout == plain.stdout  # same text whatever the placement


@pytest.mark.parametrize("args,phrase", [
    (("--ram-budget", "1MiB"), "but the RAM budget is 1.00 MiB"),
    (("--gpus", "0,1"), "--device cpu"),
    (("--ram-budget", "lots"), "size"),
    (("--vram-budget", "6GiB,lots"), "--vram-budget"),
    (("-ot", "exps=NPU"), "NPU"),
])
def test_placement_errors_are_one_line(args, phrase):
    r = subprocess.run([sys.executable, "-m", "moerun", "run", "-p", "x", *args], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr and phrase in r.stderr, r.stderr


def test_vram_budget_without_a_gpu_warns_and_changes_nothing():
    r = invoke("run", "-p", "import os", "-n", "6", "--temp", "0", "--no-display-prompt", "--vram-budget", "6GiB,20GiB")
    assert r.exit_code == 0, r.output
    assert "--vram-budget has no effect" in r.stderr
    plain = invoke("run", "-p", "import os", "-n", "6", "--temp", "0", "--no-display-prompt")
    assert r.stdout == plain.stdout


def test_runtime_config_checks_vram_budgets():
    from moerun.config import RuntimeConfig

    assert RuntimeConfig(vram_budget=(6 << 30,)).vram_budget == (6 << 30,)
    for bad in ((), (0,), (-1,), 6 << 30):
        with pytest.raises(ValueError, match="vram_budget"):
            RuntimeConfig(vram_budget=bad)


def _moerun(*args, **kw):
    return subprocess.run([sys.executable, "-m", "moerun", *map(str, args)], capture_output=True, text=True,
                          timeout=120, check=False, **kw)


@pytest.mark.parametrize("args", [(), ("--no-display-prompt",), ("-sys", "be brief"), ("--stop", "e")])
def test_run_output_ends_with_a_newline(args):
    r = _moerun("run", "-p", "hello", "-n", "5", "--temp", "0", *args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n"), repr(r.stdout)


def test_a_prompt_longer_than_the_context_is_refused_before_it_is_echoed(tmp_path):
    long = tmp_path / "long.txt"
    long.write_text("word " * 200)
    r = _moerun("run", "-c", "64", "-f", long)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [("error: the prompt has 400 tokens but the context size is 64: give a larger -c "
                                     "or a shorter prompt")]


def test_mlock_locks_or_says_in_one_line_why_not():
    r = _moerun("run", "--mlock", "-p", "hi", "-n", "2")
    assert r.returncode == 0, r.stderr
    assert sum("--mlock" in line for line in r.stderr.splitlines()) <= 1


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="drops root's CAP_IPC_LOCK")
def test_mlock_refused_by_the_limit_is_one_warning():
    def low_limit():
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, 1 << 20))

    cmd = ["setpriv", "--bounding-set", "-ipc_lock", "--inh-caps", "-ipc_lock", sys.executable, "-m", "moerun",
           "run", "--mlock", "-p", "hi", "-n", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, preexec_fn=low_limit)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "mlock" in line]
    assert lines == [("warning: --mlock: the weights are not locked in RAM: Cannot allocate memory (the "
                     "locked-memory limit, ulimit -l, is 1.00 MiB)")], r.stderr


def test_an_expert_cache_too_small_for_one_slot_says_so():
    r = _moerun("run", "-p", "hi", "-n", "2", "--expert-cache-mib", "0.001")
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stderr.splitlines() if "expert-cache-mib" in line] == [
        ("warning: --expert-cache-mib 0.001 gives no expert cache (0 slots): one slot in each of the 4 MoE layers "
         "takes 0.84 MiB; every expert is read from its home tier")]
