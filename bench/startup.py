"""Start-up before and after (issue 39, item 4): wall-clock time of `python -m moerun run -p x -n 1` (the
built-in model) and `python -m moerun --help`, at two commits, beside a bare `import torch`.

Each commit is exported (git archive) into a temporary folder with this checkout's built CPU kernels, and each
command runs from there; the commands take turns, round by round, so a busy spell of the (shared) machine meets
all of them. Prints the median and the runs of each, the 1-minute load average seen, and the CPU.

    python bench/startup.py --before aea1c90 --after HEAD --runs 5
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def export(commit: str, into: Path) -> Path:
    """The tree of `commit` in `into`, with the built kernels of this checkout (the .so git does not hold)."""
    into.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    for so in (ROOT / "moerun" / "kernels").glob("_cpu*.so"):
        shutil.copy2(so, into / "moerun" / "kernels" / so.name)
    return into


def cpu() -> str:
    info = {k.strip(): v for k, v in (line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines()
                                      if ":" in line)}
    return f"{info['model name'].strip()} family {info['cpu family'].strip()} model {info['model'].strip()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the commit before")
    ap.add_argument("--after", default="HEAD", help="the commit after (default: HEAD)")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    machine = cpu()
    with tempfile.TemporaryDirectory(prefix="moerun-startup-") as tmp:
        trees = {name: export(commit, Path(tmp) / name) for name, commit in (("before", args.before),
                                                                             ("after", args.after))}
        cmds = {f"{name} {what}": (argv, tree) for name, tree in trees.items()
                for what, argv in (("run", ["-m", "moerun", "run", "-p", "x", "-n", "1"]), ("--help", ["-m", "moerun", "--help"]))}
        cmds["import torch"] = (["-c", "import torch"], Path(tmp))
        times: dict[str, list[float]] = {k: [] for k in cmds}
        loads = []
        for _ in range(args.runs):
            for key, (argv, cwd) in cmds.items():
                t = time.perf_counter()
                subprocess.run([sys.executable, *argv], cwd=cwd, check=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
                times[key].append(time.perf_counter() - t)
                loads.append(float(Path("/proc/loadavg").read_text().split()[0]))
    print(f"{machine}; before {args.before}, after {args.after}; {args.runs} rounds")
    for key, ts in times.items():
        print(f"{key:<16} median {statistics.median(ts):.3f} s   runs {' '.join(f'{t:.3f}' for t in ts)}")
    print(f"1-minute load average during: {min(loads):.2f}-{max(loads):.2f}")


if __name__ == "__main__":
    main()
