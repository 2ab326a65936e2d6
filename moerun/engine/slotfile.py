"""A slot's cache in a file (llama-server's /slots/{id}?action=save|restore): its tokens, every layer's keys and
values at their positions and, for linear-attention layers, the recurrent state; safetensors, with what the
cache belongs to in its metadata so that a file from another model is refused.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch

from moerun.engine.engine import Sequence
from moerun.errors import MoerunError

FORMAT = "moerun-slot-1"


class SlotFileError(MoerunError):
    """A slot file that cannot be written or read back into this model's cache."""


def fingerprint(pool) -> str:
    """What a saved cache belongs to: the model's layers, their layouts and the cache's type."""
    parts = [repr((a, b, tuple(k.shape[2:]), tuple(v.shape[2:]), str(k.dtype))) for a, b, k, v in pool.segments]
    parts += [repr((i, tuple(c.shape[1:]), tuple(s.shape[1:]))) for i, (c, s) in sorted(pool.states.items())]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def save(seq: Sequence, path: Path) -> tuple[int, int]:
    """The sequence's cache into `path` (replaced whole, never half-written) -> (positions, bytes written)."""
    from safetensors.torch import save_file

    kv, pool = seq.kv, seq.kv.pool
    if pool.ring:
        raise SlotFileError("saving a slot of a model with sliding-window layers is not supported yet")
    n = kv.length
    tensors = {"tokens": torch.tensor(seq.tokens[:n], dtype=torch.int64)}
    slots = kv.slot_table[:n]
    for a, b, k, v in pool.segments:
        tensors[f"k.{a}-{b}"] = k[:, slots.to(k.device)].cpu().contiguous()
        tensors[f"v.{a}-{b}"] = v[:, slots.to(v.device)].cpu().contiguous()
    if n and pool.states:
        for i, (conv, ssm) in pool.states.items():
            tensors[f"conv.{i}"] = conv[kv.state_slot].cpu().contiguous()
            tensors[f"ssm.{i}"] = ssm[kv.state_slot].cpu().contiguous()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": FORMAT, "cache": fingerprint(pool), "n_tokens": str(n)})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return n, path.stat().st_size


def restore(seq: Sequence, path: Path, max_len: int) -> tuple[int, int]:
    """The cache saved in `path` into the (idle) sequence, whatever it held -> (positions, bytes read)."""
    from safetensors import SafetensorError, safe_open

    kv, pool = seq.kv, seq.kv.pool
    if pool.ring:
        raise SlotFileError("restoring a slot of a model with sliding-window layers is not supported yet")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise SlotFileError(f"{path.name} is not a moerun slot file")
            if meta.get("cache") != fingerprint(pool):
                raise SlotFileError(f"{path.name} holds the cache of another model (or another --dtype)")
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except SafetensorError as e:
        raise SlotFileError(f"{path.name} is not a readable slot file: {e}") from None
    tokens = tensors.pop("tokens").tolist()
    n = len(tokens)
    if n > max_len:
        raise SlotFileError(f"{path.name} holds {n} positions, more than the context size {max_len}")
    seq.free()
    if n:
        kv.reserve(n)
    slots = kv.slot_table[:n]
    try:
        for a, b, k, v in pool.segments:
            for name, dst in ((f"k.{a}-{b}", k), (f"v.{a}-{b}", v)):
                src = tensors[name]
                if src.shape != (dst.shape[0], n, *dst.shape[2:]):
                    raise SlotFileError(f"{path.name}: {name} has shape {list(src.shape)}")
                dst.index_copy_(1, slots.to(dst.device), src.to(dst.device, dst.dtype))
        if n and pool.states:
            for i, (conv, ssm) in pool.states.items():
                conv[kv.state_slot] = tensors[f"conv.{i}"].to(conv.device)
                ssm[kv.state_slot] = tensors[f"ssm.{i}"].to(ssm.device)
    except KeyError as e:
        seq.free()
        raise SlotFileError(f"{path.name} lacks {e.args[0]}") from None
    except SlotFileError:
        seq.free()
        raise
    kv.length, seq.tokens = n, tokens
    seq.publish()
    return n, path.stat().st_size
