"""Prefetch on real routing (issue 19): the routing bench model with its experts' home in the file's map behind
a cache of a quarter of the experts, greedy runs of held-out text with `--prefetch` off and on, alternating.
Prints decode ms/token, hit rate, bytes paged in, and the guesses' precision and recall.

    python bench/prefetch_routing.py moerun/data/routing-qwen3moe.gguf [--rounds 3] [--slots 16] [--cold]

--cold: before each text the model file's pages are pushed out of this process's maps and the page cache
(madvise MADV_PAGEOUT, then posix_fadvise DONTNEED; Linux), so each expert's first read in a text is a disk read.
"""

from __future__ import annotations

import ctypes
import os
import statistics

from routing_traces import text_sets
from toolkit import add, alternate, md_table, parser

MADV_PAGEOUT = 21


def page_out(path: str) -> None:
    """Drop `path`'s pages: from every map of it in this process, then from the page cache."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == real:
                a, b = (int(x, 16) for x in parts[0].split("-"))
                libc.madvise(a, b - a, MADV_PAGEOUT)
    fd = os.open(real, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def one_run(model: str, prompts: list[str], n_gen: int, slots: int, policy: str, prefetch: bool,
            cold: bool = False) -> dict:
    from moerun.config import RuntimeConfig, SamplingParams
    from moerun.runtime import build

    rt = build(RuntimeConfig(model=model, threads=2, ctx_size=2048, mmap=True, expert_cache_slots=slots,
                             cache_policy=policy, prefetch=prefetch))
    eng, ms, n = rt.engine, 0.0, 0
    for p in prompts:
        if cold:
            page_out(model)
        gen = eng.generate(eng.tokenizer.encode(p), SamplingParams.greedy(max_tokens=n_gen, ignore_eos=True)).run()
        ms, n = ms + gen.timings.predicted_ms, n + gen.timings.predicted_n
        gen.seq.free()
    c = rt.cache.stats.get(phase="decode")
    rt.close()
    return {"ms": ms / n, "hit": c.hit_rate, "mib": c.bytes_paged_in / 2**20,
            "precision": c.prefetch_precision, "recall": c.prefetch_recall}


def main() -> None:
    p = add(parser(__doc__), "model", "--rounds")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--policy", default="lfru")
    p.add_argument("--texts", type=int, default=12)
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--cold", action="store_true", help="drop the file's pages before each text")
    args = p.parse_args()
    prompts = text_sets(args.texts)[1]
    runs = alternate([False, True], args.rounds,
                     lambda pf, _r: one_run(args.model, prompts, args.tokens, args.slots, args.policy, pf, args.cold),
                     each=lambda pf, _r, got: print(pf, got, flush=True))
    print("\n" + md_table(["prefetch", "decode ms/token (runs)", "median", "hit rate", "paged in",
                           "precision / recall"], align="llrrrr"))
    for pf, rs in runs.items():
        r = rs[0]
        pr = "-" if r["precision"] is None else f"{100 * r['precision']:.1f}% / {100 * r['recall']:.1f}%"
        times = ", ".join(f"{x['ms']:.2f}" for x in rs)
        print(f"| {'on' if pf else 'off'} | {times} | "
              f"{statistics.median(x['ms'] for x in rs):.2f} | {100 * r['hit']:.1f}% | {r['mib']:.0f} MiB | {pr} |")


if __name__ == "__main__":
    main()
