"""moerun, llama.cpp and ik_llama.cpp on the same GGUF files, in alternating rounds (issue 21).

    python bench/compare_engines.py MODEL [MODEL ...] --llama-bin DIR [--ik-bin DIR] [-t 2] [--rounds 3]

Each round runs, one after the other (never together), `moerun bench -p P -n 0` and `-p 0 -n N` (one repetition),
llama.cpp's `llama-bench -p P -n N -r 1 -o json` and, when --ik-bin is given, ik_llama.cpp's llama-bench with
`-fa 1 -fmoe 1 -rtr 1` (its fastest CPU settings: flash attention, fused MoE up/gate, run-time repacking). The
table has each engine's median t/s over the rounds and the ratios; GB/s is moerun's count of weight bytes per
generated token times the t/s. Build the two llama-bench binaries yourself (cmake, -DGGML_NATIVE=ON); this script
does not build them.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path


def run_json(cmd: list[str]) -> list[dict]:
    print(f"$ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout)


def moerun_round(model: str, args) -> dict:
    out = {}
    for kind, p, n in (("pp", args.n_prompt, 0), ("tg", 0, args.n_gen)):
        rec = run_json([sys.executable, "-m", "moerun", "bench", "-m", model, "-p", str(p), "-n", str(n), "-r", "1",
                        "-t", str(args.threads), "-o", "json"])[0]
        out[kind] = rec["avg_ts"]
        if kind == "tg":
            out["bytes_per_token"] = rec["bytes_per_token"]
    return out


def llama_bench_round(binary: Path, model: str, args, extra: list[str]) -> dict:
    recs = run_json([str(binary / "llama-bench"), "-m", model, "-t", str(args.threads), "-p", str(args.n_prompt),
                     "-n", str(args.n_gen), "-r", "1", "-o", "json", *extra])
    out = {}
    for rec in recs:
        out["pp" if rec["n_gen"] == 0 else "tg"] = rec["avg_ts"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--llama-bin", required=True, type=Path, help="folder with llama.cpp's llama-bench")
    ap.add_argument("--ik-bin", type=Path, help="folder with ik_llama.cpp's llama-bench")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    engines = {"moerun": lambda m: moerun_round(m, args),
               "llama.cpp": lambda m: llama_bench_round(args.llama_bin, m, args, [])}
    if args.ik_bin:
        engines["ik_llama.cpp"] = lambda m: llama_bench_round(args.ik_bin, m, args, ["-fa", "1", "-fmoe", "1",
                                                                                      "-rtr", "1"])
    header = (f"| file | test | {' | '.join(engines)} | moerun / llama.cpp |"
              + (" moerun / ik | ik / llama.cpp |" if args.ik_bin else "") + " GB/s moerun |")
    rows = [header, "|---|---|" + "---:|" * (len(engines) + (3 if args.ik_bin else 1) + 1)]
    for model in args.models:
        samples: dict[str, dict[str, list[float]]] = {e: {"pp": [], "tg": []} for e in engines}
        bpt = 0
        for _ in range(args.rounds):
            for name, fn in engines.items():
                got = fn(model)
                bpt = got.get("bytes_per_token", bpt)
                for kind in ("pp", "tg"):
                    samples[name][kind].append(got[kind])
        for kind, n in (("pp", args.n_prompt), ("tg", args.n_gen)):
            med = {e: statistics.median(samples[e][kind]) for e in engines}
            cells = [Path(model).name, f"{kind}{n}", *(f"{med[e]:.1f}" for e in engines),
                     f"{med['moerun'] / med['llama.cpp']:.2f}"]
            if args.ik_bin:
                cells += [f"{med['moerun'] / med['ik_llama.cpp']:.2f}",
                          f"{med['ik_llama.cpp'] / med['llama.cpp']:.2f}"]
            cells.append(f"{bpt * med['moerun'] / 1e9:.1f}" if kind == "tg" else "-")
            rows.append("| " + " | ".join(cells) + " |")
    print(f"{args.rounds} alternating rounds, medians, {args.threads} threads, load {os.getloadavg()[0]:.2f} at the end")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
