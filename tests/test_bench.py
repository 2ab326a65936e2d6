"""`moerun bench` and the host-bandwidth cache: formats parse, fields and counts, llama-bench's sweeps.

No timing assertions: the machine is shared and the numbers are noise at this size.
"""

import csv
import io
import json

import pytest
from click.testing import CliRunner

from moerun.bench import FIELDS, LIST_FIELDS, expand_cases, parse_int_lists, parse_int_range
from moerun.cli import main
from moerun.placement import bandwidth


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moerun.tools.make_model import make_model

    return make_model("tiny-qwen3moe", tmp_path_factory.mktemp("bench") / "tiny.gguf", progress=False)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """An empty cache, and a machine where nothing else runs as the probes see it (moerun.placement.load): what
    bench does with a figure does not depend on the other processes on this shared machine."""
    import time

    from moerun.placement import load

    monkeypatch.setenv("MOERUN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(load, "read", lambda: load.Sample(time.monotonic(), 0.0, 0.0, 0.0))
    return tmp_path / "cache"


def bench(*args):
    r = CliRunner().invoke(main, ["bench", *map(str, args)])
    assert r.exit_code == 0, r.output + (r.stderr if r.stderr_bytes is not None else "")
    return r.stdout


def test_ranges_expand_as_llama_bench():
    assert parse_int_range("512") == [512]
    assert parse_int_range("128,512") == [128, 512]
    assert parse_int_range("1-4") == [1, 2, 3, 4]
    assert parse_int_range("0-512+128") == [0, 128, 256, 384, 512]
    assert parse_int_range("16-128*2") == [16, 32, 64, 128]
    assert parse_int_range("1-2,64-256*4") == [1, 2, 64, 256]
    assert parse_int_range("5-1") == []  # llama-bench's loop does not run either
    assert parse_int_lists(["1", "2-3"]) == [1, 2, 3]  # a flag given twice appends
    for bad in ("", "a", "1-", "1-4+0", "0-4*2", "1-4/2", "1,,2", "-1"):
        with pytest.raises(ValueError):
            parse_int_range(bad)


def test_cases_follow_llama_bench_order_and_skip_zero():
    cases = expand_cases(["a", "b"], [0, 64], [0, 8, 16], [32], [1, 2])
    assert [(c.model, c.n_threads, c.name) for c in cases] == [
        ("a", 1, "pp64"), ("a", 1, "tg8"), ("a", 1, "tg16"), ("a", 2, "pp64"), ("a", 2, "tg8"), ("a", 2, "tg16"),
        ("b", 1, "pp64"), ("b", 1, "tg8"), ("b", 1, "tg16"), ("b", 2, "pp64"), ("b", 2, "tg8"), ("b", 2, "tg16"),
    ]
    assert expand_cases(["a"], [0], [0], [512], [1]) == []


def test_json_fields_and_counts(tiny):
    recs = json.loads(bench("-m", tiny, "-p", "16,32", "-n", "4", "-r", "3", "-t", "1", "-ub", "8", "-o", "json"))
    assert [(r["n_prompt"], r["n_gen"]) for r in recs] == [(16, 0), (32, 0), (0, 4)]
    for r in recs:
        assert list(r) == FIELDS
        assert r["n_threads"] == 1 and r["n_ubatch"] == 8 and r["model_filename"] == str(tiny)
        assert r["model_type"].startswith("qwen3moe") and r["model_size"] > 0 and r["model_n_params"] > 0
        assert len(r["samples_ns"]) == len(r["samples_ts"]) == 3
        n = r["n_prompt"] + r["n_gen"]
        assert r["samples_ts"] == pytest.approx([n * 1e9 / ns for ns in r["samples_ns"]])
        assert r["avg_ts"] == pytest.approx(sum(r["samples_ts"]) / 3)
        assert r["avg_ns"] == pytest.approx(sum(r["samples_ns"]) / 3, abs=1)
        # nothing cached: measured once, at the start, for every test of the run
        assert r["bytes_per_token"] > 0 and r["host_read_gbps"] > 0 and r["host_read_source"] == "measured"
        assert r["host_read_gbps"] == recs[0]["host_read_gbps"]
        assert r["expert_cache_hits"] is None and r["expert_cache_hit_rate"] is None
    pp, tg = recs[0], recs[2]
    assert pp["achieved_gbps"] is None and pp["bound_ts"] is None and pp["bound_fraction"] is None
    assert tg["achieved_gbps"] == pytest.approx(tg["bytes_per_token"] * tg["avg_ts"] / 1e9)
    assert tg["bound_ts"] == pytest.approx(tg["host_read_gbps"] * 1e9 / tg["bytes_per_token"])
    assert tg["bound_fraction"] == pytest.approx(tg["avg_ts"] / tg["bound_ts"])


def test_jsonl_and_csv_parse(tiny):
    lines = bench("-m", tiny, "-p", "8", "-n", "2", "-r", "2", "-t", "1,2", "-o", "jsonl").splitlines()
    recs = [json.loads(line) for line in lines]
    assert [(r["n_threads"], r["n_prompt"], r["n_gen"]) for r in recs] == [(1, 8, 0), (1, 0, 2), (2, 8, 0), (2, 0, 2)]
    assert all(len(r["samples_ns"]) == 2 for r in recs)

    rows = list(csv.DictReader(io.StringIO(bench("-m", tiny, "-p", "8", "-n", "2", "-r", "2", "-t", "1", "-o", "csv"))))
    assert len(rows) == 2
    assert list(rows[0]) == [f for f in FIELDS if f not in LIST_FIELDS]
    assert (rows[0]["n_prompt"], rows[0]["n_gen"], rows[1]["n_prompt"], rows[1]["n_gen"]) == ("8", "0", "0", "2")
    assert rows[0]["achieved_gbps"] == "" and float(rows[1]["achieved_gbps"]) > 0


def test_markdown_table(tiny):
    out = bench("-m", tiny, "-p", "8", "-n", "2,3", "-r", "1", "-t", "1", "--no-warmup").splitlines()
    header = [c.strip() for c in out[0].strip("|").split("|")]
    assert header == ["model", "size", "params", "backend", "threads", "test", "t/s", "GB/s", "% of bound"]
    assert set(out[1]) <= set("|-: ")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out[2:]]
    assert [r[5] for r in rows] == ["pp8", "tg2", "tg3"]
    assert all("±" in r[6] for r in rows)
    assert rows[0][7] == "-" and rows[1][7] != "-"


