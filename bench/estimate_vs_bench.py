"""`moerun estimate` against `moerun bench` on the same files, probes taken beside the runs (issue 7).

For each model, back to back: probes A (`estimate --measure` into a cache folder of its own), the bench with
the routed experts in RAM (pp512 + tg128, recording the timed runs' routing), the bench with the experts in
the file's map (the disk tier) behind expert caches of 25% and 50% of the expert bytes (tg128), probes B.
Then the estimates from A and from B (hit rates from the bench's own routing trace, from another text's trace
when `--other-trace DIR` holds `<model stem>.jsonl`, and uniform) and a markdown table of their mean against
the measurements. On a machine whose bandwidth drifts, run it where nothing else runs (the recorded run in
bench/journal/issue-07.md paused the other jobs on the VM for each model's benchmarks).

    python bench/estimate_vs_bench.py ~/.cache/moerun/bench-models/a3b-L4-Q4_K_M.gguf ... --out /tmp/evb
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from toolkit import add, moerun, parser, pct_err, write_json

FRACTIONS = (0.25, 0.5)


def measure(model: Path, d: Path, threads: str) -> dict:
    """Probes A, both benches, probes B; -> the raw records."""
    info = json.loads(moerun("inspect", str(model), "--json"))
    routed = sum(info["bytes_by_class"]["routed_experts"].values())
    sizes = [round(routed * f / 2**20, 1) for f in FRACTIONS]
    trace = d / "bench.jsonl"
    trace.unlink(missing_ok=True)
    home_cache = Path(os.environ.get("MOERUN_CACHE", Path.home() / ".cache/moerun")) / "hardware.json"
    for p in ("A", "B"):
        (d / p).mkdir(parents=True, exist_ok=True)
        if home_cache.is_file():
            shutil.copy(home_cache, d / p / "hardware.json")
    probe = ("estimate", str(model), "-t", threads, "--json", "--measure")
    moerun(*probe, env={"MOERUN_CACHE": str(d / "A")}, out=d / "A.est")
    moerun("bench", "-m", str(model), "-t", threads, "-o", "json", "-p", "512", "-n", "128", "-r", "3",
           "--trace-routing", str(trace), out=d / "ram.bench")
    moerun("bench", "-m", str(model), "-t", threads, "-o", "json", "-p", "0", "-n", "128", "-r", "3",
           "--expert-cache-mib", ",".join(map(str, sizes)), out=d / "cache.bench")
    moerun(*probe, env={"MOERUN_CACHE": str(d / "B")}, out=d / "B.est")
    return {"sizes": sizes, "trace": str(trace), "bench_ram": json.loads((d / "ram.bench").read_text()),
            "bench_cache": json.loads((d / "cache.bench").read_text())}


def estimates(model: Path, d: Path, threads: str, rec: dict, other: Path | None) -> dict:
    """Per probe set: the RAM estimate, and per cache size the estimates with each hit-rate source."""
    out = {}
    for p in ("A", "B"):
        ram = json.loads((d / f"{p}.est").read_text())
        env = {"MOERUN_CACHE": str(d / p)}
        base = ("estimate", str(model), "-t", threads, "--json", "--no-measure", "--disk-bw",
            str(ram["rates"]["disk_gbps"]))
        traces = {"bench_trace": rec["trace"], "uniform": None}
        if other is not None and (other / f"{model.stem}.jsonl").is_file():
            traces["other_trace"] = str(other / f"{model.stem}.jsonl")
        out[p] = {"ram": ram, "cache": {str(s): {k: json.loads(moerun(*base, "--expert-cache-mib", str(s),
                                                                      *(("--trace", t) if t else ()), env=env))
                                                 for k, t in traces.items()} for s in rec["sizes"]}}
    return out


def all_tokens_per_s(b: dict) -> float:
    return (b["n_prompt"] + b["n_gen"]) * len(b["samples_ns"]) * 1e9 / sum(b["samples_ns"])


def table(results: dict) -> str:
    dec = [("| model | experts' home | hit rate (bench) | estimate t/s, bench's trace (A / B) | tg128 t/s mean ± sd "
           "| tg128 t/s all tokens / all time | error | estimate, other text's trace | estimate, uniform |"),
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    pre = ["| model | estimate pp512 t/s (A / B) | measured pp512 t/s | error |", "|---|---:|---:|---:|"]
    for name, r in results.items():
        A, B = r["probes"]["A"], r["probes"]["B"]
        pp = next(b for b in r["bench_ram"] if b["n_prompt"])
        tg = next(b for b in r["bench_ram"] if b["n_gen"])
        ea, eb = A["ram"]["decode"]["expected_tok_s"], B["ram"]["decode"]["expected_tok_s"]
        e = (ea + eb) / 2
        dec.append(f"| {name} | RAM | - | {e:.1f} ({ea:.1f} / {eb:.1f}) | {tg['avg_ts']:.1f} ± {tg['stddev_ts']:.1f} "
                   f"| {all_tokens_per_s(tg):.1f} | {pct_err(e, all_tokens_per_s(tg))} | | |")
        pa, pb = A["ram"]["prefill"]["tok_s"], B["ram"]["prefill"]["tok_s"]
        pre.append(f"| {name} | {(pa + pb) / 2:.1f} ({pa:.1f} / {pb:.1f}) | {pp['avg_ts']:.1f} ± {pp['stddev_ts']:.1f} "
                   f"| {pct_err((pa + pb) / 2, pp['avg_ts'])} |")
        for b in r["bench_cache"]:
            s, meas = str(b["expert_cache_mib"]), all_tokens_per_s(b)

            def cell(kind, s=s, meas=meas, A=A, B=B):
                if kind not in A["cache"][s]:
                    return "-"
                v = (A["cache"][s][kind]["decode"]["expected_tok_s"] + B["cache"][s][kind]["decode"]["expected_tok_s"]) / 2
                return f"{v:.1f} (hit {100 * A['cache'][s][kind]['hit_rate']:.1f}%): {pct_err(v, meas)}"

            dec.append(f"| {name} | file + {b['expert_cache_mib']:g} MiB cache | {100 * b['expert_cache_hit_rate']:.1f}% "
                       f"| {cell('bench_trace')} | {b['avg_ts']:.1f} ± {b['stddev_ts']:.1f} | {meas:.1f} | "
                       f"{cell('bench_trace').rsplit(': ', 1)[-1]} | {cell('other_trace')} | {cell('uniform')} |")
    return "\n".join(dec) + "\n\n" + "\n".join(pre) + "\n"


def main() -> None:
    ap = add(parser(__doc__, "paragraph"), "models", models={"type": Path})
    ap.add_argument("--out", type=Path, required=True, help="folder for probes, traces and records")
    add(ap, "threads", threads={"type": str, "default": "2"})
    ap.add_argument("--other-trace", type=Path, default=None, help="folder of <model stem>.jsonl routing traces")
    args = ap.parse_args()
    results = {}
    for model in args.models:
        d = args.out / model.stem
        rec = measure(model, d, args.threads)
        rec["probes"] = estimates(model, d, args.threads, rec, args.other_trace)
        write_json(d / "result.json", rec)
        results[model.stem] = rec
    print(table(results))


if __name__ == "__main__":
    main()
