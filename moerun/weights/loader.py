"""Bytes -> tensors: materialise each canonical tensor as a QTensor (zero-copy where the file allows)."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import torch

from moerun.arch import Arch, Source
from moerun.arch.tensors import VALUE_MAPS
from moerun.errors import ModelFormatError
from moerun.formats.names import CName, tensor_class
from moerun.formats.records import ModelFile, TensorRecord
from moerun.hostmem import Arena, host_empty
from moerun.kernels.native import read_threads
from moerun.quant.qtypes import FLOAT_QTYPES, QTensor, QType, row_bytes
from moerun.quant.quantize import mxfp4_from_hf
from moerun.weights.preload import GGUF_LAYOUT_ONLY, Preload, read_layout


def _permute_rows(raw: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a Q/K projection from rotate-half to interleaved order (llama.cpp's convert permutation).

    Works on raw rows, so any qtype: each output row is a whole number of blocks.  # raw: [rows, row_bytes]
    """
    rows, rb = raw.shape
    return raw.reshape(n_heads, 2, rows // n_heads // 2, rb).transpose(1, 2).reshape(rows, rb)


def materialize(mf: ModelFile, src: Source) -> QTensor:
    rec0 = src.records[0]
    qtype = rec0.qtype
    for r in src.records[1:]:
        if r.qtype != qtype or r.shape != rec0.shape:
            raise ValueError(f"experts of '{rec0.name}' differ in type or shape")
    shape = rec0.shape
    if src.scales is not None:  # an HF MXFP4 pair: GGUF MXFP4 rows
        raw = mxfp4_from_hf(mf.raw(rec0).view(shape), mf.raw(src.scales).view(src.scales.shape))
        qtype, shape = QType.MXFP4, (*shape[:-2], shape[-2] * 32)
        raws = [raw]
    else:
        raws = [mf.raw(r).reshape(*shape[:-1], row_bytes(qtype, shape[-1])) for r in src.records]
    if src.stacked:
        raw = torch.stack(raws, out=host_empty(sum(r.numel() for r in raws)).view(len(raws), *raws[0].shape))
        # [E, rows, row_bytes]: one contiguous buffer per expert
        shape = (len(raws), *shape)
    else:
        raw = raws[0]
    if src.transposed:  # [.., in, out] floats -> [.., out, in]
        t = raw.view(FLOAT_QTYPES[qtype]).transpose(-1, -2).contiguous()
        raw, shape = t.view(torch.uint8), (*shape[:-2], shape[-1], shape[-2])
    if src.chunk is not None:
        raw, shape = _chunk(raw, qtype, shape, src)
    if src.permute_heads:
        raw = _permute_rows(raw, src.permute_heads)
    if src.kv_b is not None:
        return _kv_b_part(QTensor(raw.contiguous(), qtype, tuple(shape)), *src.kv_b)
    if src.reshape is not None:
        raw, shape = raw.reshape(*src.reshape[:-1], raw.shape[-1] * src.reshape[-1] // shape[-1]), src.reshape
    if src.rows is not None:  # whole rows: any qtype
        flat = raw.reshape(-1, raw.shape[-1])
        raw = flat.index_select(0, torch.tensor(src.rows, dtype=torch.long))
        shape = (len(src.rows), *shape[1:])
    if src.cols is not None or src.values is not None:
        if qtype not in FLOAT_QTYPES:
            raise ValueError(f"'{rec0.name}' is {qtype.name}: its columns or values can only be changed in a float type")
        t = QTensor(raw.contiguous(), qtype, tuple(shape)).dequantize(torch.float32)
        if src.cols is not None:
            t = t.index_select(-1, torch.tensor(src.cols, dtype=torch.long))
            shape = t.shape
        if src.values is not None:
            t = VALUE_MAPS[src.values](t)
        return QTensor.from_float(t.contiguous())
    return QTensor(raw.contiguous(), qtype, tuple(shape))


def _chunk(raw: torch.Tensor, qtype, shape: tuple[int, ...], src: Source) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Part src.chunk of dimension src.dim: a half, or every other entry (src.interleaved)."""
    d = len(shape) + src.dim
    if d == len(shape) - 1:  # the last (contiguous) dimension: whole values, so float types only
        raw = raw.view(FLOAT_QTYPES[qtype])
    half = shape[d] // 2
    parts = slice(src.chunk, None, 2) if src.interleaved else slice(src.chunk * half, (src.chunk + 1) * half)
    raw = raw[(slice(None),) * d + (parts,)].contiguous()
    return raw.view(torch.uint8), (*shape[:d], half, *shape[d + 1:])


def _kv_b_part(kv_b: QTensor, part: str, heads: int, nope: int) -> QTensor:
    """MLA's kv_b [heads * (nope + v), rank] -> llama.cpp's attn_v_b [heads, v, rank] (whole rows: any qtype,
    as stored) or attn_k_b [heads, rank, nope] (transposed: float32)."""
    rows, rank = kv_b.shape
    per = rows // heads
    if part == "v":
        raw = kv_b.data.reshape(heads, per, -1)[:, nope:].contiguous()
        return QTensor(raw, kv_b.qtype, (heads, per - nope, rank))
    w = kv_b.dequantize(torch.float32).view(heads, per, rank)[:, :nope]  # [heads, nope, rank]
    return QTensor.from_float(w.transpose(1, 2).contiguous())


def source_bytes(src: Source) -> int:
    """The stored bytes a canonical tensor is made of."""
    return sum(r.nbytes for r in src.records) + (0 if src.scales is None else src.scales.nbytes)


def load_weights(mf: ModelFile, arch: Arch, copy_experts: bool = False,
                 progress: Callable[[int], None] | None = None,
                 interleave: Callable[[CName, TensorRecord], bool] | None = None,
                 arena: Arena | None = None, meanwhile: Callable[[], None] | None = None,
                 preload: Preload | None = None) -> dict[CName, QTensor]:
    """Every canonical tensor of the model as stored (quantized stays quantized).

    Dense tensors are copied into memory moerun owns. Routed experts stay views of the memory map (their
    home tier: the kernel may drop those pages and fault them back in from disk) unless copy_experts. The token
    embeddings are copied too, though a token reads one row: a row read from the map of a file cut short under a
    running server would end the process (SIGBUS), where a copy keeps serving and the experts' positioned reads
    fail their requests with an error (tests/test_faults.py).
    progress: called with each tensor's stored bytes once it is placed.
    interleave: the copied tensors to read straight into the CPU kernels' interleaved layout (see
    `interleave_on_read`): the bytes a read and a later `interleave_for_kernels` give, in one pass and no buffer
    of GGUF-layout bytes.
    arena: memory faulted in ahead (hostmem.Arena) that the copies are taken from while it has room.
    meanwhile: work for this thread (once) while the copies are read, e.g. the tokenizer's build.
    preload: the copies started before the load (weights.preload), taken where they are the ones it would read.
    """
    out = {}
    reads = {}
    done = progress or (lambda n: None)
    for cn, src in arch.sources.items():
        if src.direct and (copy_experts or tensor_class(cn.kind) != "routed_experts"):
            reads[cn] = src.records[0]
        else:
            out[cn] = materialize(mf, src)
            done(source_bytes(src))
    fused = {cn for cn, rec in reads.items() if interleave is not None and interleave(cn, rec)}
    out.update(_read_copies(mf, reads, fused, arena, done, meanwhile or (lambda: None), preload))
    return {cn: out[cn] for cn in arch.sources}


def _read_copies(mf: ModelFile, reads: dict[CName, TensorRecord], fused: set[CName], arena: Arena | None,
                 done: Callable[[int], None], meanwhile: Callable[[], None],
                 preload: Preload | None = None) -> dict[CName, QTensor]:
    """The records of `reads` copied into memory moerun owns, those of `fused` straight into the interleaved layout:
    the preload's reads where it started them, the others in file order, on a few threads in one C call each
    (kernels/reads.py: the GIL stays free for the tokenizer's build beside the load), or in Python where the kernels
    are not built."""
    from moerun.kernels import cpu

    if not cpu.available():
        if fused:
            raise RuntimeError("reading into the interleaved layout needs the CPU kernels")
        return _read_in_python(mf, reads, arena, done, meanwhile)
    from moerun.kernels.reads import Read, read_all

    out, claimed, rest = {}, {}, []
    for cn in sorted(reads, key=lambda cn: (str(reads[cn].file), reads[cn].offset)):
        rec, layout = reads[cn], reads[cn].qtype if cn in fused else None
        hit = None if preload is None else preload.claim(rec, layout)
        if hit is None:
            rest.append(cn)
            continue
        claimed[hit[0]] = cn
        out[cn] = QTensor.from_bytes(hit[1], rec.qtype, rec.shape, 1 if layout is None else 8)
    results = {}
    if preload is not None:
        def placed(i: int, rc: int) -> None:
            if i in claimed:  # (the preload's other jobs are the tensors this load does not copy)
                done(reads[claimed[i]].nbytes)

        got = preload.finish(placed, meanwhile)
        results = {cn: got[i] for i, cn in claimed.items()}
        meanwhile = None
    with ExitStack() as files:
        fds, jobs = {}, []
        for cn in rest:
            rec = reads[cn]
            if rec.file not in fds:
                fds[rec.file] = _open(files, rec.file)
            dst, layout = host_empty(rec.nbytes, arena), rec.qtype if cn in fused else None
            out[cn] = QTensor.from_bytes(dst, rec.qtype, rec.shape, 1 if layout is None else 8)  # same bytes, new order
            jobs.append(Read(fds[rec.file], rec.offset, dst, layout, rec.shape))
        if jobs or meanwhile is not None:
            got = read_all(jobs, read_threads(), lambda i, rc: done(reads[rest[i]].nbytes), meanwhile)
            results.update(zip(rest, got))
    for cn, rc in results.items():
        rec = reads[cn]
        if rc <= -1000:
            raise ModelFormatError(rec.file, f"cannot read tensor '{rec.name}': {os.strerror(-1000 - rc)}")
        if rc < 0:  # the repack's own error: a layout or shape this build of the extension does not take
            raise ModelFormatError(rec.file, f"cannot interleave tensor '{rec.name}' ({rec.qtype.name}"
                                             f"{tuple(rec.shape)}): the kernel extension does not take it (error "
                                             f"{rc}); rebuild it with `pip install -e .` if moerun was updated since")
        if rc != rec.nbytes:
            raise ModelFormatError(rec.file, f"truncated: tensor '{rec.name}' needs bytes "
                                             f"{rec.offset}..{rec.offset + rec.nbytes} (changed on disk?)")
    return out


def _read_in_python(mf: ModelFile, reads: dict[CName, TensorRecord], arena: Arena | None,
                    done: Callable[[int], None], meanwhile: Callable[[], None]) -> dict[CName, QTensor]:
    def read(rec: TensorRecord) -> QTensor:
        t = QTensor.from_bytes(mf.read(rec, arena), rec.qtype, rec.shape)
        done(rec.nbytes)
        return t

    with ThreadPoolExecutor(max_workers=read_threads()) as pool:
        tensors = pool.map(read, reads.values())
        meanwhile()
        return dict(zip(reads, tensors))


def _open(files: ExitStack, path) -> int:
    try:
        return files.enter_context(open(path, "rb", buffering=0)).fileno()
    except OSError as e:
        raise ModelFormatError(path, f"cannot open: {e.strerror or e}") from None


def interleave_for_kernels(weights: dict[CName, QTensor], experts: bool,
                           keep: Callable[[CName], bool] | None = None,
                           progress: Callable[[int], None] | None = None) -> int:
    """Rewrite, in `weights`, every matrix the CPU kernels multiply and can read faster interleaved (Q4_K,
    rows a multiple of 8) into that layout -> bytes rewritten. One tensor at a time, each original dropped as
    its copy replaces it, so memory grows by one tensor at most. Never GGUF_LAYOUT_ONLY's (read by row); routed experts only with `experts` (when they are memory moerun owns, not views of a file map: a
    copy would read the whole file into RAM). keep: only the tensors it accepts (e.g. what stays on the CPU
    when other stages run on a device, whose kernels read the file's layout). progress: called with each
    rewritten tensor's bytes."""
    todo = interleavable(weights, experts, keep)
    if not todo:
        return 0
    from moerun.kernels import cpu

    done = 0
    for cn in todo:
        t = weights[cn]
        weights[cn] = None  # drop the dict's reference first: t is the last one
        weights[cn] = cpu.interleave(t)
        done += t.nbytes
        if progress is not None:
            progress(t.nbytes)
        del t
    return done


def interleave_on_read(experts: bool, keep: Callable[[CName], bool] | None = None
                       ) -> Callable[[CName, TensorRecord], bool] | None:
    """load_weights' `interleave`: the records interleave_for_kernels(weights, experts, keep) would rewrite once read
    (None without the CPU kernels)."""
    try:
        from moerun.kernels import cpu
    except ImportError:
        return None
    if not cpu.available():
        return None

    isa = cpu.features()["isa"]

    def take(cn: CName, rec: TensorRecord) -> bool:
        return (read_layout(cn.kind, rec.qtype, rec.shape, isa) is not None and (keep is None or keep(cn))
                and (experts or tensor_class(cn.kind) != "routed_experts"))
    return take


def interleavable(weights: dict[CName, QTensor], experts: bool,
                  keep: Callable[[CName], bool] | None = None) -> list[CName]:
    """The tensors interleave_for_kernels rewrites ([] without the CPU kernels)."""
    try:
        from moerun.kernels import cpu
    except ImportError:  # a tree without the kernels module
        return []
    if not cpu.available():
        return []
    return [cn for cn, t in weights.items()
            if cn.kind not in GGUF_LAYOUT_ONLY and cpu.can_interleave(t) and (keep is None or keep(cn))
            and (experts or tensor_class(cn.kind) != "routed_experts")]
