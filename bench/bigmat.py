"""One big interleaved weight matrix, one token, against the read probe, per type and kernel setting (issue 36).

    python bench/bigmat.py [--types q4_k,q6_k,q8_0,mxfp4] [--gib 1] [-t 2] [--rounds 5] [--calls 5]
        [--settings "default=" "none=pf:0" "t1=pf:8192,hint:t1,near:4096" ...]

A decode step is mostly one-token products over matrices far bigger than the caches; this measures the kernels on
that alone, without a model's other work. For each type a matrix of --gib GiB is made from 4096 quantized rows of
random floats, interleaved as the loader lays it out, copied over and over into huge-page memory
(hostmem.host_empty, as the loader's weights). Each round takes the probe (its 1 GiB, one pass of each pattern,
the best), then every setting in an order rotated each round: one warm call, then the median of --calls calls of
cpu.matmul with one token. A setting is settings_ab.py's NAME=KEY:VALUE,... (pf, hint, wide, spread, idle, near; a
key left out keeps the CPU's default). Per type and setting: the median GB/s over rounds, the median of each
round's % of the probe, and the median of each round's time over the first setting's.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests load this file by its path
from settings_ab import apply, as_setting, parse_setting
from toolkit import add, cpu_model, md_table, parser

SEED_ROWS = 4096


def big_matrix(qtype, gib: float, k: int = 4096):
    """A [rows, k] interleaved QTensor of about `gib` GiB in huge-page memory, 4096 quantized rows repeated."""
    import torch

    from moerun.hostmem import host_empty
    from moerun.kernels import cpu
    from moerun.quant.qtypes import QTensor, row_bytes
    from moerun.quant.quantize import quantize

    g = torch.Generator().manual_seed(0)
    try:
        seed = QTensor(quantize(torch.randn(SEED_ROWS, k, generator=g), qtype), qtype, (SEED_ROWS, k))
    except ValueError as e:
        raise SystemExit(f"--types: {e}") from None
    if not cpu.can_interleave(seed):
        raise SystemExit(f"--types: {qtype.name} has no interleaved layout on this CPU")
    seed = cpu.interleave(seed)
    rb = row_bytes(qtype, k)
    rows = max(SEED_ROWS, int(gib * 2**30) // rb // SEED_ROWS * SEED_ROWS)
    buf = host_empty(rows * rb).view(rows, rb)
    for r in range(0, rows, SEED_ROWS):
        buf[r:r + SEED_ROWS].copy_(seed.data)
    return QTensor(buf, qtype, (rows, k), interleave=seed.interleave)


def main(argv: list[str] | None = None) -> None:
    ap = add(parser(__doc__, "all"), "threads")
    ap.add_argument("--types", default="q4_k,q6_k,q8_0,mxfp4")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--settings", nargs="+", default=["default="])
    args = ap.parse_args(argv)
    settings = [parse_setting(s) for s in args.settings]

    import torch

    from moerun.kernels import cpu
    from moerun.model.ops import thread_budget
    from moerun.placement.bandwidth import measure_host_read_bandwidth
    from moerun.quant.qtypes import QType

    try:
        qtypes = [QType[t.strip().upper()] for t in args.types.split(",")]
    except KeyError as e:
        raise SystemExit(f"--types: unknown type {e.args[0]}") from None
    was = cpu.features()
    body = []
    with thread_budget(args.threads), torch.inference_mode():
        for qtype in qtypes:
            w = big_matrix(qtype, args.gib)
            nbytes = w.data.numel()
            x = torch.randn(1, w.shape[1])
            runs = {name: [] for name, _ in settings}  # name -> [(seconds, probe GB/s)]
            for r in range(args.rounds):
                probe = measure_host_read_bandwidth(args.threads, runs=1)["gbps"]
                for name, setting in settings[r % len(settings):] + settings[:r % len(settings)]:
                    apply(cpu, setting)
                    cpu.matmul(x, w)
                    times = []
                    for _ in range(args.calls):
                        t0 = time.perf_counter()
                        cpu.matmul(x, w)
                        times.append(time.perf_counter() - t0)
                    runs[name].append((statistics.median(times), probe))
                print(f"{qtype.name} round {r + 1}: probe {probe:.1f} GB/s; " + ", ".join(
                    f"{n} {nbytes / runs[n][-1][0] / 1e9:.1f}" for n, _ in settings), flush=True)
            base = runs[settings[0][0]]
            for name, setting in settings:
                got = runs[name]
                body.append([qtype.name, name, ",".join(f"{k}:{v}" for k, v in setting.items()) or "defaults",
                             f"{statistics.median(nbytes / s / 1e9 for s, _ in got):.1f}",
                             f"{statistics.median(100 * nbytes / s / 1e9 / p for s, p in got):.1f}",
                             f"{statistics.median(s / b for (s, _), (b, _) in zip(got, base)):.3f}"])
            del w
    apply(cpu, as_setting(was))
    print(f"\n{cpu_model()}, {args.threads} threads; {args.gib} GiB a matrix, {args.rounds} rounds of {args.calls} calls")
    print(md_table(["type", "setting", "values", "GB/s", "% of probe", "time / " + settings[0][0]], body))


if __name__ == "__main__":
    main()
