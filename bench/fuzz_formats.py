"""Long model-file fuzzing run: the strategies of tests/test_fuzz_formats.py, many more cases, counted.

    python bench/fuzz_formats.py --cases 10000            # both formats, 10,000 cases each
    python bench/fuzz_formats.py --cases 2000 --format gguf --seed 7 --show-bugs 5

Prints, per format, the count of each outcome: ok, each MoerunError message class (names and numbers
blanked), and anything else (an escaped exception, a hang past the alarm, a large allocation), plus the
wall time. Exit status 1 when anything else happened.
"""

from __future__ import annotations

import argparse
import platform
import resource
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fuzz_models import (
    apply_gguf,
    apply_hf,
    build_bases,
    check,
    gguf_cases,
    gguf_layout,
    hf_base,
    hf_cases,
    write_hf,
)
from hypothesis import HealthCheck, given, seed, settings


def run_format(fmt: str, bases: dict[str, Path], work: Path, cases: int, rng_seed: int) -> tuple[Counter, list, float]:
    counts: Counter = Counter()
    bugs: list = []
    slow: list = []
    if fmt == "gguf":
        models = {n: gguf_layout(p.read_bytes()) for n, p in bases.items() if n.endswith(".gguf")}
        strategy = gguf_cases(models)
    else:
        models = {n: hf_base(p) for n, p in bases.items() if n.endswith("-hf")}
        strategy = hf_cases(models)

    def one(name: str, ops: list) -> None:
        if fmt == "gguf":
            path = work / "case.gguf"
            path.write_bytes(apply_gguf(models[name], ops))
        else:
            path = write_hf(work / "case-hf", *apply_hf(models[name], ops))
        t0 = time.perf_counter()
        outcome = check(path)
        dt = time.perf_counter() - t0
        counts[(outcome.kind, outcome.label)] += 1
        slow.append((dt, outcome.label, name, ops))
        slow.sort(key=lambda x: -x[0])
        del slow[3:]
        if outcome.kind == "bug":
            bugs.append((outcome.label, name, ops))

    @seed(rng_seed)
    @settings(max_examples=cases, database=None, deadline=None, phases=["generate"],
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def fuzz(case):
        one(*case)

    t0 = time.perf_counter()
    fuzz()
    wall = time.perf_counter() - t0
    for dt, label, name, ops in slow:
        print(f"  slowest: {dt:.3f} s  {label}  base {name}, ops {ops!r}"[:400])
    return counts, bugs, wall


def report(fmt: str, counts: Counter, wall: float, bugs: list, show: int) -> None:
    total = sum(counts.values())
    by_kind = Counter()
    for (kind, _), n in counts.items():
        by_kind[kind] += n
    print(f"\n{fmt}: {total} cases in {wall:.1f} s ({total / wall:.0f}/s): ok {by_kind['ok']}, "
          f"MoerunError {by_kind['error']}, anything else {by_kind['bug']}")
    for (kind, label), n in sorted(counts.items(), key=lambda kv: (kv[0][0] != "ok", -kv[1], kv[0][1])):
        print(f"  {n:6d}  {kind:5s}  {label}")
    for label, name, ops in bugs[:show]:
        print(f"  BUG {label}\n      base {name}, ops {ops!r}"[:2000])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=1000, help="cases per format")
    ap.add_argument("--format", choices=["gguf", "safetensors", "both"], default="both")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-memory-gib", type=float, default=4.0,
                    help="address-space limit for this process, so a runaway allocation fails instead of swapping")
    ap.add_argument("--show-bugs", type=int, default=10, help="print the first N failing cases per format")
    args = ap.parse_args(argv)
    limit = int(args.max_memory_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    print(f"python {platform.python_version()} on {platform.machine()}, {platform.processor() or '?'}; "
          f"seed {args.seed}")
    fmts = ["gguf", "safetensors"] if args.format == "both" else [args.format]
    any_bug = False
    with tempfile.TemporaryDirectory(prefix="moerun-fuzz-") as tmp:
        bases = build_bases(Path(tmp) / "bases")
        for fmt in fmts:
            work = Path(tmp) / fmt
            work.mkdir()
            counts, bugs, wall = run_format(fmt, bases, work, args.cases, args.seed)
            report(fmt, counts, wall, bugs, args.show_bugs)
            any_bug |= bool(bugs)
    return 1 if any_bug else 0


if __name__ == "__main__":
    sys.exit(main())
