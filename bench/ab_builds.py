"""Two builds of the kernel extension against each other in one process, forwards alternating (issue 21).

    python bench/ab_builds.py MODEL --a OLD.so --b NEW.so [-T 512] [-t 2] [--reps 6]

On a shared, noisy machine two separate runs differ by more than a kernel change does; here each repetition runs
one forward (T > 1: a prompt of T tokens; T = 1: 64 greedy decode steps) with build A's kernels, then one with
B's, on the same loaded model, and the medians and the median of the per-pair ratios are printed. Build a copy
with `python setup.py build_ext --inplace` at each commit and copy moerun/kernels/_cpu*.so aside.
"""

from __future__ import annotations

import importlib.util
import statistics
import time

import torch
from toolkit import add, alternate, pair_ratio, parser

from moerun.engine.kv_cache import KVPool, SeqKV
from moerun.kernels import cpu
from moerun.loading import load_model
from moerun.model.ops import thread_budget


def load_build(path: str):
    spec = importlib.util.spec_from_file_location("moerun.kernels._cpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = add(parser(__doc__, "all"), "model")
    ap.add_argument("--a", required=True, help="build A's _cpu*.so")
    ap.add_argument("--b", required=True, help="build B's _cpu*.so")
    ap.add_argument("-T", type=int, default=512, help="prompt tokens (1: decode steps)")
    add(ap, "threads")
    ap.add_argument("--reps", type=int, default=6)
    args = ap.parse_args()
    builds = {"A": load_build(args.a), "B": load_build(args.b)}
    loaded = load_model(args.model, dtype=torch.float32, home="ram", interleave=True)
    model, T = loaded.model, args.T
    pool = KVPool(loaded.arch.spec, T + 130, dtype=torch.float32)
    tokens = torch.randint(0, 1000, (T,), generator=torch.Generator().manual_seed(0))

    def forward(name: str, _round: int) -> float:
        cpu._cpu = builds[name]
        seq = SeqKV(pool, T + 129)
        t0 = time.perf_counter()
        if T > 1:
            model.forward(tokens, seq, last_only=True)
        else:
            tok = torch.tensor([1])
            for _ in range(64):
                tok = model.forward(tok, seq, last_only=True)[-1].argmax().reshape(1)
        dt = time.perf_counter() - t0
        seq.free()
        return dt

    with thread_budget(args.threads):
        for mod in builds.values():
            mod.set_threads(args.threads)
        times = alternate(list(builds), args.reps, forward, warmup=True)  # the first round warms up
    n = T if T > 1 else 64
    a, b = statistics.median(times["A"]), statistics.median(times["B"])
    pairs = pair_ratio(times["A"], times["B"])
    print(f"{args.model}: T={T}, {args.threads} threads, {args.reps} pairs: A {n / a:.1f} t/s, B {n / b:.1f} t/s, "
          f"B/A {a / b:.3f} (median per-pair ratio {pairs:.3f})")


if __name__ == "__main__":
    main()
