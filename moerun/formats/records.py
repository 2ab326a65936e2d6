"""What every reader produces: tensor records (where the bytes are) plus metadata."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moerun.errors import ModelFormatError
from moerun.quant.ggml_types import QType

if TYPE_CHECKING:  # torch is imported where bytes are handed out, so metadata-only tools start fast
    import torch

    from moerun.hostmem import Arena
    from moerun.quant.qtypes import QTensor


@dataclass(frozen=True)
class TensorRecord:
    """One stored tensor: its file name, type, torch shape and byte range (absolute offset in `file`)."""

    name: str
    qtype: QType
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int


@dataclass
class ModelFile:
    """An opened checkpoint: records by stored name, metadata, and zero-copy access to the bytes.

    `format` is "gguf" or "safetensors". `metadata` holds the GGUF key/values (str -> python value),
    or for a Hugging Face folder the parsed config.json under "config" and the folder under "dir".
    `_maps` holds one copy-on-write memory map per file (writing to a view never changes the file);
    `raw()` returns views into it, never copies.
    """

    path: Path
    format: str
    metadata: dict[str, Any]
    records: dict[str, TensorRecord]
    _maps: dict[Path, Any] = field(default_factory=dict, repr=False)

    def raw(self, rec: TensorRecord | str) -> torch.Tensor:
        """The record's bytes as a uint8 tensor viewing the memory map."""
        import torch

        if isinstance(rec, str):
            rec = self.records[rec]
        buf = self._maps[rec.file]
        return torch.frombuffer(buf, dtype=torch.uint8, count=rec.nbytes, offset=rec.offset) if rec.nbytes else \
            torch.empty(0, dtype=torch.uint8)

    def read(self, rec: TensorRecord | str, arena: Arena | None = None) -> torch.Tensor:
        """A copy of the record's bytes in memory moerun owns (from `arena` while it has room), read with positioned
        reads (the map's pages are not touched, so they never count in the process's resident set)."""

        if isinstance(rec, str):
            rec = self.records[rec]
        from moerun.hostmem import host_empty

        out = host_empty(rec.nbytes, arena)
        view, done = memoryview(out.numpy()), 0
        try:
            with open(rec.file, "rb", buffering=0) as f:
                while done < rec.nbytes:
                    n = os.preadv(f.fileno(), [view[done:]], rec.offset + done)
                    if n == 0:
                        raise ModelFormatError(rec.file, f"truncated: tensor '{rec.name}' needs bytes "
                                                         f"{rec.offset}..{rec.offset + rec.nbytes} (changed on disk?)")
                    done += n
        except OSError as e:
            raise ModelFormatError(rec.file, f"cannot read tensor '{rec.name}': {e.strerror or e}") from None
        return out

    def qtensor(self, rec: TensorRecord | str) -> QTensor:
        from moerun.quant.qtypes import QTensor

        if isinstance(rec, str):
            rec = self.records[rec]
        return QTensor.from_bytes(self.raw(rec), rec.qtype, rec.shape)

    def close(self) -> None:
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:
                pass  # tensors still view the map; it is unmapped when the last of them goes
        self._maps.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
