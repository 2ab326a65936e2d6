"""Eviction policies on multi-sequence batches of real routing (issue 19): the decode records of 2 or 4 requests
of a routing trace (`bench/routing_traces.py` writes them) stepped together, so a cache step is the union of
their experts at one layer, replayed with `group="batch"` against every policy and Belady's bound.

    python bench/batch_policies.py [~/.cache/moerun/routing]
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from moerun.experts.policy import POLICIES
from moerun.experts.trace import belady, read_trace, simulate


def batched(records, size: int) -> list:
    """Requests grouped `size` at a time; record t of each request in a group shares step t."""
    by: dict = {}
    for r in records:
        by.setdefault(r.request_id, {}).setdefault(r.position, {})[r.layer] = r
    reqs, out = sorted(by), []
    for g in range(0, len(reqs), size):
        group = [sorted(by[q].items()) for q in reqs[g:g + size]]
        for t in range(min(len(x) for x in group)):
            for layer in sorted(group[0][t][1]):
                out += [dataclasses.replace(x[t][1][layer], step=g * 10**6 + t) for x in group]
    return out


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "~/.cache/moerun/routing").expanduser()
    for name in ("greedy-B", "sampled-A"):
        decode = [r for r in read_trace(folder / f"trace-{name}.jsonl").records if r.phase == "decode"]
        for size, slots in ((2, (16, 24, 32)), (4, (32, 40, 48))):
            recs = batched(decode, size)
            print(f"\n{name}, batches of {size}\n| policy | " + " | ".join(f"{s} slots" for s in slots) + " |")
            for pol in (*POLICIES, "belady"):
                rates = [(belady(recs, s, group="batch") if pol == "belady" else
                          simulate(recs, s, pol, group="batch")).hit_rate() for s in slots]
                print(f"| {pol} | " + " | ".join(f"{100 * x:.1f}%" for x in rates) + " |")


if __name__ == "__main__":
    main()
