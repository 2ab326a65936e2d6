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

import os
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
        got = alternate(list(engines), args.rounds, lambda name, _r, m=model: engines[name](m))
        for kind in ("pp", "tg"):
            rounds.append(f"{Path(model).name} {kind}: " + "; ".join(
                f"{e} " + ", ".join(f"{g[kind]:.1f}" for g in gs if kind in g) for e, gs in got.items()))
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
