"""`moerun bench` over expert-parallel ranks (issue 40): ranks in one process (`--devices cpu,cpu`), and
processes each running the same command with its `--ep-rank` (every test a group of its own, on the next port),
or a pipeline of two processes the same way; rank 0 prints the records, with each rank's cache counters and the
all-gathers' counters (one per MoE layer a step), and torchrun's variables make the processes the ranks. No test
here bounds how fast anything runs.
"""

from __future__ import annotations

import json
import socket
import sys

import pytest
from test_expert_parallel import model_file
from test_pipeline_dist import HANG_GUARD_S, finish, moerun, start

BENCH = ["bench", "-p", "12", "-n", "4", "-r", "2", "-t", "1", "-o", "jsonl", "--expert-cache-mib", "0.05"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return model_file(tmp_path_factory, "tiny-qwen3moe")


def free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 all free now (bench's tests join on consecutive ports)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        try:
            for p in range(first, first + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports")


def records(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


def test_bench_over_ranks_in_one_process(tiny):
    rc, out, err = finish(start(moerun(*BENCH, "-m", tiny, "--expert-parallel", "2", "--devices", "cpu,cpu")))
    assert rc == 0, err[-2000:]
    pp, tg = records(out)
    assert (pp["n_prompt"], tg["n_gen"]) == (12, 4)
    for rec in (pp, tg):
        assert rec["devices"] == "cpu,cpu"
        assert [s["stage"] for s in rec["expert_cache_stages"]] == ["rank 0 (cpu)", "rank 1 (cpu)"]
        assert all(s["misses"] > 0 for s in rec["expert_cache_stages"])
        assert rec["ep_gathers"] is None and rec["ep_gather_ms"] is None  # no all-gather between devices


@pytest.mark.slow
def test_bench_over_two_processes(tiny):
    port = free_ports(2)
    ranks = ["--ep-world-size", "2", "--master-port", str(port), "--ep-timeout", str(HANG_GUARD_S)]
    worker = start(moerun(*BENCH, "-m", tiny, *ranks, "--ep-rank", "1"))
    rc0, out0, err0 = finish(start(moerun(*BENCH, "-m", tiny, *ranks, "--ep-rank", "0")))
    rc1, out1, err1 = finish(worker)
    assert rc0 == 0, err0[-2000:]
    assert rc1 == 0 and out1 == "", err1[-2000:]
    pp, tg = records(out0)
    moe_layers = 3
    for rec, steps in ((pp, 1), (tg, 4)):
        assert rec["devices"] == "2 processes (cpu)" and rec["estimate_ts"] is None
        assert [s["stage"] for s in rec["expert_cache_stages"]] == ["rank 0 (cpu)", "rank 1"]
        assert rec["ep_gathers"] == moe_layers  # one all-gather per MoE layer a step, warm-up left out
        assert len(rec["ep_gather_ms"]) == 2 and all(ms > 0 for ms in rec["ep_gather_ms"])
        assert rec["avg_ts"] > 0 and len(rec["samples_ns"]) == 2


@pytest.mark.slow
def test_bench_over_a_two_process_pipeline(tiny):
    port = free_ports(2)
    ranks = ["--pipeline-world-size", "2", "--master-port", str(port), "--pipeline-timeout", str(HANG_GUARD_S)]
    worker = start(moerun(*BENCH, "-m", tiny, *ranks, "--pipeline-rank", "1"))
    rc0, out0, err0 = finish(start(moerun(*BENCH, "-m", tiny, *ranks, "--pipeline-rank", "0")))
    rc1, out1, err1 = finish(worker)
    assert rc0 == 0 and rc1 == 0 and out1 == "", err0[-2000:] + err1[-2000:]
    for rec in records(out0):
        assert rec["devices"] == "2 processes (cpu)" and rec["ep_gathers"] is None
        assert [s["stage"] for s in rec["expert_cache_stages"]] == ["rank 0 (cpu, layers 0-1)", "rank 1 (layers 2-2)"]


def test_torchrun_variables_make_the_processes_expert_parallel_ranks(monkeypatch):
    from moerun.cli_bench import _ranks

    base = {"expert_parallel": 2, "ep_rank": 0, "ep_world_size": 1, "ep_timeout": 5.0, "expert_split": None,
            "pipeline_rank": 1, "pipeline_world_size": 2, "pipeline_timeout": 5.0, "master_addr": "10.0.0.1",
            "master_port": 29400}
    monkeypatch.setenv("WORLD_SIZE", "2")
    got = _ranks(dict(base))
    assert got == {"expert_parallel": 2, "ep_rank": 1, "ep_world_size": 2, "ep_timeout": 5.0, "expert_split": None,
                   "master_addr": "10.0.0.1", "master_port": 29400}
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # torchrun's store holds MASTER_PORT
    assert _ranks(dict(base))["master_port"] == 29401
    assert _ranks(dict(base, expert_parallel=1))["pipeline_rank"] == 1  # without --expert-parallel: a pipeline
    monkeypatch.delenv("WORLD_SIZE")
    assert _ranks(dict(base, pipeline_rank=0, pipeline_world_size=1)) == {
        "expert_parallel": 2, "ep_rank": 0, "ep_world_size": 1, "ep_timeout": 5.0, "expert_split": None}


@pytest.mark.slow
def test_bench_under_torchrun(tiny):
    port = free_ports(3)  # torchrun's store, then the two tests' groups
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           "-m", "moerun", *BENCH, "-m", tiny, "--expert-parallel", "2", "--ep-timeout", str(HANG_GUARD_S)]
    rc, out, err = finish(start(cmd))
    assert rc == 0, err[-2000:]
    assert [(r["n_prompt"], r["n_gen"], r["ep_gathers"]) for r in records(out)] == [(12, 0, 3), (0, 4, 3)]


def test_a_bad_rank_setting_is_one_usage_line(tiny):
    rc, _, err = finish(start(moerun("bench", "-m", tiny, "--expert-parallel", "3", "--ep-world-size", "2")))
    assert rc == 2 and "one rank per process" in err and "Traceback" not in err
