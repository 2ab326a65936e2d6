"""Hugging Face folder reader: config.json plus safetensors shards, headers parsed and checked strictly.

Each shard is memory-mapped copy-on-write; records point into the maps, nothing is copied.
"""

from __future__ import annotations

import itertools
import json
import mmap
import struct
from pathlib import Path
from typing import Any

from moerun.errors import ModelFormatError
from moerun.formats.records import ModelFile, TensorRecord
from moerun.quant.ggml_types import QType, tensor_bytes

__all__ = ["CONFIG_NAME", "INDEX_NAME", "WEIGHTS_NAME", "read_hf"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit

# U8: raw bytes, read as ggml's I8 (one byte per element); only MXFP4 blocks and scales may be used that way
# (arch.tensors.check_sources says so for any other)
_DTYPES = {"F32": QType.F32, "F16": QType.F16, "BF16": QType.BF16, "U8": QType.I8}
_OTHER_DTYPES = frozenset({"BOOL", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F64", "F8_E4M3",
                           "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C64"})


def _q(name: str) -> str:
    """A name quoted for a one-line message: escapes control characters, shortens long names."""
    return repr(name if len(name) <= 120 else name[:120] + "...")


class _Bad(Exception):
    """Internal: a problem found while parsing one file; becomes ModelFormatError(that file, ...)."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Bad(f"duplicate JSON key {_q(k)}")
        out[k] = v
    return out


def _load_json(text: bytes | str, what: str) -> Any:
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _Bad(f"{what} is not valid JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def _is_int(x: Any) -> bool:
    return type(x) is int


def _qtype(name: str, dtype: Any) -> QType:
    if dtype is None:
        raise _Bad(f"tensor {_q(name)} has no dtype")
    if not isinstance(dtype, str):
        raise _Bad(f"tensor {_q(name)} has an invalid dtype {_q(repr(dtype))}")
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    if dtype in _OTHER_DTYPES:
        raise _Bad(f"unsupported dtype {dtype} for tensor {_q(name)} (F32, F16 and BF16 are supported, and U8 for MXFP4 blocks and scales)")
    raise _Bad(f"unknown dtype {dtype!r} for tensor {_q(name)}")


def _record(name: str, entry: Any, path: Path, data_start: int, data_len: int) -> TensorRecord:
    if not isinstance(entry, dict):
        raise _Bad(f"header entry for tensor {_q(name)} is not an object")
    qtype = _qtype(name, entry.get("dtype"))
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or len(shape) > 8 or not all(_is_int(d) and d >= 0 for d in shape):
        raise _Bad(f"tensor {_q(name)} has an invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
        raise _Bad(f"tensor {_q(name)} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise _Bad(f"truncated: tensor {_q(name)} needs data bytes {begin}..{end} but the data section has {data_len}")
    nbytes = tensor_bytes(qtype, tuple(shape))
    if end - begin != nbytes:
        raise _Bad(f"tensor {_q(name)} has {end - begin} bytes but shape {shape} of {entry['dtype']} needs {nbytes}")
    return TensorRecord(name, qtype, tuple(shape), path, data_start + begin, nbytes)


def _check_overlaps(records: list[TensorRecord]) -> None:
    ordered = sorted(records, key=lambda r: (r.offset, r.nbytes))
    for a, b in itertools.pairwise(ordered):
        if b.offset < a.offset + a.nbytes:
            raise _Bad(f"tensors {_q(a.name)} and {_q(b.name)} overlap")


def _parse_header(buf: Any, size: int, path: Path) -> list[TensorRecord]:
    if size < 8:
        raise _Bad(f"truncated header: file has {size} bytes, a safetensors file starts with 8")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > size - 8 or n > MAX_HEADER_BYTES:
        raise _Bad(f"header length {n} is larger than the file ({size} bytes) allows")
    header = _load_json(buf[8:8 + n], "header")
    if not isinstance(header, dict):
        raise _Bad("header is not a JSON object")
    data_start = 8 + n
    records = [_record(k, v, path, data_start, size - data_start) for k, v in header.items() if k != "__metadata__"]
    _check_overlaps(records)
    return records


def _open_shard(path: Path) -> tuple[mmap.mmap, list[TensorRecord]]:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 8:
                raise ModelFormatError(path, f"truncated header: file has {size} bytes, a safetensors file starts with 8")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError as e:
        raise ModelFormatError(path, f"cannot read file: {e.strerror or e}") from None
    try:
        return buf, _parse_header(buf, size, path)
    except _Bad as e:
        buf.close()
        raise ModelFormatError(path, str(e)) from None
    except (ValueError, TypeError, OverflowError, MemoryError, struct.error) as e:
        buf.close()
        raise ModelFormatError(path, f"corrupt header ({type(e).__name__})") from None


def _read_json_file(path: Path, what: str) -> Any:
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise ModelFormatError(path.parent, f"no {path.name} in the folder") from None
    except OSError as e:
        raise ModelFormatError(path, f"cannot read file: {e.strerror or e}") from None
    try:
        return _load_json(text, what)
    except _Bad as e:
        raise ModelFormatError(path, str(e)) from None


def _shard_plan(folder: Path, single: Path | None) -> tuple[list[Path], dict[str, str] | None, Path | None]:
    """(shard files, index weight_map or None, index path or None) for a folder or one given file."""
    if single is not None:
        return [single], None, None
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME], None, None
    index_path = folder / INDEX_NAME
    if not index_path.is_file():
        raise ModelFormatError(folder, f"no {WEIGHTS_NAME} or {INDEX_NAME} in the folder")
    index = _read_json_file(index_path, "index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelFormatError(index_path, "no weight_map object of tensor name -> shard file")
    for shard in set(weight_map.values()):
        if Path(shard).name != shard or shard in ("", ".", ".."):
            raise ModelFormatError(index_path, f"shard file name {_q(shard)} is not a plain file name")
    return [folder / s for s in sorted(set(weight_map.values()))], weight_map, index_path


def _collect(shards: list[Path], maps: dict[Path, Any]) -> dict[str, TensorRecord]:
    records: dict[str, TensorRecord] = {}
    for shard in shards:
        buf, recs = _open_shard(shard)
        maps[shard] = buf
        for rec in recs:
            if rec.name in records:
                raise ModelFormatError(shard, f"tensor {_q(rec.name)} is also in {records[rec.name].file.name}")
            records[rec.name] = rec
    return records


def _check_index(records: dict[str, TensorRecord], weight_map: dict[str, str], index_path: Path) -> None:
    for name, shard in weight_map.items():
        rec = records.get(name)
        if rec is None or rec.file.name != shard:
            raise ModelFormatError(index_path.parent / shard,
                                   f"tensor {_q(name)} listed in {INDEX_NAME} is missing from this shard")


def read_hf(path: str | Path) -> ModelFile:
    """Open a Hugging Face model folder (or one .safetensors file in such a folder)."""
    path = Path(path)
    folder, single = (path, None) if path.is_dir() else (path.parent, path)
    config = _read_json_file(folder / CONFIG_NAME, CONFIG_NAME)
    if not isinstance(config, dict):
        raise ModelFormatError(folder / CONFIG_NAME, "config is not a JSON object")
    shards, weight_map, index_path = _shard_plan(folder, single)
    maps: dict[Path, Any] = {}
    try:
        records = _collect(shards, maps)
        if weight_map is not None:
            _check_index(records, weight_map, index_path)
    except ModelFormatError:
        for buf in maps.values():
            buf.close()
        raise
    meta = {"config": config, "dir": str(folder)}
    return ModelFile(path, "safetensors", meta, records, maps)
