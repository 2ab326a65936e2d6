"""Model files -> TensorRecords + metadata. `open_model` picks the reader from what the path is."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from moerun.errors import ModelFormatError
from moerun.formats.gguf import GGUF_MAGIC, read_gguf
from moerun.formats.records import ModelFile, TensorRecord
from moerun.formats.safetensors import read_hf

__all__ = ["ModelFile", "TensorRecord", "open_model", "read_gguf", "read_hf"]


def _first_bytes(path: Path, n: int) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError as e:
        raise ModelFormatError(path, f"cannot read file: {e.strerror or e}") from None


def open_model(path: str | Path) -> ModelFile:
    """Open a GGUF file, a Hugging Face model folder, or a .safetensors file inside such a folder."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ModelFormatError(path, "no such file or directory") from None
    except OSError as e:
        raise ModelFormatError(path, f"cannot access: {e.strerror or e}") from None
    if stat.S_ISDIR(mode):
        return read_hf(path)
    if not stat.S_ISREG(mode):
        raise ModelFormatError(path, "not a regular file")
    head = _first_bytes(path, 4)
    if head == GGUF_MAGIC:
        return read_gguf(path)
    if path.suffix == ".safetensors":
        return read_hf(path)
    if not head:
        raise ModelFormatError(path, "empty file (not a GGUF file or a Hugging Face model folder)")
    raise ModelFormatError(path, "not a GGUF file or a Hugging Face model folder")
