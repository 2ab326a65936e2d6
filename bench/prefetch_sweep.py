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

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from compare_llamacpp import machine, moerun_commit

HINTS = ("t0", "t1", "t2", "nta")
DISTANCES = (0, 256, 512, 1024, 2048, 4096, 8192)


def cpu_name() -> str:
    """machine() (the model name, cores, SIMD, RAM) with /proc/cpuinfo's vendor, family and model."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("vendor_id", "cpu family", "model") and key.strip() not in fields:
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    ids = " ".join(f"{k.replace('cpu ', '')} {fields[k]}" for k in ("cpu family", "model") if k in fields)
    return f"{machine()}; {fields.get('vendor_id', '?')} {ids}".strip()


def run_one(model: str, n_gen: int, threads: int, hint: str, distance: int, timeout: float) -> dict:
    """One `moerun bench` tg run under (hint, distance) -> its JSON record."""
    env = dict(os.environ, MOERUN_PREFETCH=str(distance), MOERUN_PREFETCH_HINT=hint)
    cmd = [sys.executable, "-m", "moerun", "bench", "-m", model, "-p", "0", "-n", str(n_gen), "-r", "1",
           "-t", str(threads), "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} (hint {hint}, {distance} B) failed:\n{r.stderr[-2000:]}")
    rec = json.loads(r.stdout)[0]
    if (rec["cpu_prefetch"], rec["cpu_prefetch_hint"]) != (distance, hint):
        raise RuntimeError(f"asked for {hint} {distance} B, the run used {rec['cpu_prefetch_hint']} "
                           f"{rec['cpu_prefetch']} B")
    return rec


def sweep(model: str, n_gen: int, threads: int, rounds: int, hints, distances, timeout: float = 3600,
          raw: str | None = None, log=sys.stderr) -> dict:
    """Run the rounds -> {(hint, distance): [t/s per round]}."""
    settings = [(h, d) for h in hints for d in distances]
    ts: dict[tuple[str, int], list[float]] = {s: [] for s in settings}
    for r in range(rounds):
        k = r * len(settings) // rounds
        for hint, dist in settings[k:] + settings[:k]:
            rec = run_one(model, n_gen, threads, hint, dist, timeout)
            ts[(hint, dist)].append(rec["avg_ts"])
            print(f"round {r + 1}/{rounds} {hint} {dist:5d} B: {rec['avg_ts']:.2f} t/s", file=log, flush=True)
            if raw:
                with open(raw, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"round": r, "hint": hint, "distance": dist, "avg_ts": rec["avg_ts"]}) + "\n")
    return ts


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
             f"CPU: {cpu_name()}. moerun commit {moerun_commit()}. Load average at the end: "
             f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())}.", "",
             "Median tg t/s over the rounds (median of per-round ratios to distance 0), by hint and distance (bytes):",
             "", "| hint | " + " | ".join(str(d) for d in distances) + " |",
             "|---|" + "---:|" * len(distances)]
    lines += [f"| {h} | " + " | ".join(cell(h, d) for d in distances) + " |" for h in hints]
    if base_runs:
        flat = [x for b in base_runs for x in b]
        med = statistics.median(flat)
        lines += ["", f"Noise: the {len(flat)} distance-0 runs (one setting) gave {min(flat):.2f}-{max(flat):.2f} t/s, "
                      f"median {med:.2f} ({(min(flat) / med - 1) * 100:+.1f}% / {(max(flat) / med - 1) * 100:+.1f}%); "
                      f"per-round medians {', '.join(f'{b:.2f}' for b in base)}."]
        best = max((s for s in ts if s[1]), key=lambda s: statistics.median(x / b for x, b in zip(ts[s], base)),
                   default=None)
        if best:
            lines.append(f"Best: {best[0]} {best[1]} B, per-round ratios "
                         f"{', '.join(f'{x / b:.3f}' for x, b in zip(ts[best], base))}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", help="GGUF file")
    p.add_argument("-n", "--n-gen", type=int, default=64, help="tokens generated per run")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hints", default=",".join(HINTS))
    p.add_argument("--distances", default=",".join(map(str, DISTANCES)), help="bytes; 0 (the baseline) is added")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--raw", help="append every run as a JSON line to this file")
    a = p.parse_args(argv)
    hints = [h.strip().lower() for h in a.hints.split(",") if h.strip()]
    if not hints or any(h not in HINTS for h in hints):
        p.error(f"--hints: a comma list of {', '.join(HINTS)}")
    distances = sorted({0, *(int(d) for d in a.distances.split(",") if d.strip())})
    ts = sweep(a.model, a.n_gen, a.threads, a.rounds, hints, distances, a.timeout, a.raw)
    print(table(ts, a.model, a.n_gen, a.threads, a.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
