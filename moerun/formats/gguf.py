"""GGUF reader: strict header parsing over a copy-on-write memory map, tensor bytes left in place.

Our own parser (not gguf.GGUFReader) so that every malformed or hostile header ends in one clear
ModelFormatError line, and so that counts read from the file are checked against the bytes the file
could possibly hold before anything is allocated.
"""

from __future__ import annotations

import itertools
import mmap
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np

from moerun.errors import ModelFormatError
from moerun.formats.records import ModelFile, TensorRecord
from moerun.quant.ggml_types import SUPPORTED, QType, block_size, tensor_bytes

__all__ = ["GGUF_MAGIC", "read_gguf"]

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_ARRAY_NESTING = 8
MAX_NUMEL = 2**62

# value type -> (struct format, byte size) for fixed-size scalars; 7 is BOOL, 8 STRING, 9 ARRAY.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 10: "<Q", 11: "<q", 12: "<d"}
_BOOL, _STRING, _ARRAY = 7, 8, 9
_MIN_VALUE_BYTES = {**{t: struct.calcsize(f) for t, f in _SCALARS.items()}, _BOOL: 1, _STRING: 8, _ARRAY: 12}
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dimension, type, offset


def _q(name: str) -> str:
    """A name quoted for a one-line message: escapes control characters, shortens long names."""
    return repr(name if len(name) <= 120 else name[:120] + "...")


class _Bad(Exception):
    """Internal: a problem found while parsing; read_gguf turns it into ModelFormatError."""


