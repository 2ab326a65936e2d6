"""Everything a lent GPU should check (issue 14), one run, results as JSON: run through bench/gpu_check.sh.

    OUT=/tmp/out python bench/gpu_check.py [--standin] [--model FILE]

1. the GPU tests (tests/test_gpu.py and the Triton kernels' GPU tests); on a machine without CUDA the
   stand-in's equivalents (tests/test_device_stages.py, tests/test_device.py) instead;
2. beside the tests (CPU work on a core of its own), the work per decoded token counted on the stand-in (syncs,
   kernels per layer, host launches) and the decode tok/s it predicts on an H200 and a 24 GB card
   (moerun/gpu_counts.py), for the measured rows to sit beside;
3. `moerun bench` on one model for the placements
   (a) everything in VRAM (the expert slots hold every expert),
   (b) dense weights in VRAM, experts in pinned RAM behind caches of 0 %, 25 % and 50 % of the expert bytes,
   (c) --n-cpu-moe over every layer (llama.cpp's offload: experts computed by the CPU),
   each row with pp and tg t/s, hit rate, share of misses computed on the CPU, host-to-device GB/s and
   `moerun estimate`'s prediction for that placement (its `estimate_ts`).
   On a GPU the model is a3b-L12 Q4_K_M made there, pp512 / tg128; on the stand-in a small Q8_0 model,
   pp64 / tg16, told a GPU's link and VRAM figures (--h2d-bw 25 --vram-bw 900) so its miss path decides
   as a GPU's would; the whole run stays under 3 minutes (CI runs it).

Writes $OUT/gpu_check.json (environment, tests, rows, what failed) and $OUT/gpu_check.md (the rows as a
table for bench/RESULTS.md), and the bench's and pytest's own outputs beside them. Exits 1 when a step failed.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from toolkit import add, cell, parser, write_json

ROOT = Path(__file__).resolve().parent.parent


def sh(cmd: list[str], log: Path, timeout: float, stdout: Path | None = None,
       env: dict | None = None) -> tuple[int, float]:
    """Run cmd in the repository; stderr (and stdout, unless given a file of its own) to `log`; env: added."""
    t0 = time.perf_counter()
    with open(log, "w") as f, open(stdout or os.devnull, "w") as o:
        try:
            rc = subprocess.run(cmd, check=False, cwd=ROOT, stdout=o if stdout else f, stderr=f,
                                timeout=timeout, env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.perf_counter() - t0


def junit_counts(path: Path) -> dict:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suites = [root] if root.tag == "testsuite" else list(root)
    keys = ("tests", "failures", "errors", "skipped")
    out = {k: sum(int(s.get(k, 0)) for s in suites) for k in keys}
    out["failed"] = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
                     if c.find("failure") is not None or c.find("error") is not None]
    return out


def expert_bytes(model: str) -> int:
    from moerun.arch import resolve
    from moerun.arch.summary import summarize
    from moerun.formats import open_model

    with open_model(model) as mf:
        s = summarize(resolve(mf))
    return sum(s.by_class.get("routed_experts", {}).values())


def n_layers(model: str) -> int:
    from moerun.arch import resolve
    from moerun.formats import open_model

    with open_model(model) as mf:
        return resolve(mf).spec.n_layers


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--standin", action="store_true", help="the CPU stand-in, even where CUDA is present")
    ap.add_argument("--model", help="the bench model (default: made here)")
    ap.add_argument("--cache", default=os.environ.get("MOERUN_BENCH_CACHE", "/tmp/moerun-bench"),
                    help="folder for the made model")
    add(ap, "threads", threads=None)
    args = ap.parse_args()
    out = Path(os.environ.get("OUT") or ROOT / "gpu_check_out")
    out.mkdir(parents=True, exist_ok=True)
    import torch

    from moerun import device

    gpu = device.cuda_available() and not args.standin
    dev = "cuda:0" if gpu else "standin:0"
    report = {"device": dev, "gpu": device.describe(device.parse(dev)) if gpu else None, "torch": torch.__version__,
              "python": platform.python_version(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "steps": {}, "rows": [], "failed": []}

    # 1. tests, and beside them 2. the work per token counted on the stand-in and the decode speed it predicts
    # (moerun/gpu_counts.py: CPU work, a core of its own; the benches below run alone)
    tests = (["tests/test_gpu.py", "tests/test_triton_kernels.py", "tests/test_qwen3next.py", "-m", "gpu"]
             if gpu else
             ["tests/test_device_stages.py", "tests/test_device.py"])
    Path(args.cache).mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(1) as beside:
        counting = beside.submit(sh, [sys.executable, "-m", "moerun.gpu_counts", args.cache], out / "counts.log", 600,
                                 stdout=out / "counts.jsonl", env={"TRITON_INTERPRET": "1"})
        rc, secs = sh([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests,
                       f"--junitxml={out / 'tests.xml'}"], out / "tests.log", 900)
        report["steps"]["tests"] = {"rc": rc, "seconds": round(secs, 1), **junit_counts(out / "tests.xml")}
        if rc:
            report["failed"].append("tests")
        rc, secs = counting.result()
    report["steps"]["counts"] = {"rc": rc, "seconds": round(secs, 1)}
    try:
        report["counts"] = [json.loads(line) for line in (out / "counts.jsonl").read_text().splitlines() if line]
    except (OSError, ValueError):
        report["counts"] = []
    if rc or not report["counts"]:
        report["failed"].append("counts")

    # 3. the bench model
    model = args.model
    if model is None:
        Path(args.cache).mkdir(parents=True, exist_ok=True)
        if gpu:
            model = f"{args.cache}/a3b-L12-Q4_K_M.gguf"
            make = ["a3b-L12", model, "--ftype", "Q4_K_M"]
        else:
            model = f"{args.cache}/standin-q8.gguf"
            make = ["tiny-qwen3moe", model, "--ftype", "Q8_0", "--layers", "4", "--experts", "32", "--experts-used",
                    "4", "--hidden", "256", "--expert-ffn", "128"]
        if not Path(model).exists():
            rc, secs = sh([sys.executable, "-m", "moerun", "make-model", *make, "--no-progress"], out / "make.log", 900)
            report["steps"]["make_model"] = {"rc": rc, "seconds": round(secs, 1)}
            if rc:
                report["failed"].append("make_model")
                return finish(report, out)
    report["model"] = model
    p, n, reps = (512, 128, 3) if gpu else (64, 16, 1)
    mib = expert_bytes(model) / 2**20
    threads = ["-t", str(args.threads)] if args.threads else []
    # the stand-in's own figures make every miss cheaper at home (its "device" is the host); told a GPU's link
    # and VRAM figures, its miss path decides as a GPU's would, so the caches fill as they would there
    standin = [] if gpu else ["--h2d-bw", "25", "--vram-bw", "900"]
    common = ["-m", model, "-p", str(p), "-n", str(n), "-r", str(reps), "-o", "json", "--devices", dev, *threads,
              *standin]
    placements = {
        "a: all in VRAM": [],
        "b: experts in RAM, caches 0/25/50%": ["--expert-cache-mib", f"0,{mib * 0.25:.2f},{mib * 0.5:.2f}"],
        "c: --n-cpu-moe all layers": ["--n-cpu-moe", str(n_layers(model))],
    }
    for k, (name, extra) in enumerate(placements.items()):
        rc, secs = sh([sys.executable, "-m", "moerun", "bench", *common, *extra], out / f"bench_{k}.log", 900,
                      stdout=out / f"bench_{k}.json")
        report["steps"][name] = {"rc": rc, "seconds": round(secs, 1)}
        try:
            recs = json.loads((out / f"bench_{k}.json").read_text())
        except (OSError, ValueError):
            recs = []
        if rc or not recs:
            report["failed"].append(name)
        for r in recs:
            report["rows"].append({
                "placement": name, "test": f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}",
                "cache_mib": r["expert_cache_mib"], "t_s": r["avg_ts"], "stddev": r["stddev_ts"],
                "hit_rate": r["expert_cache_hit_rate"], "home_share": r["expert_cache_home_share"],
                "h2d_gbps": r["expert_cache_h2d_gbps"], "stall_s": r["expert_cache_stall_s"],
                "estimate_ts": r["estimate_ts"], "estimate_ratio": r["estimate_ts"] / r["avg_ts"]
                if r["estimate_ts"] and r["avg_ts"] else None, "stages": r["expert_cache_stages"]})
    return finish(report, out)


def finish(report: dict, out: Path) -> int:
    write_json(out / "gpu_check.json", report, indent=2)
    lines = [f"{report['device']} ({report['gpu'] or 'CPU stand-in'}), {report.get('model', '-')}, {report['date']}",
             "", "| placement | test | cache MiB | t/s | hit rate | home share | h2d GB/s | estimate t/s | est / meas |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        lines.append(f"| {r['placement']} | {r['test']} | {cell(r['cache_mib'], '.1f')} | "
                     f"{r['t_s']:.1f} ± {r['stddev']:.1f} | {cell(r['hit_rate'], '.1%')} | "
                     f"{cell(r['home_share'], '.1%')} | {cell(r['h2d_gbps'], '.1f')} | "
                     f"{cell(r['estimate_ts'], '.1f')} | {cell(r['estimate_ratio'], '.2f')} |")
    if report.get("counts"):
        lines += ["", ("Counted on the stand-in (structure at small widths), predicted for the real shape "
                  "(moerun/gpu_counts.py's figures):"), "",
                  ("| model | placement | syncs / step | kernels / layer | outside | host launches / step | graph | "
                  "predicted H200 tok/s | predicted 24 GB card tok/s |"), "|---|---|---:|---:|---:|---:|---|---:|---:|"]
        for c in report["counts"]:
            lines.append(f"| {c['model']} | {c['placement']} | {c['syncs_step']} | {c['kernels_layer']:g} | "
                         f"{c['kernels_outside']:g} | {c['host_launches_step']} | {'yes' if c['graph'] else 'no'} | "
                         f"{c['h200_ts']:,.0f} | {c['consumer_ts']:,.0f} |")
    t = report["steps"].get("tests", {})
    lines += ["", (f"tests: {t.get('tests', '?')} run, {t.get('failures', '?')} failed, {t.get('errors', '?')} errors, "
              f"{t.get('skipped', '?')} skipped ({t.get('seconds', '?')} s)")]
    if report["failed"]:
        lines.append("failed: " + ", ".join(report["failed"]))
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
