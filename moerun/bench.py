"""`moerun bench`: llama-bench's tests, fields and output formats, plus moerun's bandwidth view.

Tests, as llama-bench runs them:

- `ppN`: process an N-token prompt into an empty KV cache in `n_ubatch`-token chunks; one sample is the
  whole prompt, N / seconds is its t/s.
- `tgN`: generate N tokens one at a time from an empty KV cache (greedy argmax of the logits feeds the next
  step); one sample is all N steps, N / seconds is its t/s.

Test order and sweeps follow llama-bench: for each model, ubatch and thread count, every `-p` value (0 skips)
then every `-n` value (0 skips). Integer arguments take comma lists and `first-last`, `first-last+step`,
`first-last*mult` ranges. Before the samples there is one warm-up: the whole prompt for pp, one token for tg
(llama-bench does the same). t/s is reported as mean ± sample standard deviation over the per-sample t/s.

moerun's fields on top of llama-bench's (`bench_record`): `bytes_per_token` (weight bytes read per generated
token, from `moerun.arch.summary`), and for tg tests `achieved_gbps` (bytes_per_token × t/s),
`bound_ts` (host read bandwidth ÷ bytes_per_token: the decode speed if every weight byte streamed at the
measured peak) and `bound_fraction` (t/s ÷ bound_ts). For pp tests these three are null: a prompt chunk
reads each weight once for many tokens, so bytes per token times t/s is not a memory traffic figure.
`host_read_gbps`/`host_read_source` say which bandwidth figure was used (measured, cached or default; its age
and the load it was probed under are logged, and one probed under load is measured again when the machine is
quiet). A tg test above 100 % of the bound raises the cached figure to what it read (`raise_host_read`);
`cpu_prefetch` the CPU kernels' one-token weight prefetch distance in bytes (0: none; `MOERUN_PREFETCH`) and
`cpu_prefetch_hint` its hint (t0, t1, t2, nta; `MOERUN_PREFETCH_HINT`).
Expert cache sweeps (`--expert-cache-mib 256,512`, moerun's own): each size is a test of its own with an
ExpertCache of that many MiB over the MoE layers in front of the experts' home tier (the file's map when a
cache is asked for, as `moerun run` does); `expert_cache_mib`, `expert_cache_hits`, `expert_cache_queries`
and `expert_cache_hit_rate` count the timed runs of the test's phase (prefill for pp, decode for tg). Tests
without a cache leave them null. `--trace-routing FILE` records the routing of every timed run (one request
per test) for `moerun estimate --trace` and `moerun trace simulate`.

Placements (`--gpus`, `--devices`, `--n-cpu-moe`, `--vram-budget`, `--miss-path`; moerun's own): each test
then builds the runtime as `moerun run` would (one build per test: an expert cache size is a VRAM
placement), and its record adds `devices`, `expert_cache_home_share` (misses computed by the CPU),
`expert_cache_h2d_gbps` (host-to-device copies), `expert_cache_stall_s`, `expert_cache_stages` (per stage:
hits, misses paged in, streamed and computed at home, GB/s, stall) and `estimate_ts`, what `moerun
estimate` predicts for that placement (uniform routing), so the two can be compared row by row. Over processes
(`--ep-world-size`, `--pipeline-world-size`) every rank runs the command; moerun.bench_ranks says how, and what
`ep_gathers` and `ep_gather_ms` (the `link ms` column: rank 0's) are.
"""

from __future__ import annotations

import csv
import io
import json
import re
import statistics
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import TextIO

from moerun.bench_ranks import across_processes, devices_label, for_test, gather_fields, rank_fields, reset
from moerun.config import DEFAULT_CACHE_POLICY
from moerun.errors import MoerunError
from moerun.model.timing import time_gen, time_prompt