class _Cursor:
    """Bounds-checked little-endian reads from a buffer."""

    def __init__(self, buf: Any, size: int, strings: bool = True):
        self.buf, self.size, self.pos = buf, size, 0
        self.strings = strings  # False: arrays of strings are stepped over, not decoded (nor kept)

    @property
    def left(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.left:
            raise _Bad(f"truncated header: {what} needs {n} bytes at offset {self.pos} but the file has {self.size}")
        data = self.buf[self.pos:self.pos + n]
        self.pos += n
        return data

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def u32(self, what: str) -> int:
        return self.scalar("<I", what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", what)

    def count(self, what: str, min_item_bytes: int) -> int:
        """A u64 count of items that each take at least min_item_bytes: rejected if the file can't hold them."""
        n = self.u64(what)
        if n * min_item_bytes > self.left:
            raise _Bad(f"truncated header or corrupt {what}: {n} needs at least {n * min_item_bytes} bytes"
                       f" but {self.left} remain")
        return n

    def string(self, what: str) -> str:
        raw = self.take(self.count(f"length of {what}", 1), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Bad(f"{what} is not valid UTF-8") from None


def _read_value(cur: _Cursor, vtype: int, what: str, depth: int = 0) -> Any:
    if vtype in _SCALARS:
        return cur.scalar(_SCALARS[vtype], what)
    if vtype == _BOOL:
        b = cur.take(1, what)[0]
        if b > 1:
            raise _Bad(f"{what}: invalid bool value {b}")
        return bool(b)
    if vtype == _STRING:
        return cur.string(what)
    if vtype == _ARRAY:
        return _read_array(cur, what, depth + 1)
    raise _Bad(f"{what}: unknown value type {vtype}")


def _read_array(cur: _Cursor, what: str, depth: int) -> list | None:
    if depth > MAX_ARRAY_NESTING:
        raise _Bad(f"{what}: arrays nested more than {MAX_ARRAY_NESTING} deep")
    itype = cur.u32(f"{what} element type")
    if itype not in _MIN_VALUE_BYTES:
        raise _Bad(f"{what}: unknown array element type {itype}")
    n = cur.count(f"{what} array length", _MIN_VALUE_BYTES[itype])
    if itype in _SCALARS:  # fixed-size numbers: one bulk read
        fmt = _SCALARS[itype]
        return np.frombuffer(cur.take(n * _MIN_VALUE_BYTES[itype], what), dtype=np.dtype(fmt)).tolist()
    if itype == _STRING:
        return _read_strings(cur, n, what) if cur.strings else _skip_strings(cur, n, what)
    items = [_read_value(cur, itype, f"{what}[{i}]", depth) for i in range(n)]
    return None if not cur.strings and any(v is None for v in items) else items  # arrays of string arrays left out


def _read_strings(cur: _Cursor, n: int, what: str) -> list[str]:
    """n strings (a tokenizer vocabulary): a lean loop, re-read item by item only to word an error."""
    buf, pos, out = cur.buf, cur.pos, []
    try:
        for _ in range(n):
            (length,) = struct.unpack_from("<Q", buf, pos)
            end = pos + 8 + length
            if end > cur.size:
                raise IndexError
            out.append(buf[pos + 8:end].decode("utf-8"))
            pos = end
    except (struct.error, IndexError, UnicodeDecodeError):
        return [cur.string(f"{what}[{i}]") for i in range(n)]
    cur.pos = pos
    return out


def _skip_strings(cur: _Cursor, n: int, what: str) -> None:
    """Steps over n strings (bounds checked, not decoded): a tenth of _read_strings' time on a vocabulary."""
    buf, pos, unpack = cur.buf, cur.pos, struct.unpack_from
    try:
        for _ in range(n):
            pos += 8 + unpack("<Q", buf, pos)[0]
    except struct.error:
        pos = cur.size + 1
    if pos > cur.size:
        raise _Bad(f"truncated header: {what} runs past the end of the file ({cur.size} bytes)")
    cur.pos = pos


def _read_metadata(cur: _Cursor, n_kv: int) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    seen: set[str] = set()
    for i in range(n_kv):
        key = cur.string(f"key #{i}")
        if key in seen:
            raise _Bad(f"duplicate key {_q(key)}")
        seen.add(key)
        vtype = cur.u32(f"value type of key {_q(key)}")
        value = _read_value(cur, vtype, f"key {_q(key)}")
        if value is not None:
            meta[key] = value
    return meta


def _qtype(name: str, type_id: int) -> QType:
    try:
        qtype = QType(type_id)
    except ValueError:
        raise _Bad(f"unknown quantization type {type_id} for tensor {_q(name)}") from None
    if qtype not in SUPPORTED:
        raise _Bad(f"unsupported quantization type {qtype.name} for tensor {_q(name)}")
    return qtype


def _read_tensor_info(cur: _Cursor, i: int) -> tuple[str, QType, tuple[int, ...], int]:
    """(name, qtype, torch shape, offset relative to the data section) of the next tensor info."""
    name = cur.string(f"name of tensor #{i}")
    n_dims = cur.u32(f"n_dims of tensor {_q(name)}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise _Bad(f"tensor {_q(name)} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
    ne = [cur.u64(f"dimensions of tensor {_q(name)}") for _ in range(n_dims)]
    numel = 1
    for d in ne:
        numel *= d
    if min(ne) < 1 or numel > MAX_NUMEL:
        raise _Bad(f"tensor {_q(name)} has an invalid shape {ne} (ggml order)")
    qtype = _qtype(name, cur.u32(f"type of tensor {_q(name)}"))
    elems = block_size(qtype)[0]
    if ne[0] % elems:
        raise _Bad(f"tensor {_q(name)} has rows of {ne[0]} elements, not a multiple of {qtype.name}'s block of {elems}")
    offset = cur.u64(f"offset of tensor {_q(name)}")
    return name, qtype, tuple(reversed(ne)), offset


def _alignment(meta: dict[str, Any]) -> int:
    align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(align) is not int or align < 1 or align & (align - 1):
        raise _Bad(f"general.alignment must be a positive power of two, got {align!r}")
    return align


def _check_extents(records: list[TensorRecord], size: int) -> None:
    for rec in records:
        end = rec.offset + rec.nbytes
        if end > size:
            raise _Bad(f"truncated: tensor {_q(rec.name)} needs bytes {rec.offset}..{end} but the file has {size}")
    ordered = sorted(records, key=lambda r: r.offset)
    for a, b in itertools.pairwise(ordered):
        if b.offset < a.offset + a.nbytes:
            raise _Bad(f"tensors {_q(a.name)} and {_q(b.name)} overlap")


def _check_preamble(cur: _Cursor) -> None:
    if cur.size < 4 or cur.take(4, "magic") != GGUF_MAGIC:
        raise _Bad("not a GGUF file (bad magic)")
    version = cur.u32("version")
    if version not in (2, 3):
        if struct.unpack(">I", struct.pack("<I", version))[0] in (1, 2, 3):
            raise _Bad("big-endian GGUF files are not supported")
        raise _Bad(f"unsupported GGUF version {version}")


def _parse(buf: Any, size: int, path: Path, strings: bool = True) -> tuple[dict[str, Any], list[TensorRecord]]:
    cur = _Cursor(buf, size, strings)
    _check_preamble(cur)
    n_tensors = cur.count("tensor count", _MIN_TENSOR_INFO_BYTES)
    n_kv = cur.count("key/value count", _MIN_KV_BYTES)
    if n_tensors * _MIN_TENSOR_INFO_BYTES + n_kv * _MIN_KV_BYTES > cur.left:
        raise _Bad(f"truncated header: {n_tensors} tensor infos and {n_kv} keys cannot fit in {cur.left} bytes")
    meta = _read_metadata(cur, n_kv)
    infos = [_read_tensor_info(cur, i) for i in range(n_tensors)]
    align = _alignment(meta)
    data_start = -(-cur.pos // align) * align
    records: dict[str, TensorRecord] = {}
    for name, qtype, shape, offset in infos:
        if name in records:
            raise _Bad(f"duplicate tensor name {_q(name)}")
        if offset % align:
            raise _Bad(f"tensor {_q(name)} has offset {offset}, not aligned to {align}")
        records[name] = TensorRecord(name, qtype, shape, path, data_start + offset, tensor_bytes(qtype, shape))
    _check_extents(list(records.values()), size)
    return meta, list(records.values())


def _map(path: Path) -> tuple[mmap.mmap | bytes, int]:
    """A copy-on-write map of the file (or its bytes when empty, which mmap refuses) and its size."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size == 0:
            return b"", 0
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), size


def _read_one(path: Path, strings: bool = True) -> tuple[dict[str, Any], list[TensorRecord], Any]:
    """One GGUF file's metadata (strings: with its arrays of strings), tensor records and map."""
    try:
        buf, size = _map(path)
    except OSError as e:
        raise ModelFormatError(path, f"cannot read file: {e.strerror or e}") from None
    try:
        meta, records = _parse(buf, size, path, strings)
    except _Bad as e:
        _close(buf)
        raise ModelFormatError(path, str(e)) from None
    except (struct.error, ValueError, IndexError, OverflowError, MemoryError, RecursionError) as e:
        _close(buf)
        raise ModelFormatError(path, f"corrupt header ({type(e).__name__}: {e})".replace("\n", " ")) from None
    return meta, records, buf


SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")  # llama.cpp's gguf-split


def split_parts(path: Path, meta: dict[str, Any]) -> list[Path]:
    """The files of a model split by llama.cpp's gguf-split (split.count parts, named NAME-0000i-of-0000n.gguf
    beside the first), or [path] for a whole file. Opening a later part names the first."""
    count = meta.get("split.count", 1)
    if type(count) is not int or count <= 1:
        return [path]
    m = SPLIT_NAME.match(path.name)
    if m is None or int(m["count"]) != count:
        raise ModelFormatError(path, f"part of a model split in {count} files, but not named NAME-00001-of-"
                                     f"{count:05d}.gguf as gguf-split names them")
    if meta.get("split.no", 0) != 0:
        first = path.with_name(f"{m['stem']}-00001-of-{count:05d}.gguf")
        raise ModelFormatError(path, f"part {meta.get('split.no', 0) + 1} of {count}: open the first part, {first}")
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def read_gguf(path: str | Path, strings: bool = True) -> ModelFile:
    """Open a GGUF v2/v3 file: metadata dict and one TensorRecord per tensor, bytes left in the map. A split
    model's first part opens every part (their tensors, one map each; the metadata is the first part's).
    strings=False leaves the metadata's arrays of strings out (the vocabulary and merges: 0.1-0.27 s of a 150k-250k
    vocabulary's header), for a reader that needs only the tensors (weights.preload); every check still runs."""
    path = Path(path)
    meta, records, buf = _read_one(path, strings)
    maps = {path: buf}
    try:
        for part in split_parts(path, meta)[1:]:
            if not part.is_file():
                raise ModelFormatError(part, f"missing: part of the split model {path.name} (llama-gguf-split "
                                             f"--merge makes one file of the parts)")
            _, more, maps[part] = _read_one(part, strings)
            seen = {r.name for r in records}
            clash = next((r.name for r in more if r.name in seen), None)
            if clash is not None:
                raise ModelFormatError(part, f"tensor {_q(clash)} is also in an earlier part")
            records += more
    except ModelFormatError:
        for b in maps.values():
            _close(b)
        raise
    return ModelFile(path, "gguf", meta, {r.name: r for r in records}, maps)


def _close(buf: Any) -> None:
    close = getattr(buf, "close", None)
    if close is not None:
        close()
