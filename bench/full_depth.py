"""Full-depth benchmark files, quantized by llama.cpp's own llama-quantize, so moerun and llama.cpp read the same bytes
(issue 36).

    python bench/full_depth.py --llama-bin ~/llama.cpp/build/bin --out /data/fd \\
        [--models qwen3moe-30b,qwen35moe-35b] [--types Q4_K_M,Q8_0] [--src-type F16] [--keep] [--time-load 3]

For each model (a preset name; by default every full-depth preset, moerun.tools.presets.FULL_DEPTH: all layers,
the real vocabulary, fewer routed experts, the same weight bytes per token), make-model writes random weights as
OUT/NAME-SRC.gguf (--src-type: F16, BF16 or Q8_0; the last is half the disk and needs llama-quantize's
--allow-requantize), then `llama-quantize IN OUT/NAME-TYPE.gguf TYPE` makes each type, and the big intermediate
file is removed unless --keep (one that was there before the run is never removed). gpt-oss's 4-bit file is
MXFP4_MOE (its experts MXFP4, as released; the rest Q8_0): Q4_K_M is read as MXFP4_MOE for the gptoss family.

Files that exist are skipped, never overwritten; llama-quantize writes a hidden temporary file that is renamed at
the end. Before a model is written, the free space of --out is checked against the intermediate plus the outputs
(estimated from moerun's byte count of the model with make-model's own choice of types, 5% margin) and the run
stops with a one-line error when it would not fit.

--time-load N: after writing, each file's load time in each engine, the file in the page cache (one run of each
first to read it in), N rounds with the engines taking turns (the first of them alternating by round: a run right
after another process freed its memory faults its own faster), medians: moerun as the wall time of `python -m
moerun run -m FILE -p hi -n 1 -t T` (Python's start and imports included), llama.cpp as the wall time of
`llama-bench -m FILE -p 0 -n 1 -r 1 -t T` (from --llama-bin), each with the file's prompt of one token and one
generated token; beside them the user and system CPU seconds of each run (its rusage): where the memory is new to
a VM, faulting it in (system time) can decide the wall time. moerun's modules are compiled to bytecode first, as
pip's install of a wheel does: where the environment sets PYTHONDONTWRITEBYTECODE (this project's VM does) an
editable install would otherwise compile its 92 modules again in every run (0.21 s on the Xeon VM).
"""

from __future__ import annotations

import os
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests load this file by its path
from toolkit import cpu_model, parser

GB = 1e9
SRC_TYPES = ("F16", "BF16", "Q8_0")
MARGIN = 1.05


class FullDepthError(Exception):
    """A condition that stops the run, said in one line."""


def out_type(family: str, qtype: str) -> str:
    """The llama-quantize type written for `qtype` (gpt-oss's 4-bit type is MXFP4_MOE)."""
    return "MXFP4_MOE" if family == "gptoss" and qtype.upper() == "Q4_K_M" else qtype.upper()


def estimated_bytes(spec, ftype: str) -> int:
    """Bytes of `spec`'s tensors as make-model types them for `ftype` (llama.cpp's rules, simplified: rows that
    are not whole blocks fall back to Q8_0, where llama-quantize takes Q5_0; never smaller than llama.cpp's).
    A llama-quantize type make-model does not write (Q5_K_M, IQ4_XS, ...): Q4_K_M's bytes scaled by its main
    type's bits per weight against Q4_K's, which overstates the Q6_K tensors both mixes hold."""
    from moerun.arch import expected_shapes
    from moerun.quant.ggml_types import QType, bits_per_weight, tensor_bytes
    from moerun.tools.gguf_out import FTYPES, qtype_for

    name = ftype.upper()
    if name not in FTYPES:
        main = re.sub(r"_(XXS|XS|S|M|L|NL)$", "", name)  # Q5_K_M -> Q5_K, IQ4_XS stays (a type of its own)
        qtype = QType.__members__.get(name) or QType.__members__.get(main)
        if qtype is None:
            raise FullDepthError(f"unknown quantization type {ftype}: llama-quantize --help lists them")
        scale = max(1.0, bits_per_weight(qtype) / bits_per_weight(QType.Q4_K))
        return round(estimated_bytes(spec, "Q4_K_M") * scale)
    return sum(tensor_bytes(qtype_for(cn, shape, ftype, n_layers=spec.n_layers,
                                      tied_embeddings=spec.tie_embeddings), shape)
               for cn, shape in expected_shapes(spec).items())


