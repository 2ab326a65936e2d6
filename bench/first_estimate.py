"""The estimate a user gets first against `moerun bench` (issue 15, item 6).

Per model and round, back to back: `moerun estimate MODEL -t T --json` with an empty cache folder of its own
(so it runs its quick default probes, timed), the same with `--no-measure` (metadata and the built-in
defaults), then `moerun bench -m MODEL -p 512 -n 128 -r 3 -t T`. The rounds alternate estimate and bench so
the machine's drifting bandwidth meets both; the table gives each round and the error of the medians
(estimate / bench - 1). Run it where nothing else runs.

    python bench/first_estimate.py ~/.cache/moerun/bench-models/a3b-{L4,L12}-{Q4_K_M,Q8_0}.gguf --rounds 3
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from toolkit import add, dated_heading, machine, moerun, moerun_commit, parser, pct_err, publish


def one_round(model: str, threads: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="moerun-first-") as d:
        t0 = time.perf_counter()
        est = json.loads(moerun("estimate", model, "-t", threads, "--json", env={"MOERUN_CACHE": d}))
        wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="moerun-first-") as d:
        dflt = json.loads(moerun("estimate", model, "-t", threads, "--json", "--no-measure", env={"MOERUN_CACHE": d}))
    bench = json.loads(moerun("bench", "-m", model, "-p", "512", "-n", "128", "-r", "3", "-t", threads, "-o", "json"))
    pp = next(b for b in bench if b["n_prompt"])
    tg = next(b for b in bench if b["n_gen"])
    return {"est_tg": est["decode"]["expected_tok_s"], "est_pp": est["prefill"]["tok_s"], "wall": wall,
            "probe_s": est["seconds"], "default_tg": dflt["decode"]["expected_tok_s"],
            "default_pp": dflt["prefill"]["tok_s"], "tg": tg["avg_ts"], "pp": pp["avg_ts"],
            "rates": est["rates"]}


def main(argv: list[str] | None = None) -> int:
    ap = add(parser(__doc__, "paragraph"), "models", "--rounds", "threads", "append",
             threads={"type": str, "default": "2"}, append={"help": "append the section to bench/RESULTS.md"})
    args = ap.parse_args(argv)
    rows, summary = [], []
    for model in args.models:
        recs = []
        for r in range(1, args.rounds + 1):
            rec = one_round(model, args.threads)
            recs.append(rec)
            name = Path(model).stem
            rows.append(f"| {name} | {r} | {rec['est_tg']:.1f} | {rec['tg']:.1f} | {pct_err(rec['est_tg'], rec['tg'])} | "
                        f"{rec['est_pp']:.1f} | {rec['pp']:.1f} | {pct_err(rec['est_pp'], rec['pp'])} | "
                        f"{rec['wall']:.1f} s | {rec['default_tg']:.1f} | {rec['default_pp']:.1f} |")
            print(rows[-1], file=sys.stderr, flush=True)
        m = {k: statistics.median(x[k] for x in recs) for k in ("est_tg", "tg", "est_pp", "pp", "wall",
                                                                  "default_tg", "default_pp")}
        summary.append(f"| {Path(model).stem} | {m['est_tg']:.1f} | {m['tg']:.1f} | **{pct_err(m['est_tg'], m['tg'])}** | "
                       f"{m['est_pp']:.1f} | {m['pp']:.1f} | **{pct_err(m['est_pp'], m['pp'])}** | {m['wall']:.1f} s | "
                       f"{pct_err(m['default_tg'], m['tg'])} / {pct_err(m['default_pp'], m['pp'])} |")
    cmd = " ".join(["python", "bench/first_estimate.py", *(sys.argv[1:] if argv is None else argv)])
    text = "\n".join([
        dated_heading("the first estimate (quick default probes) against bench (issue 15, item 6)"),
        "", f"Machine: {machine()}. moerun commit {moerun_commit()}. Run: `{cmd}`, {args.threads} threads.", "",
        ("| model | estimate tg128 t/s | bench tg128 t/s | error | estimate pp512 t/s | bench pp512 t/s | error | "
        "first estimate's wall time | `--no-measure` error tg / pp |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|", *summary, "",
        "Every round:", "",
        ("| model | round | estimate tg128 | bench tg128 | error | estimate pp512 | bench pp512 | error | wall | "
        "`--no-measure` tg128 | `--no-measure` pp512 |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *rows, ""])
    publish(text, args.append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
