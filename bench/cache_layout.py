"""Decode with the expert cache in the interleaved layout resident experts have, against the file's layout and
against no cache (issue 15, item 0), alternating the three in one window; the greedy tokens compared too.

    python bench/cache_layout.py ~/.cache/moerun/bench-models/a3b-L4-Q4_K_M.gguf -t 2 -n 128 -r 5

Each round runs, one after the other: no cache (experts in RAM, interleaved: the whole-layer C path), a cache
holding every expert (`--expert-cache-slots E`, filled by the warm-up, so decode hits only) whose slots hold
the interleaved layout (the default now), and the same cache with the file's layout in its slots (what it
did before). Prints t/s per round and the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from moerun.bench import BenchCase, run_case
from moerun.experts import cache as cache_mod
from moerun.experts.cache import ExpertCache
from moerun.loading import load_model
from moerun.model.moe import CachedExperts


def greedy(model, pool, n: int) -> list[int]:
    from moerun.engine.kv_cache import SeqKV

    seq, tok, out = SeqKV(pool, n + 8), 1, []
    for _ in range(n):
        tok = int(model.forward(torch.tensor([tok]), seq, last_only=True)[-1].argmax())
        out.append(tok)
    seq.free()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--rounds", type=int, default=5)
    args = ap.parse_args()
    from moerun.engine.kv_cache import KVPool
    from moerun.model.ops import set_threads

    set_threads(args.threads)
    resident = load_model(args.model, home="ram").model  # interleaved experts in RAM
    mapped = load_model(args.model, home="mmap").model  # experts in the file's map, behind the caches
    E = mapped.spec.n_experts
    relayout = cache_mod._relayout_parts
    caches = {"interleaved slots": ExpertCache(mapped.store, slots=E, interleave=True)}
    cache_mod._relayout_parts = lambda like: None  # the file's layout in the slots, as before issue 15
    caches["file-layout slots"] = ExpertCache(mapped.store, slots=E, interleave=True)
    cache_mod._relayout_parts = relayout
    pool = KVPool(mapped.spec, args.n_gen + 16)
    case = BenchCase(args.model, 0, args.n_gen, 512, args.threads)

    def setup(name):
        if name == "no cache":
            return resident
        mapped.experts = CachedExperts(caches[name])
        return mapped

    names = ["no cache", *caches]
    tokens = {name: greedy(setup(name), pool, 32) for name in names}  # also the warm-up that fills the caches
    ts = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names:
            ns = run_case(setup(name), pool, case, 1, mapped.spec.vocab, warmup=False)[0]
            ts[name].append(args.n_gen * 1e9 / ns)
        print(f"round {r + 1}: " + ", ".join(f"{n} {ts[n][-1]:.1f}" for n in names), file=sys.stderr)
    for name in names:
        hits = caches[name].stats.hit_rate(phase="decode") if name in caches else None
        print(f"{name:18s} tg{args.n_gen} median {statistics.median(ts[name]):7.1f} t/s "
              f"(min {min(ts[name]):.1f}, max {max(ts[name]):.1f}); greedy tokens "
              f"{'==' if tokens[name] == tokens['no cache'] else '!='} no cache's"
              + ("" if hits is None else f"; decode hit rate {hits:.1%}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
