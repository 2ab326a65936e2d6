"""A probe that can be trusted (issue 39, item 5): the load and spread each probe records, the verdict in the
cache, the re-run when the machine is quiet again, the lines `estimate` and `bench` print, and bench raising the
host read figure to what a run read.

The load readings are faked (moerun.placement.load.read replaced by a script of counters), the probes stubbed
with fixed figures; one test runs real busy loops and asserts only the "under load" verdict. No timing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest
from click.testing import CliRunner

from moerun.bench import raise_host_read
from moerun.cli import main
from moerun.placement import bandwidth, load, probes
from moerun.placement import costmodel as cm


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("MOERUN_CACHE", str(d))
    return d


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moerun.tools.make_model import make_model

    return make_model("tiny-qwen3moe", tmp_path_factory.mktemp("trust") / "tiny.gguf", ftype="Q8_0", progress=False,
                      threads=1)


class Machine:
    """load.read's stand-in: every reading advances a second of wall time, in which other processes use `others`
    cores and this process `own` cores."""

    def __init__(self, others: float = 0.0, own: float = 1.0):
        self.others, self.own, self.t, self.busy, self.mine, self.reads = others, own, 0.0, 0.0, 0.0, 0

    def read(self) -> load.Sample:
        self.reads += 1
        s = load.Sample(self.t, self.busy, self.mine, 0.5)
        self.t += 1.0
        self.busy += self.others + self.own
        self.mine += self.own
        return s


@pytest.fixture
def machine(monkeypatch) -> Machine:
    m = Machine()
    monkeypatch.setattr(load, "read", m.read)
    return m


def stub_probes(monkeypatch, gbps: float = 33.0, spread: float | None = 0.02) -> dict[str, int]:
    """Every probe replaced by a fixed figure; -> how often each ran."""
    from moerun.placement import layer_probe

    calls = {"ram": 0, "kernels": 0, "float": 0, "file": 0, "layers": 0}

    def count(name, value):
        def probe(*a, **kw):
            calls[name] += 1
            return value(*a) if callable(value) else value
        return probe

    monkeypatch.setattr(bandwidth, "measure_host_read_bandwidth", count("ram", lambda *a: {
        "gbps": gbps, "samples_gbps": [gbps * (1 - (spread or 0)), gbps, gbps * (1 + (spread or 0))],
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}))
    monkeypatch.setattr(probes, "measure_kernels", count("kernels", lambda threads, qtypes: {
        q: {"decode_gbps": 25.0, "prefill_flops": 2e11, "spread": spread} for q in qtypes if q not in cm.F32_NAMES}))
    monkeypatch.setattr(probes, "measure_float_flops", count("float", {"flops": 1e11, "spread": spread}))
    monkeypatch.setattr(probes, "measure_file_read", count("file", 3.0))
    monkeypatch.setattr(layer_probe, "measure_layers", count("layers", {
        "layer_s": 4e-4, "token_s": 1e-4, "prefill_layer_token_s": 1e-4}))
    return calls


# ------------------------------------------------------------------------------------------------ the verdict


def test_the_load_is_the_others_cpu_time(machine):
    machine.others, machine.own = 1.6, 0.4
    with load.Watch() as w:
        pass
    assert w.load["others_cores"] == pytest.approx(1.6) and w.load["own_cores"] == pytest.approx(0.4)
    assert w.load["seconds"] == pytest.approx(1.0) and w.load["loadavg_before"] == 0.5
    assert load.judge(w.load, 0.04) == {"trusted": False, "why": "under load (other processes used 1.6 cores)"}
    machine.others = 0.1
    assert load.is_quiet(load.quiet_now())
    machine.others = 0.3
    assert not load.is_quiet(load.quiet_now())


def test_spread_and_marking():
    assert load.spread([10.0]) is None and load.spread([]) is None
    assert load.spread([2.41, 2.52, 2.62, 2.65, 5.71]) < 0.1  # one slow pass does not make a probe noisy
    assert load.spread([10.0, 20.0, 30.0]) == pytest.approx(0.5)
    quiet = {"others_cores": 0.05}
    assert load.judge(quiet, 0.04) == {"trusted": True, "why": "quiet"}
    assert load.judge(quiet, 0.5)["why"] == "with a wide spread over its passes (50%)"
    assert load.judge(None, None)["trusted"]  # nothing known: nothing against it
    e = load.mark({"gbps": 30.0}, {"others_cores": 1.0}, 0.3)
    assert e["gbps"] == 30.0 and e["trusted"] is False and e["spread"] == 0.3
    assert e["why"] == "under load (other processes used 1.0 cores); with a wide spread over its passes (30%)"
    assert load.why_all([e, load.mark({}, {"others_cores": 1.6}, 0.1)]) == \
        "under load (other processes used up to 1.6 cores) and with a wide spread over their passes (up to 30%)"


def test_a_host_read_probe_under_load_is_marked(machine, monkeypatch, cache):
    stub_probes(monkeypatch, gbps=18.8)
    machine.others = 1.6
    assert bandwidth.host_read_bandwidth(2, measure=True) == (18.8, "measured")
    entry = json.loads((cache / "hardware.json").read_text())["host_read_bandwidth"]["2"]
    assert entry["trusted"] is False and entry["why"] == "under load (other processes used 1.6 cores)"
    assert entry["load"]["others_cores"] == pytest.approx(1.6) and entry["spread"] == pytest.approx(0.02)
    assert bandwidth.host_read_bandwidth(2) == (18.8, "cached")  # still used, with a warning


def test_older_entries_read_as_before_and_count_as_trusted(machine, monkeypatch, cache):
    """Backward compatibility: an entry without the new keys is the figure it was, trusted, its load unknown."""
    cache.mkdir()
    old = {"gbps": 34.6, "measured_at": "2026-12-01T10:00:00+00:00", "probe": bandwidth.PROBE_REVISION,
           "method": "kernel pool, 4 stream(s) per thread, prefetch 0 B"}
    (cache / "hardware.json").write_text(json.dumps({"host_read_bandwidth": {"2": old}}))
    assert bandwidth.host_read_bandwidth(2) == (34.6, "cached")
    assert load.trusted(old) and load.trusted(None)
    now = datetime(2026, 12, 1, 13, 0, tzinfo=timezone.utc)
    assert load.describe(old, now) == "probed 3 h ago (load not recorded)"
    calls = stub_probes(monkeypatch)
    r = probes.gather_rates(probes.RateOptions(threads=2, measure=None))
    assert calls["ram"] == 0 and r.ram_gbps == cm.Figure(34.6, "cached")
    assert machine.reads == 2  # the float probe's watch only: an older entry asks for no quiet check


# ------------------------------------------------------------------------------------ re-run when quiet


def _rates(measure=None, qtypes=("Q8_0",)):
    return probes.gather_rates(probes.RateOptions(threads=2, measure=measure, qtypes=list(qtypes)))


def test_an_untrusted_figure_is_measured_again_when_the_machine_is_quiet(machine, monkeypatch, cache):
    calls = stub_probes(monkeypatch, gbps=18.8)
    machine.others = 1.6
    r = _rates(measure=True)
    assert (r.ram_gbps.value, calls["ram"], calls["kernels"], calls["float"]) == (18.8, 1, 1, 1)
    data = json.loads((cache / "hardware.json").read_text())
    assert data["kernel_decode_gbps"]["2"]["Q8_0"]["trusted"] is False
    assert data["float_flops"]["2"]["trusted"] is False

    # still busy: the quick default keeps the figures (no probe runs), the machine looked at once
    before = machine.reads
    r = _rates()
    assert calls == {"ram": 1, "kernels": 1, "float": 1, "file": 0, "layers": 0}
    assert r.ram_gbps == cm.Figure(18.8, "cached") and machine.reads - before == 2
    # --no-measure (the runtime) never probes nor looks
    before = machine.reads
    _rates(measure=False)
    assert calls["ram"] == 1 and machine.reads == before

    # quiet now: every untrusted figure is measured again, quickly, and is trusted
    stub_probes(monkeypatch, gbps=34.6)
    machine.others = 0.05
    r = _rates()
    assert r.ram_gbps == cm.Figure(34.6, "measured") and r.float_flops.source == "measured"
    data = json.loads((cache / "hardware.json").read_text())
    assert data["host_read_bandwidth"]["2"]["trusted"] is True
    assert data["float_flops"]["2"]["trusted"] is True
    assert data["kernel_decode_gbps"]["2"]["Q8_0"]["why"] == "quiet"
    # trusted now: nothing runs, no quiet check
    calls = stub_probes(monkeypatch)
    before = machine.reads
    _rates()
    assert sum(calls.values()) == 0 and machine.reads == before


def test_a_wide_spread_is_measured_again_too(machine, monkeypatch, cache):
    calls = stub_probes(monkeypatch, spread=0.6)
    _rates(measure=True)
    entry = json.loads((cache / "hardware.json").read_text())["float_flops"]["2"]
    assert entry["trusted"] is False and entry["why"].startswith("with a wide spread")
    calls = stub_probes(monkeypatch, spread=0.02)
    _rates()
    assert calls["float"] == 1 and calls["kernels"] == 1 and calls["ram"] == 1


# ------------------------------------------------------------------------------------------- the lines


def test_describe_and_note():
    now = datetime.now(timezone.utc)
    at = (now - timedelta(hours=3)).isoformat(timespec="seconds")
    good = load.mark({"gbps": 34.6, "measured_at": at}, {"others_cores": 0.02}, 0.04)
    assert load.note("host read 34.6 GB/s", good, "re-run") == "host read 34.6 GB/s, probed 3 h ago, quiet (spread 4%)"
    bad = load.mark({"gbps": 18.8, "measured_at": (now - timedelta(minutes=2)).isoformat()}, {"others_cores": 1.6})
    assert load.note("host read 18.8 GB/s", bad, "re-run with --measure when quiet") == \
        "host read 18.8 GB/s, probed 2 min ago under load (other processes used 1.6 cores): re-run with --measure " \
        "when quiet"
    assert load.describe({"gbps": 1.0}) == "probed at an unknown time (load not recorded)"
    assert load.describe({**good, "measured_at": (now - timedelta(days=1)).isoformat()}).startswith("probed 1 day ago")
    assert load.describe({**good, "measured_at": now.isoformat()}).startswith("probed just now, quiet")
    floor = {"gbps": 40.0, "floor": True, "method": "moerun bench tg128 (bytes per token x t/s)", "measured_at": at,
             "trusted": True}
    assert load.describe(floor) == "read by moerun bench tg128 (bytes per token x t/s), 3 h ago"


def test_estimate_prints_the_probes_age_and_load(tiny, machine, monkeypatch):
    stub_probes(monkeypatch, gbps=18.8)
    machine.others = 1.6
    args = ["estimate", str(tiny), "-t", "1", "--device", "cpu"]
    r = CliRunner().invoke(main, [*args, "--measure"])
    assert r.exit_code == 0, r.output
    lines = [ln.strip() for ln in r.stdout.splitlines()]
    assert "host read 18.8 GB/s, probed just now under load (other processes used 1.6 cores): re-run `moerun " \
           "estimate --measure` when quiet" in lines
    assert "warning: the kernel Q8_0, torch float32, overhead probes ran under load (other processes used up to " \
           "1.6 cores): re-run `moerun estimate --measure` when quiet" in lines
    r = CliRunner().invoke(main, [*args, "--json"])  # still busy: kept, the warnings on stderr
    d = json.loads(r.stdout)
    assert d["probes"]["host read"]["trusted"] is False and d["probes"]["overhead"]["load"]["others_cores"] == 1.6
    assert r.stderr.splitlines()[0].startswith("warning: host read 18.8 GB/s, probed just now under load")
    assert len(r.stderr.splitlines()) == 2
    machine.others = 0.0
    stub_probes(monkeypatch, gbps=34.6)
    r = CliRunner().invoke(main, args)  # quiet now: measured again
    lines = [ln.strip() for ln in r.stdout.splitlines()]
    assert "host read 34.6 GB/s, probed just now, quiet (spread 2%)" in lines
    assert not [ln for ln in lines if ln.startswith("warning")] and not r.stderr
    d = json.loads(CliRunner().invoke(main, [*args, "--json"]).stdout)
    assert {p["trusted"] for p in d["probes"].values()} == {True} and d["rates"]["ram_gbps"] == 34.6


# ------------------------------------------------------------------------------------------------ bench


def test_bench_measures_an_untrusted_figure_again_when_quiet(machine, monkeypatch):
    stub_probes(monkeypatch, gbps=18.8)
    machine.others = 1.6
    log: list[str] = []
    assert bandwidth.bench_host_read(2, measure=True, log=log.append) == (18.8, "measured")
    assert log[-1] == "host read 18.8 GB/s (2 thread(s)), probed just now under load (other processes used 1.6 " \
                      "cores): re-run with --measure-bw when quiet"
    log.clear()
    assert bandwidth.bench_host_read(2, log=log.append) == (18.8, "cached")  # busy: kept, warned
    assert len(log) == 1 and log[0].endswith("re-run with --measure-bw when quiet")
    calls = stub_probes(monkeypatch, gbps=34.6)
    machine.others = 0.0
    log.clear()
    assert bandwidth.bench_host_read(2, log=log.append) == (34.6, "measured")
    assert calls["ram"] == 1 and log[0].startswith("the cached host read figure (18.8 GB/s) was probed just now "
                                                   "under load") and log[0].endswith("measuring it again")
    assert log[-1] == "host read 34.6 GB/s (2 thread(s)), probed just now, quiet (spread 2%)"


def _record(**kw):
    rec = {"n_prompt": 0, "n_gen": 128, "n_threads": 2, "bytes_per_token": 140_000_000, "host_read_gbps": 18.8,
           "expert_cache_mib": None, "devices": None}
    rec.update(kw)
    rec["achieved_gbps"] = rec["bytes_per_token"] * rec.pop("ts") / 1e9
    rec["bound_fraction"] = rec["achieved_gbps"] / rec["host_read_gbps"]
    return rec


def test_bench_above_the_bound_raises_the_cached_figure(machine, monkeypatch, cache):
    monkeypatch.setattr(bandwidth, "last_level_cache_bytes", lambda: 32 << 20)
    stub_probes(monkeypatch, gbps=18.8)
    machine.others = 1.6
    bandwidth.host_read_bandwidth(2, measure=True)
    fast = _record(ts=233.0)  # 32.6 GB/s read: 174 % of the bound
    assert raise_host_read([_record(ts=100.0)]) == []  # under the bound: nothing changes
    assert raise_host_read([_record(ts=233.0, bytes_per_token=20 << 20, host_read_gbps=1.0)]) == []  # in cache
    assert raise_host_read([_record(ts=233.0, devices="cuda:0")]) == []  # a placement's bound is not RAM's
    assert raise_host_read([_record(ts=233.0, expert_cache_mib=256.0)]) == []
    lines = raise_host_read([_record(ts=200.0), fast])
    assert lines == [("tg128 read 32.6 GB/s, 174 % of the bound from the host read figure (18.8 GB/s): the cache "
                      "now holds 32.6 GB/s for 2 thread(s)")]
    entry = bandwidth.cached_host_read_bandwidth(2)
    assert entry["gbps"] == pytest.approx(32.62) and entry["floor"] and load.trusted(entry)
    assert entry["replaced_gbps"] == 18.8 and bandwidth.host_read_bandwidth(2) == (pytest.approx(32.62), "cached")
    assert load.describe(entry).startswith("read by moerun bench tg128 (bytes per token x t/s), just now")
    assert raise_host_read([_record(ts=200.0)]) == []  # the cache holds more already
    calls = stub_probes(monkeypatch)
    log: list[str] = []
    bandwidth.bench_host_read(2, log=log.append)
    assert calls["ram"] == 0 and log == [("host read 32.6 GB/s (2 thread(s)), read by moerun bench tg128 (bytes "
                                          "per token x t/s), just now")]


def test_last_level_cache_is_a_size():
    assert bandwidth.last_level_cache_bytes() >= 1 << 20


# --------------------------------------------------------------------------------------------- real load


def test_a_probe_beside_busy_loops_is_marked_under_load(cache):
    """Two real busy processes (one per core here) run while a small host read probe runs: the probe is marked
    under load. Only the verdict is asserted."""
    import os

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(os.cpu_count() or 1, 2))]
    try:
        time.sleep(0.5)
        bandwidth.host_read_bandwidth(1, measure=True, nbytes=64 << 20, runs=3)
    finally:
        for p in hogs:
            p.kill()
            p.wait()
    entry = bandwidth.cached_host_read_bandwidth(1)
    assert entry["trusted"] is False and entry["why"].startswith("under load (other processes used")
    assert entry["load"]["others_cores"] > load.BUSY_CORES


def test_the_stale_probe_scripts_report(monkeypatch):
    """bench/stale_probe.py's report from a record of its shape: the ratio, the verdict and the warnings."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import stale_probe

    cache = {"host read GB/s": {"trusted": True}}
    rec = {"threads": 2, "stale_expected_tok_s": 144.6, "stale_ratio": 0.426, "ratio": 0.96, "ratio_median": 0.959,
           "within": True, "warned": True, "load_busy": {"others_cores": 2.0},
           "load_before_estimate": {"others_cores": 0.0}, "load_before_bench": {"others_cores": 0.0},
           "busy": {"others_cores": 1.2, "ram_gbps": 32.2, "expected_tok_s": 144.6,
                    "warnings": ["warning: host read 32.2 GB/s, probed just now under load"]},
           "estimate": {"others_cores": 0.0, "ram_gbps": 54.6, "expected_tok_s": 326.2, "warnings": [],
                        "cache": cache},
           "bench": {"others_cores": 0.01, "host_read_gbps": 54.6, "avg_ts": 339.8, "stddev_ts": 1.6,
                     "median_ts": 340.0, "samples_ts": [339.8] * 5, "log": ["bench: host read 54.6 GB/s"]}}
    text = stale_probe.report(rec, ["bench/stale_probe.py"])
    assert "| quiet estimate (the default) | 0.00 | 54.6 | 326.2 | 0.960 | -4.0% |" in text
    assert "within ±15%; a warning was printed" in text
    assert "- `` warning: host read 32.2 GB/s, probed just now under load ``" in text