FIELDS = [
    "moerun_version", "cpu_info", "gpu_info", "backends", "model_filename", "model_type", "model_size",
    "model_n_params", "n_ubatch", "n_threads", "dtype", "n_prompt", "n_gen", "test_time",
    "avg_ns", "stddev_ns", "avg_ts", "stddev_ts", "samples_ns", "samples_ts",
    "bytes_per_token", "achieved_gbps", "host_read_gbps", "host_read_source", "cpu_prefetch",
    "cpu_prefetch_hint", "bound_ts", "bound_fraction",
    "expert_cache_mib", "expert_cache_hits", "expert_cache_queries", "expert_cache_hit_rate",
    "expert_cache_prefetch_precision",
    "devices", "expert_cache_home_share", "expert_cache_h2d_gbps", "expert_cache_stall_s", "expert_cache_stages",
    "estimate_ts", "ep_gathers", "ep_gather_ms",
]
LIST_FIELDS = ("samples_ns", "samples_ts", "expert_cache_stages", "ep_gather_ms")  # in json/jsonl; left out of csv
FORMATS = ("md", "json", "jsonl", "csv")
DEFAULT_UBATCH = 512

_RANGE = re.compile(r"(\d+)(?:-(\d+)(?:([+*])(\d+))?)?")


def parse_int_range(text: str) -> list[int]:
    """llama-bench's integer lists: `512`, `128,512`, `1-4` (1,2,3,4), `0-512+128`, `16-512*2`, mixed."""
    out: list[int] = []
    for part in text.split(","):
        m = _RANGE.fullmatch(part.strip())
        if not m:
            raise ValueError(f"invalid range format '{text}' (use N, A-B, A-B+STEP or A-B*MULT, comma separated)")
        first = int(m[1])
        last = int(m[2]) if m[2] is not None else first
        op, step = m[3] or "+", int(m[4]) if m[4] is not None else 1
        i = first
        while i <= last:
            out.append(i)
            nxt = i + step if op == "+" else i * step
            if nxt <= i:
                raise ValueError(f"invalid range '{part}': it does not advance")
            i = nxt
    return out


def parse_int_lists(values: Iterable[str]) -> list[int]:
    """Concatenate several parse_int_range arguments (a flag given twice appends, as in llama-bench)."""
    return [n for v in values for n in parse_int_range(v)]


@dataclass(frozen=True)
class BenchCase:
    model: str
    n_prompt: int
    n_gen: int
    n_ubatch: int
    n_threads: int
    cache_mib: float | None = None  # an expert cache of this size, None: every expert read where it lives

    @property
    def name(self) -> str:
        if self.n_gen == 0:
            return f"pp{self.n_prompt}"
        if self.n_prompt == 0:
            return f"tg{self.n_gen}"
        return f"pp{self.n_prompt}+tg{self.n_gen}"


def expand_cases(models: Sequence[str], n_prompt: Sequence[int], n_gen: Sequence[int],
                 n_ubatch: Sequence[int], n_threads: Sequence[int],
                 cache_mib: Sequence[float | None] = (None,)) -> list[BenchCase]:
    """llama-bench's order: model > (expert cache) > ubatch > threads > (every pp, then every tg); zero sizes
    are skipped."""
    cases = []
    for m in models:
        for c in cache_mib:
            for ub in n_ubatch:
                for t in n_threads:
                    cases += [BenchCase(m, p, 0, ub, t, c) for p in n_prompt if p > 0]
                    cases += [BenchCase(m, 0, g, ub, t, c) for g in n_gen if g > 0]
    return cases


# --------------------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelInfo:
    path: str
    model_type: str  # llama.cpp's llama_model_desc, moerun's wording: "qwen3moe 2.5B.A232M Q4_K_M"
    model_size: int  # weight bytes (llama_model_size counts tensor bytes, not the file)
    model_n_params: int
    bytes_per_token: int
    vocab: int


def _count_label(n: float) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(int(n))


def _ftype_name(metadata: dict, by_class: dict) -> str:
    ft = metadata.get("general.file_type")
    if isinstance(ft, int):
        import gguf

        try:
            name = gguf.LlamaFileType(ft).name
            return "F32" if name == "ALL_F32" else name.removeprefix("MOSTLY_")
        except ValueError:
            pass
    totals: dict[str, int] = {}
    for by_q in by_class.values():
        for q, b in by_q.items():
            totals[q] = totals.get(q, 0) + b
    return max(totals, key=totals.get) if totals else "?"


def describe_model(path: str | Path) -> ModelInfo:
    """Sizes and bytes per token without reading weights (raises ModelFormatError for a bad file)."""
    from moerun.arch import resolve
    from moerun.arch.summary import summarize
    from moerun.formats import open_model

    with open_model(path) as mf:
        arch = resolve(mf)
        s = summarize(arch)
        ftype = _ftype_name(mf.metadata, s.by_class)
    spec = arch.spec
    desc = f"{spec.family} {_count_label(s.total_params)}.A{_count_label(s.active_params)} {ftype}"
    return ModelInfo(str(path), desc, s.total_bytes, s.total_params, s.bytes_per_token, spec.vocab)