def check_space(folder: Path, need: int, what: str) -> None:
    free = shutil.disk_usage(folder).free
    if free < need:
        raise FullDepthError(f"{folder} has {free / GB:.1f} GB free and {what} needs ~{need / GB:.1f} GB: free some "
                             f"space, write elsewhere (--out), or use --src-type Q8_0 (half the intermediate)")


def _publish(tmp: Path, path: Path) -> None:
    """tmp becomes path, never replacing a file that appeared meanwhile."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise FullDepthError(f"{path} appeared while writing; not replacing it") from None
    finally:
        tmp.unlink(missing_ok=True)


def quantize(binary: Path, src: Path, dst: Path, qtype: str, threads: int, requantize: bool) -> None:
    tmp = dst.with_name(f".{dst.name}.partial")
    tmp.unlink(missing_ok=True)
    cmd = [str(binary), *(["--allow-requantize"] if requantize else []), str(src), str(tmp), qtype, str(threads)]
    print(f"$ {shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if p.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = (p.stderr or p.stdout).strip().splitlines()[-5:]
        raise FullDepthError(f"llama-quantize {qtype} of {src.name} failed ({p.returncode}): {' | '.join(tail)}")
    _publish(tmp, dst)
    print(f"  {dst.name}: {dst.stat().st_size / GB:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)


def build_model(name: str, args, binary: Path) -> list[Path]:
    """Every type of one model, skipping the files that exist. Returns the output paths."""
    from moerun.tools.make_model import make_model
    from moerun.tools.presets import preset

    spec = preset(name)
    types = list(dict.fromkeys(out_type(spec.family, t) for t in args.types))
    outs = {t: args.out / f"{name}-{t}.gguf" for t in types}
    todo = {t: p for t, p in outs.items() if not p.exists()}
    for t, p in outs.items():
        if t not in todo:
            print(f"{p} exists: skipped", flush=True)
    if not todo:
        return list(outs.values())
    src = args.out / f"{name}-{args.src_type}.gguf"
    made = not src.exists()
    need = sum(estimated_bytes(spec, t) for t in todo) + (estimated_bytes(spec, args.src_type) if made else 0)
    check_space(args.out, round(need * MARGIN), f"{name} ({args.src_type} intermediate and {', '.join(todo)})")
    if made:
        print(f"make-model {name} {args.src_type} -> {src}", flush=True)
        t0 = time.perf_counter()
        make_model(spec, src, ftype=args.src_type, seed=args.seed, name=name, threads=args.threads,
                   progress=sys.stderr.isatty())
        print(f"  {src.name}: {src.stat().st_size / GB:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
    else:
        print(f"{src} exists: quantizing from it (it is not removed)", flush=True)
    try:
        for t, p in todo.items():
            quantize(binary, src, p, t, args.threads or os.cpu_count() or 1, args.src_type == "Q8_0")
    finally:
        if made and not args.keep:
            src.unlink(missing_ok=True)
            print(f"removed {src.name} (--keep keeps it)", flush=True)
    return list(outs.values())


# ---------------------------------------------------------------------------------------------- load times


def _run(cmd: list[str]) -> tuple[float, float, float]:
    """cmd's wall, user and system seconds (the children's rusage before and after: subprocess.run waits for it)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, check=False, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise FullDepthError(f"{shlex.join(cmd)} failed ({p.returncode}): {(p.stderr or p.stdout)[-500:]}")
    return dt, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime


def load_commands(path: Path, args) -> dict[str, list[str]]:
    t = str(args.load_threads)
    return {"moerun": [sys.executable, "-m", "moerun", "run", "-m", str(path), "-p", "hi", "-n", "1", "-t", t],
            "llama.cpp": [str(args.llama_bin / "llama-bench"), "-m", str(path), "-p", "0", "-n", "1", "-r", "1",
                          "-t", t]}