def test_p0_skips_pp_and_n0_skips_tg(tiny):
    recs = [json.loads(x) for x in bench("-m", tiny, "-p", "0", "-n", "2", "-r", "1", "-o", "jsonl").splitlines()]
    assert [(r["n_prompt"], r["n_gen"]) for r in recs] == [(0, 2)]
    recs = [json.loads(x) for x in bench("-m", tiny, "-p", "4", "-n", "0", "-r", "1", "-o", "jsonl").splitlines()]
    assert [(r["n_prompt"], r["n_gen"]) for r in recs] == [(4, 0)]


def test_bad_model_path_is_one_line(tiny, tmp_path):
    r = CliRunner().invoke(main, ["bench", "-m", str(tiny), "-m", str(tmp_path / "nope.gguf"), "-r", "1"])
    assert r.exit_code == 1
    assert r.stdout == ""  # every model is checked before any test runs
    assert r.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope.gguf'}: no such file or directory"]


def test_measured_bandwidth_is_cached_and_reported(tiny, cache_dir, monkeypatch):
    from moerun.placement import load

    monkeypatch.setattr(load, "WIDE_SPREAD", float("inf"))  # 1 MiB passes are noise: kept, never measured again
    assert bandwidth.host_read_bandwidth(1) == (bandwidth.DEFAULT_HOST_READ_GBPS, "default")
    gbps, source = bandwidth.host_read_bandwidth(1, measure=True, nbytes=1 << 20, runs=3)
    assert source == "measured" and gbps > 0
    assert bandwidth.host_read_bandwidth(1) == (gbps, "cached")
    assert bandwidth.host_read_bandwidth(2)[1] == "default"  # keyed by thread count
    data = json.loads((cache_dir / "hardware.json").read_text())
    entry = data["host_read_bandwidth"]["1"]
    assert entry["gbps"] == gbps and entry["runs"] == 3 and len(entry["samples_gbps"]) == 3
    assert entry["measured_at"].startswith("20")
    assert entry["trusted"] is True and entry["load"]["others_cores"] == 0.0 and "spread" in entry

    rec = json.loads(bench("-m", tiny, "-p", "0", "-n", "2", "-r", "1", "-t", "1", "-o", "jsonl"))
    assert (rec["host_read_gbps"], rec["host_read_source"]) == (gbps, "cached")


def test_bandwidth_cache_keeps_other_keys_and_survives_garbage(cache_dir):
    cache_dir.mkdir(parents=True)
    path = cache_dir / "hardware.json"
    path.write_text("not json")
    assert bandwidth.host_read_bandwidth(4) == (bandwidth.DEFAULT_HOST_READ_GBPS, "default")
    path.write_text(json.dumps({"h2d": {"gbps": 12.0}}))
    bandwidth.store_host_read_bandwidth(4, {"gbps": 33.5, "measured_at": "2026-01-01T00:00:00+00:00"})
    data = json.loads(path.read_text())
    assert data["h2d"] == {"gbps": 12.0} and data["host_read_bandwidth"]["4"]["gbps"] == 33.5
    assert bandwidth.host_read_bandwidth(4) == (33.5, "cached")


