"""One-token GEMV (and a few-token GEMM) over Q4_K weights: GGUF's layout vs the kernels' interleaved one
(Q4_K_R8), on 4 KiB pages vs transparent huge pages, from L2 and from DRAM.

    python bench/gemv_layouts.py [--threads 1,2] [--reps 7] [--qtype Q4_K|Q5_K|Q6_K|Q8_0|MXFP4] [--k 2048]
                                 [--tokens 1,4]
                                 [--kernel-only]

(`--qtype MXFP4 --k 2880 --tokens 1,4,64`: gpt-oss's expert rows, MXFP4 vs MXFP4_R8.)

Prints GB/s of weight bytes (median of --reps passes) per case, and the ratios within each row, so a noisy
machine is compared with itself. Run it with nothing else busy.

Then one core's kernel alone, from L1, L2 and memory: one-token passes on the calling thread with nothing between
them (the kernels' `dot_passes`), where the table above pays Python's and the pool's set-up for every call (a
295 KB matrix: about a quarter of its time; issue 36), with the VNNI set's one-token passes on 256-bit and on 512-bit
vectors (cpu.set_wide) beside each other.
"""

from __future__ import annotations

import torch
from toolkit import ints, median_time, parser

from moerun.hostmem import host_empty
from moerun.kernels import _cpu, cpu
from moerun.quant.qtypes import QTensor, QType, tensor_bytes
from moerun.quant.quantize import quantize


def blocks(rows: int, K: int, qtype: QType) -> torch.Tensor:
    """rows x K of `qtype` as GGUF bytes: quantized normals, or (Q5_K, which moerun does not quantize) random bytes
    with d and dmin set to 2^-10, since a kernel's speed does not depend on the values."""
    if qtype != QType.Q5_K:
        return quantize(torch.randn(rows, K) * 0.05, qtype)
    raw = torch.randint(0, 256, (rows * K // 256, 176), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    raw[:, :4] = torch.full((1, 2), 2.0 ** -10, dtype=torch.float16).view(torch.uint8)
    return raw.view(rows, -1)


def weights(rows: int, K: int, layout: str, pages: str, qtype: QType = QType.Q4_K) -> QTensor:
    """rows x K of `qtype` (1024 distinct rows tiled) in `layout` ("gguf" | "r8") on `pages` ("4k" | "huge")."""
    base = blocks(min(rows, 1024), K, qtype)
    raw = base.repeat(rows // base.shape[0], 1)
    t = QTensor.from_bytes(raw, qtype, (rows, K))
    if layout == "r8":
        t = cpu.interleave(t)  # on huge pages (host_empty)
    if pages == "4k" or layout == "gguf":
        data = torch.empty(t.data.shape, dtype=torch.uint8) if pages == "4k" else host_empty(t.nbytes).view(t.data.shape)
        data.copy_(t.data)
        t = QTensor(data, t.qtype, t.shape, t.interleave)
    return t


def gbps(w: QTensor, T: int, reps: int) -> float:
    x = torch.randn(T, w.shape[1])
    calls = max(1, (256 << 20) // w.nbytes)  # ~256 MB per timed pass
    return w.nbytes / median_time(lambda _: cpu.matmul(x, w), reps, calls) / 1e9


def kernel_alone(K: int, qtype: QType, reps: int) -> None:
    """GB/s of one core's one-token passes (`_cpu.dot_passes`) over the interleaved layout on huge pages."""
    print(f"\none core, the kernel alone ({qtype.name} interleaved, huge pages, K = {K}; 256-bit / 512-bit: the VNNI "
          "set's one-token passes, cpu.set_wide, prefetch as set):")
    print("| weights | prefetch as set | prefetch off | 256-bit | 512-bit |")
    print("| --- | ---: | ---: | ---: | ---: |")
    dram = 524288 * 2048 // K // 1024 * 1024
    isa = cpu._isa(None)
    for name, rows in (("L1", 8), ("L2", 256), ("DRAM", dram)):
        w = weights(rows, K, "r8", "huge", qtype)
        x, out = torch.randn(K), torch.empty(rows)
        passes = max(1, (256 << 20) // w.nbytes)
        r = []
        for pf, wide in ((None, None), (0, None), (None, False), (None, True)):
            cpu.set_prefetch(pf)
            cpu.set_wide(wide)
            r.append(w.nbytes * passes / median_time(
                lambda _, w=w, rows=rows, x=x, out=out, passes=passes: _cpu.dot_passes(
                    isa, cpu._type(w), w.data.data_ptr(), rows, K, x.data_ptr(), passes, out.data_ptr()), reps) / 1e9)
        cpu.set_prefetch(None)
        cpu.set_wide(None)
        print(f"| {name} ({w.nbytes / 1e3:.0f} KB) | " + " | ".join(f"{v:.1f}" for v in r) + " |", flush=True)
        del w


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--qtype", default="Q4_K", choices=("Q4_K", "Q5_K", "Q6_K", "Q8_0", "MXFP4"))
    ap.add_argument("--k", type=int, default=2048, help="row length (a multiple of the type's block)")
    ap.add_argument("--tokens", default="1,4", help="token counts of the DRAM cases")
    ap.add_argument("--kernel-only", action="store_true", help="only one core's kernel alone")
    a = ap.parse_args()
    K, qtype = a.k, QType[a.qtype]
    if a.kernel_only:
        kernel_alone(K, qtype, a.reps)
        return
    l2, dram = 256, 524288 * 2048 // K // 1024 * 1024  # whole tiles of the 1024 distinct rows
    mb = [tensor_bytes(qtype, (n, K)) / 1e6 for n in (l2, dram)]
    cases = [(f"L2 ({mb[0] * 1000:.0f} KB)", l2, 1)] + [(f"DRAM ({mb[1]:.0f} MB)", dram, t) for t in ints(a.tokens)]
    combos = [("gguf", "4k"), ("gguf", "huge"), ("r8", "4k"), ("r8", "huge")]
    print(f"isa {cpu.features()['isa']}; GB/s of {qtype.name} weight bytes; K = {K}")
    print("| threads | weights | tokens | " + " | ".join(f"{lay} {pg}" for lay, pg in combos) + " | r8 huge / gguf 4k |")
    print("| ---: | --- | ---: | " + " | ".join("---:" for _ in combos) + " | ---: |")
    for th in ints(a.threads):
        _cpu.set_threads(th, -1)
        for name, rows, T in cases:
            r = []
            for lay, pg in combos:
                w = weights(rows, K, lay, pg, qtype)
                r.append(gbps(w, T, a.reps))
                del w
            print(f"| {th} | {name} | {T} | " + " | ".join(f"{v:.1f}" for v in r) + f" | {r[3] / r[0]:.2f} |",
                  flush=True)
    kernel_alone(K, qtype, a.reps)


if __name__ == "__main__":
    main()
