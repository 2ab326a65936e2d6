"""`moerun estimate --trace` against a live run (issue 19): the hit rate estimate prints from one text's routing
trace beside the decode hit rate a live greedy run of other texts gets at the same cache bytes, with the
experts' home on disk (the file's map). Needs the traces `bench/routing_traces.py` writes.

    python bench/cache_estimate_check.py moerun/data/routing-qwen3moe.gguf [--append]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from compare_llamacpp import append_section, moerun_commit
from routing_traces import live_hit_rate, text_sets

SLOTS = re.compile(r"\|\s*(\d+) per layer\s*\|")
HIT = re.compile(r"expert cache hit rate \(decode\): ([\d.]+)%")


def estimated(model: str, trace: Path, mib: float, policy: str) -> tuple[int, float]:
    """(slots per layer, hit rate in %) as `moerun estimate` prints them."""
    out = subprocess.run([sys.executable, "-m", "moerun", "estimate", model, "--expert-cache-mib", str(mib),
                          "--trace", str(trace), "--cache-policy", policy, "--no-measure", "-t", "2"],
                         capture_output=True, text=True, check=True).stdout
    return int(SLOTS.search(out).group(1)), float(HIT.search(out).group(1))


def estimated_shared(model: str, trace: Path, mib: float, policy: str) -> float:
    """The hit rate (%) estimate prints with the cache's slots re-shared by `trace` (--expert-cache-trace)."""
    out = subprocess.run([sys.executable, "-m", "moerun", "estimate", model, "--expert-cache-mib", str(mib),
                          "--expert-cache-trace", str(trace), "--cache-policy", policy, "--no-measure", "-t", "2",
                          "--device", "cpu"], capture_output=True, text=True, check=True).stdout
    return float(HIT.search(out).group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--traces", type=Path, default=Path("~/.cache/moerun/routing").expanduser())
    p.add_argument("--mib", default="6,9.75,12", help="cache sizes in MiB (16, 26, 32 slots of 375 KiB experts)")
    p.add_argument("--policies", default="lru,lfru")
    p.add_argument("--texts", type=int, default=12)
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--append", action="store_true")
    args = p.parse_args()
    held_out = text_sets(args.texts)[1]
    rows, shared = [], []
    for policy in args.policies.split(","):
        for mib in (float(x) for x in args.mib.split(",")):
            est = {name: estimated(args.model, args.traces / f"trace-{name}.jsonl", mib, policy)
                   for name in ("greedy-A", "sampled-A")}
            slots = est["greedy-A"][0]
            live = 100 * live_hit_rate(args.model, held_out, args.tokens, slots=slots, policy=policy)
            rows.append(f"| {policy} | {mib:g} MiB ({slots} slots) | {est['greedy-A'][1]:.1f}% | "
                        f"{est['sampled-A'][1]:.1f}% | {live:.1f}% | {est['greedy-A'][1] - live:+.1f} | "
                        f"{est['sampled-A'][1] - live:+.1f} |")
            print(rows[-1], flush=True)
            learn = args.traces / "trace-greedy-A.jsonl"
            est_plan = estimated_shared(args.model, learn, mib, policy)
            live_plan = 100 * live_hit_rate(args.model, held_out, args.tokens, slots=slots, policy=policy, trace=learn)
            shared.append(f"| {policy} | {mib:g} MiB ({slots} slots) | {live:.1f}% | {est_plan:.1f}% | "
                          f"{live_plan:.1f}% | {est_plan - live_plan:+.1f} | {live_plan - live:+.1f} |")
            print(shared[-1], flush=True)
    text = (f"## `moerun estimate --trace` against live hit rates on other text (issue 19)\n\n"
            f"Command: `python bench/cache_estimate_check.py {args.model}` (commit {moerun_commit()}). Estimate: "
            f"`moerun estimate MODEL --expert-cache-mib M --trace trace-A.jsonl --cache-policy P` (traces of text A "
            f"from `bench/routing_traces.py`); live: greedy runs of text B ({args.texts} other held-out files, "
            f"{args.tokens} tokens each) at the slots estimate planned, experts' home on disk.\n\n"
            "| policy | cache | estimate, greedy-A trace | estimate, sampled-A trace | live, greedy text B | "
            "error (greedy A) | error (sampled A) |\n|---|---|---:|---:|---:|---:|---:|\n" + "\n".join(rows)
            + "\n\nThe same cache bytes with the slots re-shared by the greedy-A trace (`--expert-cache-trace`, "
            "in estimate and in the live run):\n\n| policy | cache | live, even | estimate, shared | live, shared | "
            "error | shared - even, live |\n|---|---|---:|---:|---:|---:|---:|\n" + "\n".join(shared) + "\n")
    print(text)
    if args.append:
        append_section(text)


if __name__ == "__main__":
    main()
