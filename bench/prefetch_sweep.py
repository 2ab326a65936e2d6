"""Decode speed for every prefetch hint x distance of the interleaved CPU kernels (issue 36).

    python bench/prefetch_sweep.py MODEL [-n 64] [-t 2] [--rounds 3] [--hints t0,t1,t2,nta]
                                         [--distances 0,256,512,1024,2048,4096,8192] [--raw runs.jsonl]

Each setting is one fresh `moerun bench -m MODEL -p 0 -n N -r 1 -t T -o json` process with MOERUN_PREFETCH (bytes)
and MOERUN_PREFETCH_HINT set (the record's cpu_prefetch / cpu_prefetch_hint must echo them). A round runs every
setting once, hint by hint (so each round's distance-0 runs are spread through it), and each round starts a
1/rounds turn further into that order. Distance 0 is the same setting under every hint: those runs are the
baseline, and their spread is the noise printed under the table. Each cell is the setting's median tg t/s over
the rounds and the median over rounds of its ratio to that round's median distance-0 t/s. On a shared machine,
read the ratios.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests load this file by its path
from toolkit import (
    add,
    alternate,
    append_jsonl,
    cpu_ids,
    ints,
    machine,
    moerun_cmd,
    moerun_commit,
    parser,
    run_json,
)

HINTS = ("t0", "t1", "t2", "nta")
DISTANCES = (0, 256, 512, 1024, 2048, 4096, 8192)


def run_one(model: str, n_gen: int, threads: int, hint: str, distance: int, timeout: float) -> dict:
    """One `moerun bench` tg run under (hint, distance) -> its JSON record."""
    env = {"MOERUN_PREFETCH": str(distance), "MOERUN_PREFETCH_HINT": hint}
    cmd = moerun_cmd("bench", "-m", model, "-p", "0", "-n", n_gen, "-r", "1", "-t", threads, "-o", "json")
    try:
        rec = run_json(cmd, env=env, timeout=timeout, echo=False)[0]
    except RuntimeError as e:
        raise RuntimeError(f"{' '.join(cmd)} (hint {hint}, {distance} B): {e}") from None
    if (rec["cpu_prefetch"], rec["cpu_prefetch_hint"]) != (distance, hint):
        raise RuntimeError(f"asked for {hint} {distance} B, the run used {rec['cpu_prefetch_hint']} "
                           f"{rec['cpu_prefetch']} B")
    return rec


def sweep(model: str, n_gen: int, threads: int, rounds: int, hints, distances, timeout: float = 3600,
          raw: str | None = None, log=sys.stderr) -> dict:
    """Run the rounds -> {(hint, distance): [t/s per round]}."""
    def one(setting: tuple[str, int], r: int) -> float:
        hint, dist = setting
        t_s = run_one(model, n_gen, threads, hint, dist, timeout)["avg_ts"]
        print(f"round {r}/{rounds} {hint} {dist:5d} B: {t_s:.2f} t/s", file=log, flush=True)
        if raw:
            append_jsonl(raw, {"round": r - 1, "hint": hint, "distance": dist, "avg_ts": t_s})
        return t_s

    # each round starts a 1/rounds turn further into the settings
    return alternate([(h, d) for h in hints for d in distances], rounds, one, rotate=True)


def table(ts: dict, model: str, n_gen: int, threads: int, rounds: int) -> str:
    """The markdown report of sweep()'s results: t/s (ratio to distance 0) per hint and distance."""
    hints = list(dict.fromkeys(h for h, _ in ts))
    distances = list(dict.fromkeys(d for _, d in ts))
    base_runs = [[ts[(h, 0)][r] for h in hints] for r in range(rounds)] if 0 in distances else None
    base = [statistics.median(b) for b in base_runs] if base_runs else None

    def cell(h: str, d: int) -> str:
        v = ts[(h, d)]
        ratio = f" ({statistics.median(x / b for x, b in zip(v, base)):.3f})" if base else ""
        return f"{statistics.median(v):.2f}{ratio}"

    lines = [f"### Prefetch sweep: {Path(model).name}, tg{n_gen}, {threads} threads, {rounds} rounds", "",
             (f"CPU: {machine()}; {cpu_ids()}. moerun commit {moerun_commit()}. Load average at the end: "
             f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())}."), "",
             "Median tg t/s over the rounds (median of per-round ratios to distance 0), by hint and distance (bytes):",
             "", "| hint | " + " | ".join(str(d) for d in distances) + " |",
             "|---|" + "---:|" * len(distances)]
    lines += [f"| {h} | " + " | ".join(cell(h, d) for d in distances) + " |" for h in hints]
    if base_runs:
        flat = [x for b in base_runs for x in b]
        med = statistics.median(flat)
        lines += ["", (f"Noise: the {len(flat)} distance-0 runs (one setting) gave {min(flat):.2f}-{max(flat):.2f} t/s, "
                      f"median {med:.2f} ({(min(flat) / med - 1) * 100:+.1f}% / {(max(flat) / med - 1) * 100:+.1f}%); "
                      f"per-round medians {', '.join(f'{b:.2f}' for b in base)}.")]
        best = max((s for s in ts if s[1]), key=lambda s: statistics.median(x / b for x, b in zip(ts[s], base)),
                   default=None)
        if best:
            lines.append(f"Best: {best[0]} {best[1]} B, per-round ratios "
                         f"{', '.join(f'{x / b:.3f}' for x, b in zip(ts[best], base))}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = add(parser(__doc__), "model", model={"help": "GGUF file"})
    p.add_argument("-n", "--n-gen", type=int, default=64, help="tokens generated per run")
    add(p, "threads", "--rounds")
    p.add_argument("--hints", default=",".join(HINTS))
    p.add_argument("--distances", default=",".join(map(str, DISTANCES)), help="bytes; 0 (the baseline) is added")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--raw", help="append every run as a JSON line to this file")
    a = p.parse_args(argv)
    hints = [h.strip().lower() for h in a.hints.split(",") if h.strip()]
    if not hints or any(h not in HINTS for h in hints):
        p.error(f"--hints: a comma list of {', '.join(HINTS)}")
    distances = sorted({0, *ints(a.distances)})
    ts = sweep(a.model, a.n_gen, a.threads, a.rounds, hints, distances, a.timeout, a.raw)
    print(table(ts, a.model, a.n_gen, a.threads, a.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
