"""Prefill and decode while other processes hold the cores (issue 15, item 1).

For each round, load (0, 1 or 2 busy processes: `python -c "while True: pass"`, one per core taken), thread
count (the default, physical cores, and 1) and tool (moerun; llama.cpp through llama-cpp-python where it is
installed), one `moerun bench` / llama.cpp worker run of pp{P} and tg{N}. The busy processes start before a
run and are ended after it. Rounds repeat the whole grid so that each ratio (default threads / -t 1 under the
same load) is measured within one round.

    python bench/under_load.py default ~/.cache/moerun/bench-models/a3b-L4-Q4_K_M.gguf --rounds 3 --append

`--omp-wait-policy ACTIVE` runs moerun with torch's OpenMP threads spinning (what moerun did before it set
OMP_WAIT_POLICY=PASSIVE), for the before/after comparison.
"""

from __future__ import annotations

import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
from toolkit import (
    HERE,
    add,
    cell,
    dated_heading,
    machine,
    moerun_cmd,
    moerun_commit,
    parser,
    publish,
    ratio,
    run_json,
)


class Hogs:
    """`n` processes that each spin on a core until the block ends."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        time.sleep(0.5 if self.n else 0)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


def resolve_model(name: str) -> str:
    if name == "default":
        from moerun.builtin import default_model_path

        return str(default_model_path())
    return name


def moerun_run(model: str, threads: int, n_prompt: int, n_gen: int, reps: int, policy: str | None,
               timeout: float) -> dict:
    """pp and tg t/s from one `moerun bench` process -> {"pp": t/s, "tg": t/s} (None: it ran past timeout)."""
    env = {"OMP_WAIT_POLICY": policy} if policy else None
    out = {}
    for kind, p, n in (("pp", n_prompt, 0), ("tg", 0, n_gen)):
        cmd = moerun_cmd("bench", "-m", model, "-p", p, "-n", n, "-r", reps, "-t", threads, "-o", "json")
        try:
            out[kind] = run_json(cmd, env=env, timeout=timeout, echo=False)[0]["avg_ts"]
        except subprocess.TimeoutExpired:
            out[kind] = None
    return out


def llama_run(model: str, threads: int, n_prompt: int, n_gen: int, reps: int, timeout: float) -> dict | None:
    cmd = [sys.executable, str(HERE / "compare_llamacpp.py"), "--llama-worker", model, "-p", str(n_prompt),
           "-n", str(n_gen), "-r", str(reps), "-t", str(threads)]
    try:
        d = run_json(cmd, timeout=timeout, echo=False)
    except subprocess.TimeoutExpired:
        return {"pp": None, "tg": None}
    return {"pp": statistics.fmean(n_prompt * 1e9 / ns for ns in d["pp"]),
            "tg": statistics.fmean(n_gen * 1e9 / ns for ns in d["tg"])}


def have_llama() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def fmt(v: float | None) -> str:
    return cell(v, ".1f", "timeout")


def main(argv: list[str] | None = None) -> int:
    p = add(parser(__doc__), "models", "--rounds", models={"help": "GGUF files, or `default` for the built-in model"})
    p.add_argument("--first-round", type=int, default=1, help="number of the first round (runs split over windows)")
    p.add_argument("-p", "--n-prompt", type=int, default=128)
    p.add_argument("-n", "--n-gen", type=int, default=32)
    p.add_argument("-r", "--reps", type=int, default=2)
    p.add_argument("--loads", default="0,1,2", help="busy processes, comma-separated")
    p.add_argument("--timeout", type=float, default=240, help="seconds one tool's run may take")
    p.add_argument("--omp-wait-policy", default=None, help="OMP_WAIT_POLICY for moerun's runs (default: moerun's)")
    p.add_argument("--no-llama", action="store_true")
    args = add(p, "append", append={"help": "append the section to bench/RESULTS.md"}).parse_args(argv)
    cores = psutil.cpu_count(logical=False) or 1
    thread_counts = sorted({cores, 1}, reverse=True)
    loads = [int(x) for x in args.loads.split(",")]
    llama = have_llama() and not args.no_llama
    rows = []  # (round, model, load, tool, threads, pp, tg)
    for rnd in range(args.first_round, args.first_round + args.rounds):
        for name in args.models:
            model = resolve_model(name)
            for load in loads:
                for t in thread_counts:
                    with Hogs(load):
                        got = moerun_run(model, t, args.n_prompt, args.n_gen, args.reps, args.omp_wait_policy,
                                         args.timeout)
                    rows.append((rnd, name, load, "moerun", t, got["pp"], got["tg"]))
                    print(rows[-1], file=sys.stderr, flush=True)
                    if llama:
                        with Hogs(load):
                            got = llama_run(model, t, args.n_prompt, args.n_gen, args.reps, args.timeout)
                        rows.append((rnd, name, load, "llama.cpp", t, got["pp"], got["tg"]))
                        print(rows[-1], file=sys.stderr, flush=True)
    invocation = shlex.join(["python", "bench/under_load.py", *(sys.argv[1:] if argv is None else argv)])
    lines = [dated_heading("prefill and decode with other processes on the cores (issue 15)"), "",
             (f"Machine: {machine()}. moerun commit {moerun_commit()}. Run: `{invocation}`. Busy processes: "
             f"`python -c \"while True: pass\"`, one per core taken. pp{args.n_prompt} / tg{args.n_gen}, mean of "
             f"{args.reps} runs each (llama-bench's t/s); `default` is the built-in model (F16)."), "",
             "| round | model | busy cores | tool | pp t/s, -t " + str(cores) + " | pp t/s, -t 1 | pp ratio | "
             "tg t/s, -t " + str(cores) + " | tg t/s, -t 1 | tg ratio |",
             "| ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    by = {(r[0], r[1], r[2], r[3], r[4]): r for r in rows}
    for (rnd, name, load, tool, t), r in by.items():
        if t != cores:
            continue
        one = by.get((rnd, name, load, tool, 1), r)
        lines.append(f"| {rnd} | {Path(name).name} | {load} | {tool} | {fmt(r[5])} | {fmt(one[5])} | "
                     f"{ratio(r[5], one[5])} | {fmt(r[6])} | {fmt(one[6])} | {ratio(r[6], one[6])} |")
    text = "\n".join(lines) + "\n"
    publish(text, args.append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
