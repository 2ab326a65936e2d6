"""Streaming GGUF writer (around gguf.GGUFWriter) and llama.cpp-style quantization type selection.

    tensors = [TensorOut("blk.0.attn_q.weight", QType.Q8_0, (512, 64), produce), ...]
    write_gguf("model.gguf", metadata, tensors)

All tensor infos are declared first (name, type, shape, byte size), then the header, key/values and
tensor infos are written, then each tensor's bytes are written as its `produce()` yields them, so
only one chunk (one tensor, or one expert of a stacked tensor) is in memory at a time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from moerun.formats.names import CName
from moerun.quant.qtypes import QType, block_size, tensor_bytes
from moerun.tools.outputs import atomic_file, progress_bar

__all__ = ["FTYPES", "TensorOut", "file_type", "gguf_shape", "qtype_for", "use_more_bits", "write_gguf"]

# ftype name -> (llama.cpp LLAMA_FTYPE for general.file_type, base qtype of 2-D/3-D weights).
# "Q4_K" (Q4_K everywhere) has no llama.cpp ftype of its own; Q4_K_S (14) is the nearest.
FTYPES: dict[str, tuple[int, QType]] = {
    "F32": (gguf.LlamaFileType.ALL_F32, QType.F32),
    "F16": (gguf.LlamaFileType.MOSTLY_F16, QType.F16),
    "BF16": (gguf.LlamaFileType.MOSTLY_BF16, QType.BF16),
    "Q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, QType.Q8_0),
    "Q4_0": (gguf.LlamaFileType.MOSTLY_Q4_0, QType.Q4_0),
    "Q4_K": (gguf.LlamaFileType.MOSTLY_Q4_K_S, QType.Q4_K),
    "Q6_K": (gguf.LlamaFileType.MOSTLY_Q6_K, QType.Q6_K),
    "Q4_K_M": (gguf.LlamaFileType.MOSTLY_Q4_K_M, QType.Q4_K),
    "MXFP4_MOE": (gguf.LlamaFileType.MOSTLY_MXFP4_MOE, QType.Q8_0),  # routed experts MXFP4 (llama.cpp's mix)
}

# Fallbacks when a row is not a whole number of blocks. llama.cpp uses Q5_0 for Q4_K; moerun does not
# quantize Q5_0, so Q4_K falls back to Q8_0 (bigger, never less precise). Q6_K -> Q8_0 as in llama.cpp.
_FALLBACK = {QType.Q4_K: QType.Q8_0, QType.Q6_K: QType.Q8_0, QType.Q4_0: QType.F16, QType.Q8_0: QType.F16,
             QType.MXFP4: QType.Q8_0}


def file_type(ftype: str) -> int:
    """llama.cpp's LLAMA_FTYPE number (general.file_type) for an ftype name."""
    return int(_ftype(ftype)[0])


def _ftype(ftype: str) -> tuple[int, QType]:
    try:
        return FTYPES[ftype.upper()]
    except KeyError:
        raise ValueError(f"unknown ftype '{ftype}' (known: {', '.join(FTYPES)})") from None


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits in the *_M mixes (integer arithmetic, as in C)."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def qtype_for(cn: CName, shape: Sequence[int], ftype: str, *, n_layers: int = 0,
              tied_embeddings: bool = False) -> QType:
    """The GGUF type a canonical tensor gets in a file of `ftype` (llama.cpp's rules, simplified).

    1-D tensors, biases, norms, routers (ffn_gate_inp*) and linear attention's conv1d (ssm_conv1d: rows of the
    kernel's width; ssm_a and ssm_dt are 1-D) stay F32. Other weights get the ftype's type (the linear layers'
    attn_qkv, attn_gate, ssm_ba / ssm_beta / ssm_alpha and ssm_out too, as llama-quantize does).
    MXFP4_MOE: the routed experts' matrices MXFP4, everything else Q8_0 (as llama-quantize's MXFP4_MOE).
    Q4_K_M: Q4_K, except Q6_K for output.weight (token_embd.weight when the embeddings are tied)
    and for attn_v / attn_qkv / ffn_down / ffn_down_exps / ffn_down_shexp on the layers `use_more_bits(i,
    n_layers)` selects (so Q4_K_M needs `n_layers`; llama.cpp counts attn_v and attn_qkv together, one per layer in
    the hybrids). llama.cpp's extra rules for 8-expert models (attn_v Q8_0, attn_output Q5_K) are not applied.
    Rows that are not a whole number of blocks fall back: Q4_K and Q6_K -> Q8_0 (llama.cpp: Q4_K -> Q5_0, which
    moerun does not quantize), Q8_0/Q4_0 -> F16.
    """
    _, base = _ftype(ftype)
    if (len(shape) < 2 or cn.kind.startswith("ffn_gate_inp") or "norm" in cn.kind or shape[0] == 1
            or cn.kind.endswith(".bias") or cn.kind == "ssm_conv1d.weight"):
        return QType.F32
    qtype = base
    if ftype.upper() == "MXFP4_MOE" and cn.kind.endswith("_exps.weight"):
        qtype = QType.MXFP4
    if ftype.upper() == "Q4_K_M":
        head = cn.kind == "output.weight" or (tied_embeddings and cn.kind == "token_embd.weight")
        more = cn.kind in ("attn_v.weight", "attn_qkv.weight") or cn.kind.startswith("ffn_down")
        if more and cn.layer is not None and n_layers <= 0:
            raise ValueError("qtype_for: Q4_K_M needs n_layers")
        if head or (more and cn.layer is not None and use_more_bits(cn.layer, n_layers)):
            qtype = QType.Q6_K
    while shape[-1] % block_size(qtype)[0]:
        qtype = _FALLBACK[qtype]
    return qtype