def test_an_older_probe_revision_is_measured_again(cache_dir):
    """A kernel-pool figure from before PROBE_REVISION (the probe that read too little) does not count; figures
    given by hand (no method) do."""
    old = {"gbps": 21.0, "method": "kernel pool, 1 stream(s) per thread, prefetch 0 B"}
    bandwidth.store_host_read_bandwidth(2, old)
    assert bandwidth.host_read_bandwidth(2) == (bandwidth.DEFAULT_HOST_READ_GBPS, "default")
    bandwidth.store_host_read_bandwidth(2, {**old, "probe": bandwidth.PROBE_REVISION})
    assert bandwidth.host_read_bandwidth(2) == (21.0, "cached")
    bandwidth.store_host_read_bandwidth(3, {"gbps": 30.0})
    assert bandwidth.host_read_bandwidth(3) == (30.0, "cached")
    entry = bandwidth.measure_host_read_bandwidth(1, nbytes=1 << 20, runs=1)
    assert entry["probe"] == bandwidth.PROBE_REVISION


def test_measure_restores_torch_threads():
    import torch

    before = torch.get_num_threads()
    bandwidth.measure_host_read_bandwidth(1, nbytes=1 << 16, runs=1)
    assert torch.get_num_threads() == before


def test_expert_cache_sweep_counts_the_timed_runs(tiny):
    """--expert-cache-mib: one test per size, hits and queries of the timed runs' phase; none: no cache."""
    from moerun.loading import load_model

    store = load_model(tiny).model.store
    per_expert = store.expert_bytes(store.layers[0]) / 2**20
    mib = 2 * per_expert * len(store.layers)  # two slots per layer
    recs = json.loads(bench("-m", tiny, "-p", "8", "-n", "6", "-r", "2", "-t", "1", "-o", "json",
                            "--expert-cache-mib", f"{mib},none", "--cache-policy", "lfu"))
    assert [(r["expert_cache_mib"], r["n_prompt"]) for r in recs] == [(mib, 8), (mib, 0), (None, 8), (None, 0)]
    k = 2  # tiny-qwen3moe routes 2 of its experts per token
    pp, tg = recs[0], recs[1]
    assert tg["expert_cache_queries"] == 2 * 6 * len(store.layers) * k  # runs x tokens x layers x k, no warm-up
    assert 0 <= tg["expert_cache_hits"] <= tg["expert_cache_queries"]
    assert tg["expert_cache_hit_rate"] == pytest.approx(tg["expert_cache_hits"] / tg["expert_cache_queries"])
    assert pp["expert_cache_queries"] > 0 and pp["expert_cache_hits"] == 0  # prefill bypasses the cache
    assert all(r["expert_cache_hits"] is None and r["expert_cache_queries"] is None for r in recs[2:])
    md = bench("-m", tiny, "-p", "0", "-n", "4", "-r", "1", "-t", "1", "--expert-cache-mib", f"{mib}")
    assert " cache |" in md.splitlines()[0] and f"{mib:g} MiB" in md


def test_prefetch_reports_its_precision(tiny):
    """--prefetch: the decode test's record carries the guesses' precision; without it there is none."""
    from moerun.loading import load_model

    store = load_model(tiny).model.store
    mib = 2 * store.expert_bytes(store.layers[0]) / 2**20 * len(store.layers)
    args = ("-m", tiny, "-p", "0", "-n", "6", "-r", "1", "-t", "1", "-o", "json", "--expert-cache-mib", f"{mib}")
    on, off = json.loads(bench(*args, "--prefetch"))[0], json.loads(bench(*args))[0]
    assert on["expert_cache_prefetch_precision"] is not None and 0 <= on["expert_cache_prefetch_precision"] <= 1
    assert off["expert_cache_prefetch_precision"] is None
    assert on["expert_cache_queries"] == off["expert_cache_queries"]


def test_bad_cache_size_is_a_usage_error(tiny):
    r = CliRunner().invoke(main, ["bench", "-m", str(tiny), "--expert-cache-mib", "lots"])
    assert r.exit_code == 2 and "lots" in r.output


def test_thread_budget_sets_and_restores_both_pools():
    import torch

    from moerun.kernels import cpu
    from moerun.model.ops import thread_budget

    before = torch.get_num_threads(), cpu.get_threads() if cpu.available() else None
    with thread_budget(1):
        assert torch.get_num_threads() == 1
        if cpu.available():
            assert cpu.get_threads() == 1
    assert (torch.get_num_threads(), cpu.get_threads() if cpu.available() else None) == before


def test_trace_routing_records_the_timed_runs(tiny, tmp_path):
    from moerun.experts.trace import read_trace
    from moerun.loading import load_model

    path = tmp_path / "bench.jsonl"
    bench("-m", tiny, "-p", "8", "-n", "5", "-r", "2", "-t", "1", "-o", "json", "--trace-routing", path)
    records = read_trace(path).records
    n_layers = len(load_model(tiny).model.store.layers)
    decode = [r for r in records if r.phase == "decode"]
    prefill = [r for r in records if r.phase == "prefill"]
    assert len(decode) == 2 * 5 * n_layers  # timed runs x tokens x MoE layers; the warm-up is not recorded
    assert len(prefill) == 2 * 8 * n_layers  # one record per token and layer
    r = CliRunner().invoke(main, ["bench", "-m", str(tiny), "-p", "0", "-n", "2", "-r", "1", "--trace-routing", str(path)])
    assert r.exit_code == 1 and "already exists" in r.output