# --------------------------------------------------------------------------------------------- timing


def run_case(model, pool, case: BenchCase, reps: int, vocab: int, warmup: bool = True, seed: int = 0,
             log: Callable[[str], None] = lambda s: None, on_timed: Callable[[], None] | None = None) -> list[int]:
    """Samples (ns) of one test: optional warm-up, then `reps` runs, each from an empty KV cache.
    on_timed: called between the warm-up and the timed runs (to reset counters)."""
    import torch

    from moerun.engine.kv_cache import SeqKV

    tokens = torch.randint(0, vocab, (max(case.n_prompt, 1),), generator=torch.Generator().manual_seed(seed))
    first = int(tokens[0])

    def once(n_prompt: int, n_gen: int) -> int:
        seq = SeqKV(pool, n_prompt + n_gen)
        try:
            ns = time_prompt(model, seq, tokens[:n_prompt], case.n_ubatch) if n_prompt else 0
            return ns + (time_gen(model, seq, first, n_gen) if n_gen else 0)
        finally:
            seq.free()

    from moerun.model.ops import thread_budget

    with thread_budget(case.n_threads):
        if warmup:
            log(f"{case.name}: warm-up")
            once(case.n_prompt, min(case.n_gen, 1))
        if on_timed is not None:
            on_timed()
        samples = []
        for i in range(reps):
            samples.append(once(case.n_prompt, case.n_gen))
            ts = (case.n_prompt + case.n_gen) * 1e9 / samples[-1]
            log(f"{case.name}: run {i + 1}/{reps}: {samples[-1] / 1e9:.3f} s, {ts:.2f} t/s")
        return samples


# --------------------------------------------------------------------------------------------- records


def _stdev(v: Sequence[float]) -> float:
    return statistics.stdev(v) if len(v) > 1 else 0.0  # sample (n - 1) deviation, as llama-bench


def cpu_info() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor()


def _cpu_prefetch(key: str = "prefetch") -> int | str | None:
    from moerun.kernels import cpu

    return cpu.features()[key] if cpu.available() else None