def gguf_shape(cn: CName, shape: Sequence[int]) -> tuple[int, ...]:
    """The torch shape a canonical tensor is stored with in GGUF ([1, H] gates are stored 1-D)."""
    shape = tuple(int(s) for s in shape)
    return shape[1:] if len(shape) == 2 and shape[0] == 1 else shape


@dataclass(frozen=True)
class TensorOut:
    """One tensor to write: name in the file, type, torch shape, and a producer of its bytes.

    `produce()` yields uint8 tensors (or numpy arrays) whose concatenation is the tensor's raw data,
    in order (e.g. one per expert of a stacked tensor). produce=None leaves the bytes unwritten: a hole of
    zeros in a sparse file, for files that only need their shapes and sizes (`make-model --shape-only`).
    """

    name: str
    qtype: QType
    shape: tuple[int, ...]
    produce: Callable[[], Iterable[torch.Tensor | np.ndarray]] | None

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.qtype, self.shape)


def _add_kv(w: gguf.GGUFWriter, key: str, value: Any) -> None:
    """Add one key with llama.cpp's usual types: ints as u32 (i32 if negative, u64 if big), floats as f32."""
    T = gguf.GGUFValueType
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_key_value(key, value, T.INT32 if value < 0 else T.UINT32 if value < 2**32 else T.UINT64)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        if not value:
            return
        if all(isinstance(v, str) for v in value):
            w.add_key_value(key, list(value), T.ARRAY, sub_type=T.STRING)
        elif all(isinstance(v, bool) for v in value):
            w.add_key_value(key, list(value), T.ARRAY, sub_type=T.BOOL)
        elif all(isinstance(v, int) for v in value):
            w.add_key_value(key, [int(v) for v in value], T.ARRAY, sub_type=T.INT32)
        else:
            w.add_key_value(key, [float(v) for v in value], T.ARRAY, sub_type=T.FLOAT32)
    else:
        raise TypeError(f"cannot write metadata key '{key}' of type {type(value).__name__}")


def _as_bytes(chunk: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(chunk, torch.Tensor):
        if chunk.dtype != torch.uint8:
            raise TypeError(f"tensor chunks must be uint8 bytes, got {chunk.dtype}")
        return chunk.contiguous().numpy()
    return np.ascontiguousarray(chunk).view(np.uint8)


def _pad(f, n: int, align: int) -> None:
    f.write(b"\0" * (-n % align))


def write_gguf(path: str | Path, metadata: dict[str, Any], tensors: Sequence[TensorOut], *,
               overwrite: bool = False, progress: bool = True) -> Path:
    """Write a GGUF v3 file: `metadata` (must hold general.architecture) and `tensors`, streamed.

    Writes to a temporary file in the target folder, renamed at the end; refuses to replace an
    existing file unless overwrite=True. Returns the path written.
    """
    path = Path(path)
    arch = metadata.get("general.architecture")
    if not arch or not isinstance(arch, str):
        raise ValueError("metadata must hold 'general.architecture' (a string)")
    w = gguf.GGUFWriter(None, arch)
    for key, value in metadata.items():
        if key != "general.architecture":  # GGUFWriter adds it itself
            _add_kv(w, key, value)
    for t in tensors:
        elems, nbytes = block_size(t.qtype)
        byte_shape = (*t.shape[:-1], t.shape[-1] // elems * nbytes)
        w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes, raw_dtype=t.qtype)
    align = w.data_alignment
    with atomic_file(path, overwrite) as tmp:
        try:
            w.write_header_to_file(tmp)
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            f = w.fout[0]
            _pad(f, f.tell(), align)
            with progress_bar(sum(t.nbytes for t in tensors), path.name, progress) as bar:
                for t in tensors:
                    written = 0
                    if t.produce is None:
                        f.seek(t.nbytes, os.SEEK_CUR)
                        written = t.nbytes
                    for chunk in t.produce() if t.produce is not None else ():
                        data = _as_bytes(chunk)
                        data.tofile(f)
                        written += data.nbytes
                        bar.update(data.nbytes)
                    if written != t.nbytes:
                        raise RuntimeError(f"tensor '{t.name}': produced {written} bytes, expected {t.nbytes}")
                    _pad(f, written, align)
            f.truncate()  # a hole at the end still counts in the file's size
            f.flush()
            os.fsync(f.fileno())
        finally:
            w.close()
    return path
