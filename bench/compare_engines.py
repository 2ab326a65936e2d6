"""moerun, llama.cpp and ik_llama.cpp on the same GGUF files, in alternating rounds (issue 21).

    python bench/compare_engines.py MODEL [MODEL ...] --llama-bin DIR [--ik-bin DIR] [-t 2] [--rounds 3]

Each round runs, one after the other (never together), `moerun bench -p P -n 0` and `-p 0 -n N` (one repetition),
llama.cpp's `llama-bench -p P -n N -r 1 -o json` and, when --ik-bin is given, ik_llama.cpp's llama-bench with
`-fa 1 -fmoe 1 -rtr 1` (its fastest CPU settings: flash attention, fused MoE up/gate, run-time repacking). The
table has each engine's median t/s over the rounds and the ratios; GB/s is moerun's count of weight bytes per
generated token times the t/s. Build the two llama-bench binaries yourself (cmake, -DGGML_NATIVE=ON); this script
does not build them.

--probe: the read probe (bench/step_profile.py's quick_probe, in a process of its own) before every run. A VM's memory
may read at one of two rates by the minute (issue 36: ~52 or ~85 GB/s on a 2-core Zen 5), so a median over rounds
can set one engine's fast runs against the other's slow ones; the decode ratios are then also given within each
state (a run is "fast" when its probe reaches 80 % of the highest probe of the file's rounds).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

from toolkit import add, alternate, cpu_ids, cpu_model, medians, moerun_cmd, parser, ratio, run_json


def moerun_round(model: str, args) -> dict:
    out = {}
    for kind, p, n in (("pp", args.n_prompt, 0), ("tg", 0, args.n_gen)):
        cmd = moerun_cmd("bench", "-m", model, "-p", p, "-n", n, "-r", "1", "-t", args.threads, "-o", "json")
        rec = run_json(cmd)[0]
        out[kind] = rec["avg_ts"]
        if kind == "tg":
            out["bytes_per_token"] = rec["bytes_per_token"]
    return out


def probe_gbps(threads: int) -> float:
    """The quick read probe, in a process of its own (its 1 GiB freed before the engine's run)."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from step_profile import quick_probe; "
            f"print(quick_probe({int(threads)}))")
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def by_state(got: dict, kind: str, a: str, b: str) -> str:
    """a's and b's `kind` t/s compared within each memory state (probe >= 80 % of the highest: fast): 'fast 1.30x
    (2 runs of a, 1 of b), slow ...', or '' without probes."""
    runs = [g for gs in got.values() for g in gs]
    if not all("probe" in g for g in runs):
        return ""
    top = max(g["probe"] for g in runs)
    parts = []
    for state, keep in (("fast", lambda p: p >= 0.8 * top), ("slow", lambda p: p < 0.8 * top)):
        xa = [g[kind] for g in got[a] if kind in g and keep(g["probe"])]
        xb = [g[kind] for g in got[b] if kind in g and keep(g["probe"])]
        if xa and xb:
            parts.append(f"{state} {ratio(statistics.median(xa), statistics.median(xb))}x ({len(xa)} runs of {a}, "
                         f"{len(xb)} of {b})")
    return "; ".join(parts)


def llama_bench_round(binary: Path, model: str, args, extra: list[str]) -> dict:
    recs = run_json([str(binary / "llama-bench"), "-m", model, "-t", str(args.threads), "-p", str(args.n_prompt),
                     "-n", str(args.n_gen), "-r", "1", "-o", "json", *extra])
    out = {}
    for rec in recs:
        out["pp" if rec["n_gen"] == 0 else "tg"] = rec["avg_ts"]
    return out


def main() -> None:
    ap = add(parser(__doc__, "all"), "models")
    ap.add_argument("--llama-bin", required=True, type=Path, help="folder with llama.cpp's llama-bench")
    ap.add_argument("--ik-bin", type=Path, help="folder with ik_llama.cpp's llama-bench")
    add(ap, "threads")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    add(ap, "--rounds")
    ap.add_argument("--probe", action="store_true", help="the read probe before every run, decode ratios by memory state")
    args = ap.parse_args()
    engines = {"moerun": lambda m: moerun_round(m, args),
               "llama.cpp": lambda m: llama_bench_round(args.llama_bin, m, args, [])}
    if args.ik_bin:
        engines["ik_llama.cpp"] = lambda m: llama_bench_round(args.ik_bin, m, args, ["-fa", "1", "-fmoe", "1",
                                                                                      "-rtr", "1"])
    header = (f"| file | test | {' | '.join(engines)} | moerun / llama.cpp |"
              + (" moerun / ik | ik / llama.cpp |" if args.ik_bin else "") + " GB/s moerun |")
    rows = [header, "|---|---|" + "---:|" * (len(engines) + (3 if args.ik_bin else 1) + 1)]
    rounds = []  # every round's t/s, for the record beside the medians
    for model in args.models:
        def run(name, _r, m=model):
            probe = probe_gbps(args.threads) if args.probe else None
            out = engines[name](m)
            return out if probe is None else {**out, "probe": probe}

        got = alternate(list(engines), args.rounds, run)
        for kind in ("pp", "tg"):
            rounds.append(f"{Path(model).name} {kind}: " + "; ".join(
                f"{e} " + ", ".join(f"{g[kind]:.1f}" + (f" (probe {g['probe']:.0f})" if "probe" in g else "")
                                    for g in gs if kind in g) for e, gs in got.items()))
        if args.ik_bin and (states := by_state(got, "tg", "moerun", "ik_llama.cpp")):
            rounds.append(f"{Path(model).name} tg, moerun / ik_llama.cpp within a memory state: {states}")
        bpt = next((g["bytes_per_token"] for g in reversed(got["moerun"]) if "bytes_per_token" in g), 0)
        for kind, n in (("pp", args.n_prompt), ("tg", args.n_gen)):
            med = medians({e: [g[kind] for g in gs] for e, gs in got.items()})
            cells = [Path(model).name, f"{kind}{n}", *(f"{med[e]:.1f}" for e in engines),
                     ratio(med["moerun"], med["llama.cpp"])]
            if args.ik_bin:
                cells += [ratio(med["moerun"], med["ik_llama.cpp"]), ratio(med["ik_llama.cpp"], med["llama.cpp"])]
            cells.append(f"{bpt * med['moerun'] / 1e9:.1f}" if kind == "tg" else "-")
            rows.append("| " + " | ".join(cells) + " |")
    print(f"{cpu_model()} ({cpu_ids()}); {args.rounds} alternating rounds, medians, {args.threads} threads, "
          f"load {os.getloadavg()[0]:.2f} at the end")
    print("\n".join(rows))
    print("\nRounds (t/s, in order):\n" + "\n".join(rounds))


if __name__ == "__main__":
    main()
