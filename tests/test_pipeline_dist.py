"""Stages in two processes on localhost over gloo: the same greedy tokens and logits as one process, and a
peer that crashes, stops answering or never joins ends in a clear error, never a hang.

No test here bounds how fast anything runs. Joining and ordinary steps get HANG_GUARD_S (a process start
on a loaded machine must never look like a dead peer); a test of a failing peer gives rank 0 a short step
timeout of its own and bounds the call that must fail by a hang guard 40 times that timeout.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch

from moerun.config import RuntimeConfig
from moerun.distributed import PipelineError
from moerun.engine.kv_cache import KVPool, SeqKV
from moerun.loading import load_model
from moerun.runtime import build

# process groups over gloo (~25 s in all): `python -m pytest -m slow`, and CI
pytestmark = pytest.mark.slow

HANG_GUARD_S = 300  # joins, steps and process exits: only a hang comes near it, however loaded the machine

@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from moerun.tools.make_model import make_model
    from moerun.tools.presets import preset

    path = tmp_path_factory.mktemp("dist") / "tiny.gguf"
    return make_model(preset("tiny-qwen2moe", layers=5), path, ftype="Q8_0", progress=False, threads=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def moerun(*args) -> list[str]:
    return [sys.executable, "-m", "moerun", *map(str, args)]


def pipeline_args(rank: int, port: int, timeout: float = HANG_GUARD_S) -> list[str]:
    return ["--pipeline-rank", str(rank), "--pipeline-world-size", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(port), "--pipeline-timeout", str(timeout), "-t", "1"]


def start(cmd: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def finish(p: subprocess.Popen, timeout: float = HANG_GUARD_S) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"{p.args[3:]} still running after {timeout} s: {err[-2000:]}")
    return p.returncode, out, err


def ends_within(seconds: float, fn, *args):
    """fn(*args) in a thread: what it returns or raises, or a test failure if it is still running after
    `seconds` (a hang guard, not a speed bound)."""
    out = {}

    def call():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            out["error"] = e

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"still running after {seconds} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_two_processes_greedy_output_equals_one(model_path):
    run = ["run", "-m", model_path, "-p", "Stages pass the hidden state", "-n", "16", "--temp", "0", "--ignore-eos",
           "--json", "--expert-cache-slots", "3", "--tensor-split", "2,3"]
    port = free_port()
    worker = start(moerun(*run, *pipeline_args(1, port)))
    first = start(moerun(*run, *pipeline_args(0, port)))
    rc0, out0, err0 = finish(first)
    rc1, out1, err1 = finish(worker)
    assert rc0 == 0 and rc1 == 0, err0[-2000:] + err1[-2000:]
    assert out1 == ""  # the worker runs no command of its own
    rc, out, err = finish(start(moerun(*run[:-2], "-t", "1")))  # one process, the whole model
    assert rc == 0, err
    two, one = json.loads(out0), json.loads(out)
    assert two["tokens"] == one["tokens"] and len(one["tokens"]) == 16 and two["text"] == one["text"]
    stages = two["expert_cache_stages"]
    assert [s["stage"] for s in stages] == ["rank 0 (cpu, layers 0-1)", "rank 1 (layers 2-4)"]
    for phase in ("prefill", "decode"):
        for key in ("queries", "hits", "misses"):
            assert sum(s["total"][phase][key] for s in stages) == two["expert_cache"]["total"][phase][key]


@pytest.fixture
def rank0(model_path):
    """(rank 0's Runtime in this process, the worker process, a one-process model for reference)."""
    port = free_port()
    worker = start(moerun("run", "-m", model_path, *pipeline_args(1, port)))
    rt = build(RuntimeConfig(model=str(model_path), threads=1, pipeline_world_size=2, master_port=port,
                             pipeline_timeout=HANG_GUARD_S))
    yield rt, worker, load_model(model_path).model
    rt.close()
    if worker.poll() is None:
        worker.send_signal(signal.SIGCONT)
    finish(worker)


STEP_TIMEOUT_S = 3


def short_step_timeout(rt) -> None:
    """Rank 0 waits STEP_TIMEOUT_S on the worker from now on (its Link's timeout; it joined with
    HANG_GUARD_S)."""
    rt.engine.model.link.timeout = timedelta(seconds=STEP_TIMEOUT_S)


def test_two_processes_logits_equal_one(rank0, tokens32):
    rt, _, ref = rank0
    model, tokens = rt.engine.model, tokens32 % ref.spec.vocab
    assert [d.layers for d in rt.plan.devices] == [(0, 2), (2, 5)] and model.model.first == 0
    assert torch.equal(model.forward(tokens), ref.forward(tokens))  # no cache
    pools = rt.engine.pool, KVPool(ref.spec, rt.engine.pool.n_slots)
    assert (pools[0].first, pools[0].stop) == (0, 2)  # rank 0's KV holds its own layers only
    a, b = ([SeqKV(p, 128) for p in pools] for _ in range(2))
    for kv in b:
        kv.reserve(5)  # b takes the first block, so a's block table does not start at 0
    for chunk in (tokens[:20], tokens[20:]):
        assert torch.equal(model.forward(chunk, a[0], last_only=True), ref.forward(chunk, a[1], last_only=True))
    assert torch.equal(model.forward(tokens[:7], b[0]), ref.forward(tokens[:7], b[1]))
    step = torch.tensor([3, 9])
    for _ in range(4):
        got, want = model.decode(step, [a[0], b[0]]), ref.decode(step, [a[1], b[1]])
        assert torch.equal(got, want)
        step = want.argmax(-1)
    a[0].truncate(10), a[1].truncate(10)  # a chat's next turn re-prefills from where it diverges
    assert torch.equal(model.forward(tokens[10:15], a[0]), ref.forward(tokens[10:15], a[1]))


@pytest.mark.parametrize("name", ["tiny-qwen2moe", "tiny-qwen35moe"])
def test_prefix_copies_and_recurrent_states_follow_rank0(name, tmp_path_factory):
    """Steps of several sequences over two stages give one process's tokens and logits: a shared prefix block that
    rank 0's pool copies (copy on write) is copied on rank 1 too, and a hybrid model's recurrent states (each
    sequence's slot, checkpoints taken and restored on truncation) live on the rank holding their layers."""
    from test_expert_parallel import close, model_file, steps

    path = model_file(tmp_path_factory, name)
    one_tokens, one = steps(build(RuntimeConfig(model=path, threads=1)))
    port = free_port()
    worker = start(moerun("run", "-m", path, *pipeline_args(1, port)))
    rt = build(RuntimeConfig(model=path, threads=1, pipeline_world_size=2, master_port=port,
                             pipeline_timeout=HANG_GUARD_S))
    tokens, logits = steps(rt)
    rt.close()
    rc, out, err = finish(worker)
    assert rc == 0 and out == "", err[-2000:]
    print(f"{name} 2 stages: max |dlogit| {(logits - one).abs().max().item():.3g}")
    assert tokens == one_tokens and close(logits, one)


def test_worker_crash_is_a_clear_error(rank0, tokens32):
    rt, worker, ref = rank0
    rt.engine.model.forward(tokens32[:4] % ref.spec.vocab)
    worker.kill()
    worker.wait()
    short_step_timeout(rt)
    # gloo reports a dead peer as a reset, or (a send into a closed socket on a busy machine) as a timeout;
    # the hang guard is 40 times the step timeout, and far below the group's HANG_GUARD_S
    with pytest.raises(PipelineError, match="rank 1 (is gone|did not answer within 3 s)"):
        ends_within(40 * STEP_TIMEOUT_S, rt.engine.model.forward, tokens32[:4] % ref.spec.vocab)


def test_worker_that_stops_answering_times_out(rank0, tokens32):
    rt, worker, ref = rank0
    short_step_timeout(rt)
    worker.send_signal(signal.SIGSTOP)
    with pytest.raises(PipelineError, match="rank 1 did not answer within 3 s"):
        ends_within(40 * STEP_TIMEOUT_S, rt.engine.model.forward, tokens32[:4] % ref.spec.vocab)
    worker.kill()  # stopped mid-step: it has nothing left to show, and must not wait out its own timeout
    worker.wait()


def test_rank0_alone_gives_up_joining(model_path):
    # a 2 s join timeout; finish()'s hang guard fails the test if it is not what ends the process
    rc, _, err = finish(start(moerun("run", "-m", model_path, "-p", "x", *pipeline_args(0, free_port(), 2))))
    assert rc == 1 and "could not join the pipeline" in err and "within 2 s" in err and "Traceback" not in err


def test_worker_exits_when_rank0_dies(model_path):
    port = free_port()
    worker = start(moerun("run", "-m", model_path, *pipeline_args(1, port)))
    chat = start(moerun("chat", "-m", model_path, "-n", "4", "--temp", "0", *pipeline_args(0, port)),
                 stdin=subprocess.PIPE)
    chat.stdin.write("hello\n")
    chat.stdin.flush()
    deadline = time.monotonic() + HANG_GUARD_S
    while "eval time" not in (line := chat.stderr.readline()):
        assert line, "rank 0 ended before its first reply"
        assert time.monotonic() < deadline, f"no reply within {HANG_GUARD_S} s"
    chat.kill()  # while the worker idles, waiting for the next step
    chat.communicate()
    rc, _, err = finish(worker)
    assert rc == 1 and "rank 0 is gone" in err and "Traceback" not in err


def test_a_rank_without_layers_is_refused_on_every_rank(model_path):
    port = free_port()
    run = ["run", "-m", model_path, "-p", "x", "--tensor-split", "0,1"]
    procs = [start(moerun(*run, *pipeline_args(rank, port))) for rank in (1, 0)]
    for p in procs:
        rc, _, err = finish(p)
        assert rc == 1 and "pipeline rank 0 would hold no layers" in err and "Traceback" not in err
