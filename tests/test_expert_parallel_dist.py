"""Expert parallelism over 2 and 3 processes on localhost (gloo; issue 40): the logits equal the same split in one
process bit for bit and one rank's within 1e-5 (fp32), greedy tokens are the same, each rank has its own expert
cache; a rank that crashes or stops answering ends rank 0's step with one ExpertParallelError, never a hang.

No test here bounds how fast anything runs: joins and steps get HANG_GUARD_S; a test of a failing rank gives
rank 0 a short step timeout and bounds the call that must fail by a hang guard 40 times that.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
from test_expert_parallel import PROMPT, close, model_file, steps
from test_pipeline_dist import HANG_GUARD_S, ends_within, finish, free_port, moerun, start

from moerun.config import DraftParams, RuntimeConfig, SamplingParams
from moerun.expert_parallel import ExpertParallelError
from moerun.experts.stats import CacheStats
from moerun.runtime import build

pytestmark = pytest.mark.slow  # process groups: `python -m pytest -m slow`, and CI

WORKER = ("import json, sys\nfrom moerun.config import RuntimeConfig\nfrom moerun.runtime import serve_worker\n"
          "serve_worker(RuntimeConfig(**json.loads(sys.argv[1])))")
STEP_TIMEOUT_S = 3


def start_ranks(path: str, world: int, rank0: dict | None = None, **kw) -> tuple[object, list[subprocess.Popen]]:
    """(rank 0's Runtime in this process, ranks 1.. as processes); rank0: settings of rank 0's alone."""
    port = free_port()
    cfg = dict(model=path, threads=1, ep_world_size=world, master_port=port, ep_timeout=HANG_GUARD_S, **kw)
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(cfg | {"ep_rank": r})],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(1, world)]
    return build(RuntimeConfig(**cfg, **(rank0 or {}))), workers


def stop(rt, workers) -> list[tuple[int, str, str]]:
    rt.close()
    return [finish(w) for w in workers]


@pytest.fixture(scope="module")
def qwen2moe(tmp_path_factory):
    return model_file(tmp_path_factory, "tiny-qwen2moe")


@pytest.mark.parametrize("world", [2, 3])
def test_processes_equal_one_process(qwen2moe, world):
    one_tokens, one = steps(build(RuntimeConfig(model=qwen2moe, threads=1)))
    here_tokens, here = steps(build(RuntimeConfig(model=qwen2moe, threads=1, expert_parallel=world)))
    rt, workers = start_ranks(qwen2moe, world)
    tokens, logits = steps(rt)
    for rc, out, err in stop(rt, workers):
        assert rc == 0 and out == "", err[-2000:]
    print(f"tiny-qwen2moe {world} processes: max |dlogit| {(logits - one).abs().max().item():.3g}")
    assert tokens == here_tokens == one_tokens
    assert torch.equal(logits, here)  # the same parts summed in the same order
    assert close(logits, one)


@pytest.mark.parametrize("name", ["tiny-gptoss", "tiny-deepseek2", "tiny-deepseek3", "tiny-glm4moe", "tiny-qwen3moe",
                                  "tiny-mixtral", "tiny-olmoe", "tiny-qwen3next", "tiny-qwen35moe"])
def test_families_over_processes(name, tmp_path_factory):
    path = model_file(tmp_path_factory, name)
    one_tokens, one = steps(build(RuntimeConfig(model=path, threads=1)))
    rt, workers = start_ranks(path, 3)
    tokens, logits = steps(rt)
    assert all(rc == 0 for rc, _, _ in stop(rt, workers))
    print(f"{name} 3 processes: max |dlogit| {(logits - one).abs().max().item():.3g}")
    assert tokens == one_tokens and close(logits, one)


def test_a_cache_per_rank_over_processes(qwen2moe):
    one_tokens, one = steps(build(RuntimeConfig(model=qwen2moe, threads=1)))
    rt, workers = start_ranks(qwen2moe, 2, expert_cache_slots=1)
    tokens, logits = steps(rt)
    stats = dict(rt.stage_stats())
    assert all(rc == 0 for rc, _, _ in stop(rt, workers))
    assert tokens == one_tokens and close(logits, one)
    assert sorted(stats) == ["rank 0 (cpu)", "rank 1"]
    assert all(s.get().misses > 0 for s in stats.values())


def test_speculative_decoding_over_processes(qwen2moe):
    greedy = SamplingParams.greedy(max_tokens=16, ignore_eos=True)
    rt = build(RuntimeConfig(model=qwen2moe, threads=1))
    want = rt.engine.generate(PROMPT * 2, greedy).run().tokens
    for rank0 in ({"draft": DraftParams(lookup_ngram=2, adaptive=False)},
                  {"model_draft": qwen2moe, "draft": DraftParams(draft_p_min=0.0, adaptive=False)}):
        rt, workers = start_ranks(qwen2moe, 2, rank0)
        gen = rt.engine.generate(PROMPT * 2, greedy).run()
        assert all(rc == 0 for rc, _, _ in stop(rt, workers))
        assert gen.tokens == want and gen.timings.draft_n > 0, rank0


@pytest.fixture
def two_ranks(qwen2moe):
    rt, workers = start_ranks(qwen2moe, 2)
    yield rt, workers[0]
    rt.close()
    if workers[0].poll() is None:
        workers[0].send_signal(signal.SIGCONT)
        workers[0].kill()
    finish(workers[0])


def test_a_rank_killed_mid_generation_is_one_error(two_ranks):
    rt, worker = two_ranks
    gen = iter(rt.engine.generate(PROMPT, SamplingParams.greedy(max_tokens=50, ignore_eos=True)))
    next(gen), next(gen)
    worker.kill()
    worker.wait()
    rt.engine.model.link.timeout = timedelta(seconds=STEP_TIMEOUT_S)
    with pytest.raises(ExpertParallelError, match="expert-parallel rank 0, .*rank 1 (is gone|did not answer within 3 s)"):
        ends_within(40 * STEP_TIMEOUT_S, lambda: list(gen))


def test_a_rank_that_stops_answering_times_out(two_ranks):
    rt, worker = two_ranks
    rt.engine.model.forward(torch.tensor(PROMPT[:4]))
    rt.engine.model.link.timeout = timedelta(seconds=STEP_TIMEOUT_S)
    worker.send_signal(signal.SIGSTOP)
    with pytest.raises(ExpertParallelError, match="rank 1 did not answer within 3 s"):
        ends_within(40 * STEP_TIMEOUT_S, rt.engine.model.forward, torch.tensor(PROMPT[:4]))


def ep_args(rank: int, world: int, port: int, timeout: float = HANG_GUARD_S) -> list[str]:
    return ["--ep-rank", str(rank), "--ep-world-size", str(world), "--master-port", str(port), "--ep-timeout",
            str(timeout), "-t", "1"]


def test_run_over_processes_from_the_command_line(qwen2moe):
    run = ["run", "-m", qwen2moe, "-p", "Experts split over ranks", "-n", "12", "--temp", "0", "--ignore-eos",
           "--json", "--expert-cache-slots", "2"]
    port = free_port()
    workers = [start(moerun(*run, *ep_args(r, 3, port))) for r in (1, 2)]
    rc0, out0, err0 = finish(start(moerun(*run, *ep_args(0, 3, port))))
    assert rc0 == 0, err0[-2000:]
    for w in workers:
        rc, out, err = finish(w)
        assert rc == 0 and out == "", err[-2000:]
    rc, out, err = finish(start(moerun(*run, "-t", "1")))
    here = finish(start(moerun(*run, "-t", "1", "--expert-parallel", "3")))
    assert rc == 0 and here[0] == 0, err + here[2]
    three, one, local = json.loads(out0), json.loads(out), json.loads(here[1])
    assert three["tokens"] == one["tokens"] == local["tokens"] and len(one["tokens"]) == 12
    assert [s["stage"] for s in three["expert_cache_stages"]] == ["rank 0 (cpu)", "rank 1", "rank 2"]
    assert [s["stage"] for s in local["expert_cache_stages"]] == ["rank 0 (cpu)", "rank 1 (cpu)", "rank 2 (cpu)"]


def test_rank0_alone_gives_up_joining(qwen2moe):
    rc, _, err = finish(start(moerun("run", "-m", qwen2moe, "-p", "x", *ep_args(0, 2, free_port(), 2))))
    assert rc == 1 and "could not join the expert-parallel group" in err and "within 2 s" in err
    assert "Traceback" not in err


def test_a_rank_exits_when_rank0_dies(qwen2moe):
    port = free_port()
    worker = start(moerun("run", "-m", qwen2moe, *ep_args(1, 2, port)))
    chat = start(moerun("chat", "-m", qwen2moe, "-n", "4", "--temp", "0", *ep_args(0, 2, port)), stdin=subprocess.PIPE)
    chat.stdin.write("hello\n")
    chat.stdin.flush()
    deadline = time.monotonic() + HANG_GUARD_S
    while "eval time" not in (line := chat.stderr.readline()):
        assert line, "rank 0 ended before its first reply"
        assert time.monotonic() < deadline, f"no reply within {HANG_GUARD_S} s"
    chat.kill()  # while the other rank idles, waiting for the next step
    chat.communicate()
    rc, _, err = finish(worker)
    assert rc == 1 and "rank 0 is gone" in err and "Traceback" not in err


@pytest.mark.parametrize("mode, name", [("devices", "tiny-qwen2moe"), ("processes", "tiny-qwen2moe"),
                                        ("processes", "tiny-qwen35moe")])
def test_a_server_with_four_clients(tmp_path_factory, tmp_path, mode, name):
    """`moerun serve -np 4` with 3 ranks (in its process, or it and two more processes) answers 4 clients at once
    with one process's greedy texts (a hybrid model: each sequence's recurrent state in its slot on every rank)."""
    import openai
    from family_checks import ServerProcess

    qwen2moe = model_file(tmp_path_factory, name)
    prompts = ["The experts", "Four clients at once", "Ranks add their parts", "in rank order, every step"]
    rt = build(RuntimeConfig(model=qwen2moe, threads=1))
    rt.engine.resize_pool(4 * 256, seqs=4)
    want = [rt.engine.generate(rt.engine.tokenizer.encode(p), SamplingParams.greedy(max_tokens=12, ignore_eos=True))
            .run().text for p in prompts]
    args, workers = ["-m", qwen2moe, "-t", "1", "-c", "256", "-np", "4", "--expert-cache-slots", "2"], []
    if mode == "processes":
        port = free_port()
        workers = [start(moerun("run", "-m", qwen2moe, "--expert-cache-slots", "2", *ep_args(r, 3, port)))
                   for r in (1, 2)]
        args += ep_args(0, 3, port)
    else:
        args += ["--expert-parallel", "3"]
    server = ServerProcess(args, tmp_path / "serve.log", wait=HANG_GUARD_S)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=HANG_GUARD_S)

        def complete(prompt: str) -> str:
            r = client.completions.create(model="x", prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
            return r.choices[0].text

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(complete, prompts)) == want
    finally:
        server.stop()
    for w in workers:
        rc, out, err = finish(w)
        assert rc == 0 and out == "", err[-2000:]


def test_a_server_that_loses_a_rank_answers_503_and_exits(qwen2moe, tmp_path):
    """Rank 1 killed while the server streams an answer: the stream ends in an error, /health and new requests
    are 503 while it stops, and it exits with one error line within --ep-timeout (and the hang guard)."""
    import openai
    from family_checks import ServerProcess

    port = free_port()
    worker = start(moerun("run", "-m", qwen2moe, *ep_args(1, 2, port, timeout=60)))
    log = tmp_path / "serve.log"
    server = ServerProcess(["-m", qwen2moe, "-c", "512", "-np", "2", *ep_args(0, 2, port, timeout=60)], log,
                           wait=HANG_GUARD_S)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=HANG_GUARD_S)
        stream = iter(client.completions.create(model="x", prompt="A long answer", max_tokens=400, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        next(stream), next(stream)
        worker.kill()
        worker.wait()
        with pytest.raises(openai.APIError, match="cannot be used any more|rank 1"):
            for _ in stream:
                pass
        try:
            status = server.request("GET", "/health", timeout=30).status
        except OSError:  # already gone
            status = 503
        assert status == 503
        assert server.proc.wait(timeout=HANG_GUARD_S) == 1
    finally:
        server.stop()
    text = log.read_text()
    assert "error: the model cannot be used any more: expert-parallel rank 0" in text and "rank 1" in text, text
    assert "Traceback" not in text, text


def cache_series(text: str) -> dict[tuple[str, int, str], tuple[float, float]]:
    """/metrics' expert-cache counters: (rank, layer, phase) -> (queries, hits)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, int, str], list[float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in ("moerun:expert_cache_queries_total", "moerun:expert_cache_hits_total"):
                key = (s.labels["rank"], int(s.labels["layer"]), s.labels["phase"])
                out.setdefault(key, [0.0, 0.0])[s.name.endswith("hits_total")] = s.value
    return {k: (q, h) for k, (q, h) in out.items()}