def time_loads(paths: list[Path], args) -> list[str]:
    """Per file: each engine's median wall, user and system seconds over args.time_load rounds in turn (a warm-up
    run of each first: the file in the page cache)."""
    rows = ["| file | GB | moerun s | llama.cpp s | moerun / llama.cpp | moerun user, sys s | llama.cpp user, sys s |",
            "|---|---:|---:|---:|---:|---|---|"]
    rounds = []
    import moerun

    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(moerun.__file__).parent)], check=True,
                   capture_output=True)
    for path in paths:
        cmds = {e: c for e, c in load_commands(path, args).items() if e == "moerun" or Path(c[0]).is_file()}
        runs: dict[str, list[tuple[float, float, float]]] = {e: [] for e in cmds}
        for engine, cmd in cmds.items():
            print(f"$ {shlex.join(cmd)}  (1 + {args.time_load} runs)", flush=True)
            _run(cmd)
        for r in range(args.time_load):
            for engine in (list(cmds) if r % 2 == 0 else list(reversed(cmds))):
                runs[engine].append(_run(cmds[engine]))
        med = {e: [statistics.median(x[i] for x in v) for i in range(3)] for e, v in runs.items()}
        m, ll = med["moerun"], med.get("llama.cpp")
        rows.append(f"| {path.name} | {path.stat().st_size / GB:.2f} | {m[0]:.2f} | "
                    f"{f'{ll[0]:.2f}' if ll else '-'} | {f'{m[0] / ll[0]:.2f}' if ll else '-'} | "
                    f"{m[1]:.2f}, {m[2]:.2f} | {f'{ll[1]:.2f}, {ll[2]:.2f}' if ll else '-'} |")
        rounds += [f"{path.name} {e} (wall s, in order): {', '.join(f'{x[0]:.2f}' for x in v)}"
                   for e, v in runs.items()]
    return rows + ["", *rounds]


def main(argv: list[str] | None = None) -> int:
    from moerun.tools.presets import FULL_DEPTH, preset_names

    ap = parser(__doc__, "all")
    ap.add_argument("--llama-bin", required=True, type=Path, help="llama.cpp's build/bin (llama-quantize, llama-bench)")
    ap.add_argument("--out", required=True, type=Path, help="folder of the files")
    ap.add_argument("--models", default=",".join(FULL_DEPTH), help="preset names, comma separated")
    ap.add_argument("--types", default="Q4_K_M,Q8_0", help="llama-quantize types, comma separated")
    ap.add_argument("--src-type", default="F16", type=str.upper, choices=SRC_TYPES, help="make-model's output type")
    ap.add_argument("--keep", action="store_true", help="keep the intermediate file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="make-model's and llama-quantize's threads (default: every CPU)")
    ap.add_argument("--time-load", type=int, default=0, metavar="N", help="time each engine's load, median of N")
    ap.add_argument("--load-threads", type=int, default=2, help="-t of the load-time runs")
    args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.types = [t.strip().upper() for t in args.types.split(",") if t.strip()]
    try:
        unknown = [m for m in args.models if m not in preset_names()]
        if unknown:
            raise FullDepthError(f"unknown model {', '.join(unknown)} (full depth: {', '.join(FULL_DEPTH)})")
        binary = args.llama_bin / "llama-quantize"
        if not binary.is_file() or not os.access(binary, os.X_OK):
            raise FullDepthError(f"no llama-quantize in {args.llama_bin} (build llama.cpp's llama-quantize target)")
        args.out.mkdir(parents=True, exist_ok=True)
        paths = [p for m in args.models for p in build_model(m, args, binary)]
        print("\n".join(f"{p}  {p.stat().st_size / GB:.2f} GB" for p in paths))
        if args.time_load > 0:
            print(f"\nload times, median of {args.time_load} rounds in turn after a warm-up run, "
                  f"-t {args.load_threads}, {cpu_model()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
            print("\n".join(time_loads(paths, args)))
    except (FullDepthError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
