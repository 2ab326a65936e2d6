"""Micro-benchmark of moerun.kernels.cpu: GB/s of weights streamed.

    python bench/kernels_cpu.py [--threads 1,2] [--repeats 7] [--isa avx2] [--no-torch]

- matmul T=1 (decode GEMV) on an expert-sized (768 x 2048) and an attention-sized (4096 x 2048) weight,
  Q4_K / Q6_K / Q8_0; each call reads a different copy of the weight, the copies together several times
  the last-level cache, so the bytes come from DRAM as in decode;
- moe_ffn with the a3b layer shape (E=128 experts, k=8, I=768, H=2048; Q4_K gate/up, Q4_K or Q6_K down)
  at T=1 and T=32, random routing per call; bytes = the distinct experts routed to;
- in the same run, torch's `_weight_int4pack_mm_for_cpu` (bf16 activations, group 32) on the same shapes,
  the baseline the kernels replace (its GB/s count its own packed bytes).

Figures are medians of --repeats timed rounds. The machine may be shared: compare ratios within one run.
"""

from __future__ import annotations

import functools
import statistics

import torch
from toolkit import ints, median_time, parser

from moerun.kernels import cpu
from moerun.quant.qtypes import QTensor, QType
from moerun.quant.quantize import quantize

STREAM_BYTES = 192 << 20  # weight copies per case: several times a 32 MiB L3
E, K_ACTIVE, I, H = 128, 8, 768, 2048


def copies(data: torch.Tensor, n: int) -> torch.Tensor:
    """n distinct copies of data stacked: [n, *data.shape]."""
    return data.unsqueeze(0).expand(n, *data.shape).contiguous()


def matmul_call(x, ws, isa, i: int) -> None:
    cpu.matmul(x, ws[i % len(ws)], isa=isa)


def moe_call(x, routes, w, experts, isa, i: int) -> None:
    cpu.moe_ffn(x, routes[i], w, *experts, isa=isa)


def int4pack_call(x, packed, scales, i: int) -> None:
    torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed[i % len(packed)], 32, scales[i % len(scales)])


def bench_matmul(args) -> list[tuple]:
    rows = []
    for N, K in ((768, 2048), (4096, 2048)):
        x = torch.randn(1, K)
        for qtype in (QType.Q4_K, QType.Q6_K, QType.Q8_0):
            one = quantize(torch.randn(N, K) * 0.02, qtype)
            n = max(2, STREAM_BYTES // one.numel())
            ws = [QTensor(d, qtype, (N, K)) for d in copies(one, n)]
            call = functools.partial(matmul_call, x, ws, args.isa)
            for threads in args.threads:
                cpu.set_threads(threads)
                s = median_time(call, args.repeats, n, warmup=n)
                rows.append((f"matmul T=1 {N}x{K}", qtype.name, threads, s * 1e6, one.numel() / s / 1e9))
        if args.torch:
            rows += bench_int4pack(args, N, K)
    return rows


def bench_int4pack(args, N: int, K: int) -> list[tuple]:
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (N, K), dtype=torch.int32), 1)
    scales = (torch.rand(K // 32, N, 2) * 0.01).to(torch.bfloat16)
    nbytes = packed.numel() + scales.numel() * 2
    n = max(2, STREAM_BYTES // nbytes)
    ps, ss = copies(packed, n), copies(scales, n)
    x = torch.randn(1, K).to(torch.bfloat16)
    rows = []
    before = torch.get_num_threads()
    call = functools.partial(int4pack_call, x, ps, ss)
    for threads in args.threads:
        torch.set_num_threads(threads)
        s = median_time(call, args.repeats, n, warmup=n)
        rows.append((f"matmul T=1 {N}x{K}", "torch int4pack", threads, s * 1e6, nbytes / s / 1e9))
    torch.set_num_threads(before)
    return rows


def bench_moe(args) -> list[tuple]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for down_type in (QType.Q4_K, QType.Q6_K):
        # 8 distinct experts tiled to 128 (distinct memory, so nothing is shared between experts)
        gate = QTensor(quantize(torch.randn(8, I, H) * 0.02, QType.Q4_K).repeat(E // 8, 1, 1), QType.Q4_K, (E, I, H))
        up = QTensor(gate.data.clone(), QType.Q4_K, (E, I, H))
        down = QTensor(quantize(torch.randn(8, H, I) * 0.02, down_type).repeat(E // 8, 1, 1), down_type, (E, H, I))
        per_expert = (gate.nbytes + up.nbytes + down.nbytes) // E
        for T in (1, 32):
            x = torch.randn(T, H)
            calls = 32 if T == 1 else 4
            routes = [torch.stack([torch.randperm(E, generator=gen)[:K_ACTIVE] for _ in range(T)])
                      for _ in range(calls)]
            w = torch.softmax(torch.randn(T, K_ACTIVE, generator=gen), -1)
            nbytes = statistics.mean(len(torch.unique(r)) for r in routes) * per_expert
            call = functools.partial(moe_call, x, routes, w, (gate, up, down), args.isa)
            for threads in args.threads:
                cpu.set_threads(threads)
                s = median_time(call, args.repeats, calls, warmup=calls)
                rows.append((f"moe_ffn T={T} (a3b)", f"Q4_K/Q4_K/{down_type.name}", threads, s * 1e6,
                             nbytes / s / 1e9))
    return rows


def main() -> None:
    ap = parser(__doc__, "paragraph")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--isa", default=None, help="kernel set (default: the best this CPU runs)")
    ap.add_argument("--no-torch", dest="torch", action="store_false", help="skip the torch int4pack baseline")
    args = ap.parse_args()
    args.threads = ints(args.threads)
    if not cpu.available():
        raise SystemExit(f"kernels unavailable: {cpu.features()['reason']}")
    f = cpu.features()
    print(f"kernels: {args.isa or f['isa']} (this CPU runs {', '.join(f['isas'])}); "
          f"median of {args.repeats} rounds; torch {torch.__version__}\n")
    print("| case | weights | threads | us/call | GB/s |")
    print("|---|---|---|---|---|")
    for rows in (bench_matmul(args), bench_moe(args)):
        for case, qtype, threads, us, gbs in rows:
            print(f"| {case} | {qtype} | {threads} | {us:.1f} | {gbs:.1f} |", flush=True)
    cpu.set_threads(f["threads"])


if __name__ == "__main__":
    main()
