"""The stale probe of issue 39 (item 5), scripted: the probes taken while busy loops hold the cores, then a quiet
`moerun estimate` and `moerun bench` on a3b-L4 Q4_K_M; the estimate should be within 15% of the bench, with a
warning on the way.

Steps, in a cache folder of their own (MOERUN_CACHE in a temporary folder: the user's hardware.json is never
read or written):

1. the model: `moerun make-model a3b-L4 a3b-L4-Q4_K_M.gguf --ftype Q4_K_M` into the temporary folder (or --model);
2. busy: one busy loop per CPU (`--busy`), then `moerun estimate MODEL -t T --measure --json` (every probe, under
   load), the loops ended; what it predicted, its warnings, and what `estimate --no-measure` predicts from those
   figures (what a user saw before the probes were judged);
3. quiet: the load over a second (moerun.placement.load.quiet_now), then `moerun estimate MODEL -t T --json` (the
   default: the figures marked untrusted are measured again when the machine is quiet), then the load again and
   `moerun bench -m MODEL -t T -p 0 -n 128 -r R -o json` (tg128, mean t/s);
4. the cache's verdicts after each step, and estimate / bench.

The machine's load during the quiet steps is reported beside the figures: on a shared machine "quiet" is what it
was, not what it should have been.

    python bench/stale_probe.py [-t 2] [--busy 2] [--model FILE] [--out stale.json] [--append]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from toolkit import (
    add,
    cell,
    dated_heading,
    machine_header,
    md_table,
    moerun_cmd,
    parser,
    pct_err,
    publish,
    write_json,
)
from under_load import Hogs

TOLERANCE = 0.15


def run(args: list[str], env: dict) -> tuple[str, str, float, float | None]:
    """(stdout, stderr, seconds, other processes' cores) of `moerun ARGS`: the CPU time of every process but this
    one and the command, per second of its wall time. Exits the script with its stderr's tail when it fails."""
    from moerun.placement import load

    a, kids = load.read(), os.times()
    r = subprocess.run(moerun_cmd(*args), capture_output=True, text=True, env={**os.environ, **env}, check=False)
    b, kids2 = load.read(), os.times()
    if r.returncode:
        sys.exit(f"moerun {' '.join(args)} failed:\n{r.stderr[-2000:]}")
    ld = load.between(a, b)
    child = (kids2.children_user + kids2.children_system - kids.children_user - kids.children_system) / ld["seconds"]
    others = None if ld["others_cores"] is None else max(ld["others_cores"] - child, 0.0)
    return r.stdout, r.stderr, ld["seconds"], others


def verdicts(cache: Path, threads: int) -> dict:
    """The cache's host read figure and every probe's verdict for `threads`: {name: (figure, trusted, others_cores)}."""
    try:
        data = json.loads((cache / "hardware.json").read_text())
    except (OSError, ValueError):
        return {}
    t = str(threads)
    out = {}

    def put(name, e, key):
        if isinstance(e, dict):
            ld = e.get("load") or {}
            out[name] = {"figure": e.get(key), "trusted": e.get("trusted"), "why": e.get("why"),
                         "others_cores": ld.get("others_cores"), "spread": e.get("spread"),
                         "measured_at": e.get("measured_at"), "floor": e.get("floor", False)}

    put("host read GB/s", data.get("host_read_bandwidth", {}).get(t), "gbps")
    for q, e in sorted(data.get("kernel_decode_gbps", {}).get(t, {}).items()):
        put(f"kernel {q} GB/s", e, "gbps")
    put("torch float32 FLOP/s", data.get("float_flops", {}).get(t), "flops")
    for key, e in data.get("forward_overhead", {}).get(t, {}).items():
        put(f"overhead s/layer ({key})", e, "layer_s")
    return out


def warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "warning" in line or "under load" in line]


def scenario(model: Path, cache: Path, threads: int, busy: int, reps: int) -> dict:
    from moerun.placement import load

    env = {"MOERUN_CACHE": str(cache)}
    t = str(threads)
    rec: dict = {"model": str(model), "threads": threads, "busy_loops": busy}
    with Hogs(busy):
        rec["load_busy"] = load.quiet_now(1.0)
        out, err, secs, others = run(["estimate", str(model), "-t", t, "--measure", "--json"], env)
    busy_est = json.loads(out)
    rec["busy"] = {"expected_tok_s": busy_est["decode"]["expected_tok_s"], "ram_gbps": busy_est["rates"]["ram_gbps"],
                   "warnings": warnings(err), "seconds": secs, "others_cores": others,
                   "cache": verdicts(cache, threads)}
    out, err, _, _ = run(["estimate", str(model), "-t", t, "--no-measure", "--json"], env)
    rec["stale_expected_tok_s"] = json.loads(out)["decode"]["expected_tok_s"]

    rec["load_before_estimate"] = load.quiet_now(1.0)
    out, err, secs, others = run(["estimate", str(model), "-t", t, "--json"], env)
    est = json.loads(out)
    rec["estimate"] = {"expected_tok_s": est["decode"]["expected_tok_s"], "ram_gbps": est["rates"]["ram_gbps"],
                       "sources": est["sources"], "warnings": warnings(err), "seconds": secs, "others_cores": others,
                       "probes": est.get("probes"), "cache": verdicts(cache, threads)}
    rec["load_before_bench"] = load.quiet_now(1.0)
    out, err, secs, others = run(["bench", "-m", str(model), "-t", t, "-p", "0", "-n", "128", "-r", str(reps), "-o",
                                  "json"], env)
    tg = json.loads(out)[0]
    rec["bench"] = {"avg_ts": tg["avg_ts"], "stddev_ts": tg["stddev_ts"], "samples_ts": tg["samples_ts"],
                    "median_ts": statistics.median(tg["samples_ts"]), "others_cores": others,
                    "host_read_gbps": tg["host_read_gbps"], "bound_fraction": tg["bound_fraction"],
                    "achieved_gbps": tg["achieved_gbps"], "log": [ln for ln in err.splitlines() if "host read" in ln
                                                                  or "read " in ln], "seconds": secs,
                    "cache": verdicts(cache, threads)}
    rec["ratio"] = rec["estimate"]["expected_tok_s"] / tg["avg_ts"]
    rec["ratio_median"] = rec["estimate"]["expected_tok_s"] / rec["bench"]["median_ts"]
    rec["stale_ratio"] = rec["stale_expected_tok_s"] / tg["avg_ts"]
    rec["warned"] = bool(rec["busy"]["warnings"] or rec["estimate"]["warnings"])
    rec["within"] = abs(rec["ratio"] - 1) <= TOLERANCE
    return rec