def bench_record(info: ModelInfo, case: BenchCase, samples_ns: Sequence[int], dtype: str, test_time: str,
                 host_gbps: float, host_source: str, cache=None, placed: dict | None = None) -> dict:
    """One result row in llama-bench's JSON shape plus moerun's fields (see the module docstring)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        moerun_version = version("moerun")
    except PackageNotFoundError:
        moerun_version = "unknown"
    n_tokens = case.n_prompt + case.n_gen
    samples_ts = [n_tokens * 1e9 / ns for ns in samples_ns]
    avg_ts = statistics.fmean(samples_ts) if samples_ts else 0.0
    decode = case.n_prompt == 0 and info.bytes_per_token > 0
    bound_ts = host_gbps * 1e9 / info.bytes_per_token if decode else None
    return {
        "moerun_version": moerun_version, "cpu_info": cpu_info(), "gpu_info": "", "backends": "CPU",
        "model_filename": info.path, "model_type": info.model_type, "model_size": info.model_size,
        "model_n_params": info.model_n_params, "n_ubatch": case.n_ubatch, "n_threads": case.n_threads,
        "dtype": dtype, "n_prompt": case.n_prompt, "n_gen": case.n_gen, "test_time": test_time,
        "avg_ns": int(statistics.fmean(samples_ns)) if samples_ns else 0,
        "stddev_ns": int(_stdev(samples_ns)), "avg_ts": avg_ts, "stddev_ts": _stdev(samples_ts),
        "samples_ns": list(samples_ns), "samples_ts": samples_ts,
        "bytes_per_token": info.bytes_per_token,
        "achieved_gbps": info.bytes_per_token * avg_ts / 1e9 if decode else None,
        "host_read_gbps": host_gbps, "host_read_source": host_source, "cpu_prefetch": _cpu_prefetch(),
        "cpu_prefetch_hint": _cpu_prefetch("prefetch_hint"),
        "bound_ts": bound_ts, "bound_fraction": avg_ts / bound_ts if bound_ts else None,
        "expert_cache_mib": case.cache_mib, "expert_cache_hits": None if cache is None else cache.hits,
        "expert_cache_queries": None if cache is None else cache.queries,
        "expert_cache_hit_rate": None if cache is None else cache.hit_rate,
        "expert_cache_prefetch_precision": None if cache is None else cache.prefetch_precision,
        "devices": None, "expert_cache_home_share": None if cache is None else cache.home_share,
        "expert_cache_h2d_gbps": None if cache is None else cache.h2d_gbps,
        "expert_cache_stall_s": None if cache is None else cache.seconds_stalled,
        "expert_cache_stages": None, "estimate_ts": None, "ep_gathers": None, "ep_gather_ms": None, **(placed or {}),
    }


# --------------------------------------------------------------------------------------------- output


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _cache_cell(rec: dict) -> str:
    """Expert cache size and its hit rate over the timed runs ("-" without a cache)."""
    if rec["expert_cache_mib"] is None:
        return "-"
    rate = rec["expert_cache_hit_rate"]
    return f"{rec['expert_cache_mib']:g} MiB " + ("-" if rate is None else f"{100 * rate:.1f}%")


def _pct_cell(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _params(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n < 1e9 else f"{n / 1e9:.2f} B"


class Printer:
    """Streams records to `out` in one of FORMATS: header, one row per test as it finishes, footer."""

    def __init__(self, fmt: str, out: TextIO, extra_md_columns: Sequence[str] = ()):
        if fmt not in FORMATS:
            raise ValueError(f"unknown output format '{fmt}' ({', '.join(FORMATS)})")
        self.fmt, self.out, self.n = fmt, out, 0
        self.md_columns = ["model", "size", "params", "backend", "threads", *extra_md_columns,
                           "test", "t/s", "GB/s", "% of bound"]
        if "devices" in extra_md_columns:  # placements: what the miss path did, and the estimate beside t/s
            self.md_columns += ["home", "h2d GB/s", "est t/s"]
        self.csv_fields = [f for f in FIELDS if f not in LIST_FIELDS]

    def _emit(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def _md_line(self, cells: Sequence[str]) -> str:
        return "|" + "".join(f" {c:{'<' if w < 0 else '>'}{abs(w)}} |"
                             for c, w in zip(cells, map(self._width, self.md_columns))) + "\n"

    @staticmethod
    def _width(col: str) -> int:
        """llama-bench's column widths; negative: left-aligned."""
        return {"model": -30, "size": 10, "params": 10, "backend": -10, "threads": 7, "n_ubatch": 8,
                "dtype": -8, "cache": 16, "test": 15, "t/s": 20, "GB/s": 8, "% of bound": 10, "devices": -16,
                "home": 6, "h2d GB/s": 8, "est t/s": 9, "link ms": 7}[col]

    def header(self) -> None:
        if self.fmt == "md":
            self._emit(self._md_line(self.md_columns))
            self._emit("|" + "".join(f" {'-' * (abs(w) - 1)}{':' if w > 0 else '-'} |"
                                     for w in map(self._width, self.md_columns)) + "\n")
        elif self.fmt == "json":
            self._emit("[\n")
        elif self.fmt == "csv":
            self._emit(",".join(self.csv_fields) + "\n")

    def row(self, rec: dict) -> None:
        if self.fmt == "md":
            self._emit(self._md_line([self._md_cell(c, rec) for c in self.md_columns]))
        elif self.fmt == "json":
            self._emit(("" if self.n == 0 else ",\n") + textwrap.indent(json.dumps(rec, indent=2), "  "))
        elif self.fmt == "jsonl":
            self._emit(json.dumps(rec) + "\n")
        else:
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerow(
                ["" if rec[f] is None else rec[f] for f in self.csv_fields])
            self._emit(buf.getvalue())
        self.n += 1

    def footer(self) -> None:
        if self.fmt == "json":
            self._emit("\n]\n" if self.n else "]\n")

    @staticmethod
    def _md_cell(col: str, rec: dict) -> str:
        test = BenchCase("", rec["n_prompt"], rec["n_gen"], 0, 0).name
        gbps, frac = rec["achieved_gbps"], rec["bound_fraction"]
        return {
            "model": rec["model_type"], "size": _size(rec["model_size"]), "params": _params(rec["model_n_params"]),
            "backend": rec["backends"], "threads": str(rec["n_threads"]), "n_ubatch": str(rec["n_ubatch"]),
            "dtype": rec["dtype"], "test": test, "t/s": f"{rec['avg_ts']:.2f} ± {rec['stddev_ts']:.2f}",
            "cache": _cache_cell(rec),
            "GB/s": "-" if gbps is None else f"{gbps:.2f}",
            "% of bound": "-" if frac is None else f"{100 * frac:.1f}",
            "devices": rec["devices"] or "-",
            "home": _pct_cell(rec["expert_cache_home_share"]),
            "h2d GB/s": "-" if rec["expert_cache_h2d_gbps"] is None else f"{rec['expert_cache_h2d_gbps']:.1f}",
            "est t/s": "-" if rec["estimate_ts"] is None else f"{rec['estimate_ts']:.1f}",
            "link ms": "-" if rec["ep_gather_ms"] is None else f"{rec['ep_gather_ms'][0]:.2f}",
        }[col]