def test_metrics_show_every_process_rank(qwen2moe, tmp_path):
    """`moerun serve` as rank 0 of 2 processes: /metrics has each rank's expert-cache counters as a series of
    its own (rank 1's fetched from it), equal to those of the same split in one process (`--expert-parallel
    2`, where each rank's cache is in the server's process): the same steps route to the same experts."""
    from family_checks import ServerProcess

    args = ["-m", qwen2moe, "-t", "1", "-c", "256", "-np", "1", "--expert-cache-slots", "2"]

    def served(extra: list[str], log: str) -> dict:
        server = ServerProcess(args + extra, tmp_path / log, wait=HANG_GUARD_S)
        try:
            for prompt in ("The experts", "Ranks add their parts in rank order"):
                body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                r = server.request("POST", "/v1/completions", body, timeout=HANG_GUARD_S)
                assert r.status == 200, r.text
            return cache_series(server.request("GET", "/metrics", timeout=HANG_GUARD_S).text)
        finally:
            server.stop()

    port = free_port()
    worker = start(moerun("run", "-m", qwen2moe, "--expert-cache-slots", "2", *ep_args(1, 2, port)))
    over_processes = served(ep_args(0, 2, port), "ranks.log")
    rc, out, err = finish(worker)
    assert rc == 0 and out == "", err[-2000:]
    in_process = served(["--expert-parallel", "2"], "one.log")
    for rank in ("0", "1"):
        mine = {k: v for k, v in over_processes.items() if k[0] == rank}
        queries, hits = sum(q for q, _ in mine.values()), sum(h for _, h in mine.values())
        assert queries > 0 and hits < queries, (rank, mine)  # lookups, and misses among them
    assert over_processes == in_process


def test_the_engines_cache_reads_and_resets_every_rank(qwen2moe):
    """Rank 0's engine.expert_cache (RankCaches): refresh brings rank 1's statistics (what stage_stats reads
    from it), and its stats' reset starts every rank counting afresh."""
    rt, workers = start_ranks(qwen2moe, 2, expert_cache_slots=1)
    steps(rt)
    cache = rt.engine.expert_cache
    assert cache.stats.ranks == (0, 1) and cache.stats.parts[1].get().queries == 0  # not fetched yet
    cache.refresh()
    fetched = [part + CacheStats() for part in cache.stats.parts]
    assert [s for _, s in rt.stage_stats()] == fetched and all(s.get().misses > 0 for s in fetched)
    cache.stats.reset()
    after = [s.get().queries for _, s in rt.stage_stats()] + [p.get().queries for p in cache.stats.parts]
    assert all(rc == 0 for rc, _, _ in stop(rt, workers))
    assert after == [0, 0, 0, 0]
