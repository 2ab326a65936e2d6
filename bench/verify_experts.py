"""How many distinct experts a speculative verify batch touches (issue 20, item 3), from routing traces.

A verify step runs the last accepted token and N - 1 drafted ones through the target in one batch; where the
drafts are right (the case that pays), its routing is that of N consecutive decode tokens. So the distinct experts
per layer of every window of N consecutive decode steps of one request give the batch's expert reads: k when the
tokens share all their experts, N x k when they share none.

    python bench/verify_experts.py TRACE [TRACE ...] [--n 1,2,3,4,6,8]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path


def distinct_per_window(trace_path: Path, sizes: list[int]) -> dict[int, float]:
    """N -> mean distinct experts per layer over all windows of N consecutive decode steps of a request."""
    from routing_traces import decode_steps

    from moerun.experts.trace import read_trace

    steps = decode_steps(read_trace(trace_path))  # (request, layer) -> experts per step
    out = {}
    for n in sizes:
        counts = [len(set().union(*seq[i:i + n])) for seq in steps.values() for i in range(len(seq) - n + 1)]
        out[n] = statistics.fmean(counts)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--n", default="1,2,3,4,6,8")
    args = p.parse_args()
    from moerun.experts.trace import read_trace

    sizes = [int(x) for x in args.n.split(",")]
    print("| trace | experts, top-k | " + " | ".join(f"N={n}" for n in sizes) + " |\n|---|---|"
          + "---:|" * len(sizes))
    for path in args.traces:
        h = read_trace(path).header
        d = distinct_per_window(path, sizes)
        cells = " | ".join(f"{d[n]:.1f} ({d[n] / (n * h.k):.0%})" for n in sizes)
        print(f"| {path.name} | {h.n_experts}, top-{h.k} | {cells} |")
    e, k = h.n_experts, h.k  # tokens routed independently and uniformly: E (1 - (1 - k/E)^N)
    cells = " | ".join(f"{e * (1 - (1 - k / e) ** n):.1f} ({e * (1 - (1 - k / e) ** n) / (n * k):.0%})" for n in sizes)
    print(f"| independent uniform routing | {e}, top-{k} | {cells} |")
    print("\nCells: mean distinct experts per layer per verify batch (as a share of N x k, the most it can be).")


if __name__ == "__main__":
    main()