# --------------------------------------------------------------------------------------------- driver


def _timed_runs_start(model, cache, recorder) -> None:
    """Between warm-up and timed runs: the cache counters and the routing trace cover the timed runs only."""
    if cache is not None:
        cache.stats.reset()
    if recorder is not None:
        model.on_route = recorder


def make_cache(model, mib: float, policy: str, interleave: bool = True, prefetch: bool = False):
    """An ExpertCache of `mib` MiB split evenly over the model's MoE layers (as `moerun run --expert-cache-mib`),
    its slots in the kernels' interleaved layout unless --no-repack."""
    from moerun.experts.cache import ExpertCache

    store = model.store
    per_layer = max((store.expert_bytes(layer) for layer in store.layers), default=1)
    slots = int(mib * 2**20 // (per_layer * max(len(store.layers), 1)))
    return ExpertCache(store, slots=slots, policy=policy, interleave=interleave and model.ops.name != "reference",
                       prefetch=prefetch)


def placed_config(case: BenchCase, placement: dict, dtype: str, cache_policy: str, mmap: bool | None,
                  repack: bool, prefetch: bool = False):
    """The RuntimeConfig `moerun run` would use for this test's placement (an expert cache size per test)."""
    from moerun.config import RuntimeConfig

    return RuntimeConfig(model=case.model, threads=case.n_threads, ubatch=case.n_ubatch, dtype=dtype,
                         ctx_size=max(case.n_prompt + case.n_gen + 16, 64), expert_cache_mib=case.cache_mib,
                         cache_policy=cache_policy, mmap=mmap, repack=repack, prefetch=prefetch, **placement)


def _placed_runtime(*args, **kw):
    """The runtime of placed_config(*args, **kw), as `moerun run` builds it (the reads started ahead when it copies
    the whole file)."""
    from moerun.builtin import model_path
    from moerun.runtime import build
    from moerun.weights.preload import weights_ahead

    cfg = placed_config(*args, **kw)
    return build(cfg, weights_ahead(model_path(cfg.model), cfg.repack) if cfg.copies_whole_model else None)


def _placed_fields(rt, case: BenchCase, placement: dict) -> dict:
    """A placed test's per-stage cache counters (its phase) and the cost model's t/s for its placement."""
    from moerun.arch import resolve
    from moerun.formats import open_model
    from moerun.placement import costmodel as cm

    phase = "decode" if case.n_gen else "prefill"
    stages = []
    for label, stats in rt.stage_stats():
        c = stats.get(phase=phase)
        stages.append({"stage": label, "hits": c.hits, "misses": c.misses, "misses_paged": c.misses -
                       c.misses_home - c.misses_streamed, "misses_streamed": c.misses_streamed,
                       "misses_home": c.misses_home, "h2d_gbps": c.h2d_gbps, "stall_s": c.seconds_stalled})
    if across_processes(placement):
        return rank_fields(rt, stages)
    with open_model(case.model) as mf:
        arch = resolve(mf)
    w, rates = cm.workload(arch, rt.plan), _placement_rates(rt, arch, case.n_threads, placement)
    est = cm.decode_time(w, rates).tok_s if case.n_gen else cm.prefill_time(w, rates, case.n_prompt,
                                                                              case.n_ubatch).tok_s
    from moerun import device

    dev = device.parse(rt.plan.devices[0].device)
    return {"devices": devices_label(rt), "expert_cache_stages": stages or None,
            "estimate_ts": est, "backends": {"cuda": "CUDA", "standin": "stand-in"}.get(dev.kind, "CPU"),
            "gpu_info": device.describe(dev)}


def _placement_rates(rt, arch, threads: int, placement: dict):
    """The rates the runtime's miss path uses (moerun.runtime_device), for the estimate of a placed test."""
    from moerun import device
    from moerun.config import RuntimeConfig
    from moerun.placement import probes
    from moerun.runtime_device import stage_rates

    dev = device.parse(rt.plan.devices[0].device)
    if dev.accelerator:
        given = {k: placement[k] for k in ("h2d_gbps", "vram_gbps") if placement.get(k)}
        return stage_rates(RuntimeConfig(threads=threads, **given), dev, arch, threads)
    qtypes = sorted({src.records[0].qtype.name for src in arch.sources.values()})
    from moerun.placement.layer_probe import probe_layout

    return probes.gather_rates(probes.RateOptions(threads=threads, qtypes=qtypes, layout=probe_layout(arch)))


def run_bench(models: Sequence[str], n_prompt: Sequence[int], n_gen: Sequence[int], n_threads: Sequence[int],
              n_ubatch: Sequence[int] = (DEFAULT_UBATCH,), reps: int = 5, dtype: str = "float32",
              measure_bw: bool = False, warmup: bool = True, fmt: str = "md", out: TextIO | None = None,
              log: Callable[[str], None] = lambda s: None, cache_mib: Sequence[float | None] = (None,),
              cache_policy: str = DEFAULT_CACHE_POLICY, mmap: bool | None = None, trace_routing: str | Path | None = None,
              repack: bool = True, placement: dict | None = None, prefetch: bool = False) -> list[dict]:
    """Run every test (see expand_cases) and stream the records to `out` in `fmt`; returns the records.
    placement: RuntimeConfig fields (devices, n_cpu_moe, vram_budget, miss_path, ...) to build each test as
    `moerun run` would (module docstring)."""
    import gc
    import sys

    import torch

    from moerun.engine.kv_cache import KVPool
    from moerun.experts.stats import CacheStats
    from moerun.loading import load_model
    from moerun.model.moe import CachedExperts
    from moerun.placement.bandwidth import bench_host_read

    if reps < 1:
        raise ValueError("repetitions must be at least 1")
    if trace_routing is not None and placement:
        raise MoerunError("--trace-routing records a CPU run's routing: leave out the placement flags")
    if trace_routing is not None and len(set(models)) > 1:
        raise MoerunError("--trace-routing records one model's routing: give one -m")
    infos = {m: describe_model(m) for m in models}  # every bad path fails here, before any test runs
    cases = expand_cases(list(models), n_prompt, n_gen, n_ubatch, n_threads, cache_mib)
    bw = {t: bench_host_read(t, measure_bw, log) for t in dict.fromkeys(c.n_threads for c in cases)}
    extra = [c for c, on in (("n_ubatch", list(n_ubatch) != [DEFAULT_UBATCH]), ("dtype", dtype != "float32")) if on]
    if placement:
        extra += ["devices", "link ms"] if placement.get("ep_world_size", 1) > 1 else ["devices"]
    if any(c.cache_mib is not None for c in cases):
        extra.append("cache")
    printer = Printer(fmt, out or sys.stdout, extra)
    printer.header()
    records: list[dict] = []
    loaded_path, loaded, pool, recorder = None, None, None, None
    for i, case in enumerate(cases, 1):
        info = infos[case.model]
        if placement:
            log(f"test {i}/{len(cases)}: {case.name}, {case.n_threads} thread(s), ubatch {case.n_ubatch}, "
                + ("" if case.cache_mib is None else f"expert cache {case.cache_mib:g} MiB, ") + f"{reps} run(s)")
            loaded = pool = None
            gc.collect()
            rt = _placed_runtime(case, for_test(placement, i), dtype, cache_policy, mmap, repack,
                                 prefetch and case.cache_mib is not None)
            test_time = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            try:
                samples = run_case(rt.engine.model, rt.engine.pool, case, reps, info.vocab, warmup=warmup, log=log,
                                   on_timed=partial(reset, rt))
                stats = sum((s for _, s in rt.stage_stats()), CacheStats()) if rt.cache is not None else None
                counts = None if stats is None else stats.get(phase="decode" if case.n_gen else "prefill")
                rec = bench_record(info, case, samples, dtype, test_time, *bw[case.n_threads], cache=counts,
                                   placed=_placed_fields(rt, case, placement) | gather_fields(rt, case, reps))
            finally:
                rt.close()
            printer.row(rec)
            records.append(rec)
            continue
        if case.model != loaded_path:
            loaded = pool = None
            gc.collect()
            cached = any(c.cache_mib is not None for c in cases if c.model == case.model)
            home = {True: "mmap", False: "ram", None: "mmap" if cached else "ram"}[mmap]
            log(f"loading {case.model} (routed experts: {home})")
            loaded = load_model(case.model, dtype=getattr(torch, dtype), home=home, interleave=repack)
            loaded_path = case.model
            ctx = max(c.n_prompt + c.n_gen for c in cases if c.model == case.model)
            pool = KVPool(loaded.arch.spec, ctx, dtype=loaded.model.dtype)
            if trace_routing is not None and recorder is None:
                from moerun.experts.trace import RouteRecorder

                recorder = RouteRecorder(trace_routing, loaded.arch.spec)
        log(f"test {i}/{len(cases)}: {case.name}, {case.n_threads} thread(s), ubatch {case.n_ubatch}, "
            + ("" if case.cache_mib is None else f"expert cache {case.cache_mib:g} MiB, ") + f"{reps} run(s)")
        test_time = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        model, resident = loaded.model, loaded.model.experts
        cache = None if case.cache_mib is None else make_cache(model, case.cache_mib, cache_policy, repack, prefetch)
        try:
            if cache is not None:
                model.experts = CachedExperts(cache)
                log(f"expert cache: {sum(cache.slots(layer) for layer in cache.store.layers)} slots, "
                    f"{cache.nbytes / 2**20:.1f} MiB")
            samples = run_case(model, pool, case, reps, info.vocab, warmup=warmup, log=log,
                               on_timed=partial(_timed_runs_start, model, cache, recorder))
        finally:
            model.experts, model.on_route = resident, None
            if recorder is not None:
                recorder.request += 1
            if cache is not None:
                cache.close()
        counts = None if cache is None else cache.stats.get(phase="decode" if case.n_gen else "prefill")
        rec = bench_record(info, case, samples, dtype, test_time, *bw[case.n_threads], cache=counts)
        printer.row(rec)
        records.append(rec)
    printer.footer()
    if recorder is not None:
        recorder.writer.close()
    if not placement:
        for line in raise_host_read(records):
            log(line)
    return records


def raise_host_read(records: Sequence[dict], path: Path | None = None) -> list[str]:
    """Where a decode test without an expert cache read more than the host read figure it was bounded by (over
    100 % of the bound) and a token's bytes are at least twice the last-level cache (they cannot be served from
    it), store the test's GB/s as the figure for its thread count (bandwidth.raise_to_floor) -> one line each."""
    from moerun.placement.bandwidth import last_level_cache_bytes, raise_to_floor

    best: dict[int, dict] = {}
    for r in records:
        if (r["bound_fraction"] or 0) > 1 and r["expert_cache_mib"] is None and r["devices"] is None \
                and r["bytes_per_token"] >= 2 * last_level_cache_bytes() \
                and r["achieved_gbps"] > best.get(r["n_threads"], {}).get("achieved_gbps", 0):
            best[r["n_threads"]] = r
    lines = []
    for t, r in best.items():
        name = BenchCase("", r["n_prompt"], r["n_gen"], 0, 0).name
        if raise_to_floor(t, r["achieved_gbps"], f"moerun bench {name} (bytes per token x t/s)", path):
            lines.append(f"{name} read {r['achieved_gbps']:.1f} GB/s, {100 * r['bound_fraction']:.0f} % of the bound "
                         f"from the host read figure ({r['host_read_gbps']:.1f} GB/s): the cache now holds "
                         f"{r['achieved_gbps']:.1f} GB/s for {t} thread(s)")
    return lines