def report(rec: dict, argv: list[str]) -> str:
    def cores(x: float | None) -> str:
        return cell(x, ".2f")

    bench, est, busy = rec["bench"], rec["estimate"], rec["busy"]
    rows = [
        ("probes under load (`estimate --measure`)", cores(busy["others_cores"]), f"{busy['ram_gbps']:.1f}",
         f"{busy['expected_tok_s']:.1f}", "-", "-"),
        ("estimate from those figures (`--no-measure`)", "-", f"{busy['ram_gbps']:.1f}",
         f"{rec['stale_expected_tok_s']:.1f}", f"{rec['stale_ratio']:.3f}",
         pct_err(rec["stale_expected_tok_s"], bench["avg_ts"])),
        ("quiet estimate (the default)", cores(est["others_cores"]), f"{est['ram_gbps']:.1f}",
         f"{est['expected_tok_s']:.1f}", f"{rec['ratio']:.3f}", pct_err(est["expected_tok_s"], bench["avg_ts"])),
        (f"bench tg128, mean ± sd (median) of {len(bench['samples_ts'])}", cores(bench["others_cores"]),
         f"{bench['host_read_gbps']:.1f}", (f"{bench['avg_ts']:.1f} ± {bench['stddev_ts']:.1f} "
         f"({bench['median_ts']:.1f})"), "1", "-"),
    ]
    table = md_table(("step", "other processes' cores during it", "host read GB/s used", "decode t/s",
                      "/ bench mean", "error"), rows, "lrrrrr")
    verdict = (f"Estimate / bench: {rec['ratio']:.3f} against the mean, {rec['ratio_median']:.3f} against the "
               f"median: {'within' if rec['within'] else 'outside'} ±15%; "
               f"{'a warning was printed' if rec['warned'] else 'no warning was printed'}. The load over a second "
               f"before each quiet step: {cores(rec['load_before_estimate']['others_cores'])} and "
               f"{cores(rec['load_before_bench']['others_cores'])} cores; during the busy probes' start, "
               f"{cores(rec['load_busy']['others_cores'])}.")
    lines = [dated_heading("a probe taken under load, then a quiet estimate and bench (issue 39, item 5)"), "",
             machine_header(rec["threads"], argv), "", table, "", verdict, ""]
    lines += ["Warnings on the way:", ""] + [f"- `` {w} ``" for w in busy["warnings"] + est["warnings"]]
    lines += ["", "bench's lines about the figure:", ""] + [f"- `` {w} ``" for w in bench["log"]]
    after = ", ".join(f"{k} {'trusted' if v['trusted'] else 'untrusted'}" for k, v in est["cache"].items())
    lines += ["", f"The cache after the quiet estimate: {after}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, "paragraph")
    add(p, "threads", "append", append={"help": "append the section to bench/RESULTS.md"})
    p.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="busy loops during the first probes")
    p.add_argument("--model", type=Path, default=None, help="an a3b-L4 Q4_K_M file (default: made here)")
    p.add_argument("--reps", type=int, default=5, help="bench's timed runs")
    p.add_argument("--out", type=Path, default=None, help="the record as JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stale-probe-") as tmp:
        tmp = Path(tmp)
        model = args.model
        if model is None:
            model = tmp / "a3b-L4-Q4_K_M.gguf"
            print(f"make-model a3b-L4 -> {model}", file=sys.stderr, flush=True)
            run(["make-model", "a3b-L4", str(model), "--ftype", "Q4_K_M", "--no-progress"], {})
        rec = scenario(model, tmp / "cache", args.threads, args.busy, args.reps)
    if args.out is not None:
        write_json(args.out, rec)
    publish(report(rec, ["bench/stale_probe.py", *(argv if argv is not None else sys.argv[1:])]), args.append)
    return 0 if rec["within"] and rec["warned"] else 1


if __name__ == "__main__":
    sys.exit(main())
