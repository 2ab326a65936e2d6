"""Readers: GGUF and Hugging Face folders -> records + metadata, zero-copy, and one clear error per defect."""

from __future__ import annotations

import json
import os
import random
import struct
import sys
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize
from safetensors.torch import save_file

import moerun
from moerun.errors import ModelFormatError
from moerun.formats import open_model, read_gguf, read_hf
from moerun.quant.qtypes import QType

# ---------------------------------------------------------------------------------------------- helpers

MOERUN_DIR = str(Path(moerun.__file__).parent)


@contextmanager
def _lines_run():
    """Counts the lines of moerun's own code run inside the block (one-item list): how much work a reader did
    on a file, counted rather than timed, so a loaded machine changes nothing. A reader that walked a count
    claimed by the file (2**60 keys, tensors or array items) before checking it runs millions of lines."""
    count = [0]

    def line(frame, event, arg):
        if event == "line":
            count[0] += 1
        return line

    def call(frame, event, arg):
        return line if frame.f_code.co_filename.startswith(MOERUN_DIR) else None

    previous = sys.gettrace()
    sys.settrace(call)
    try:
        yield count
    finally:
        sys.settrace(previous)


def _fails(fn, path, phrase: str) -> str:
    """Run fn(path); it must raise ModelFormatError whose message is one line naming the path and `phrase`."""
    with pytest.raises(ModelFormatError) as info:
        fn(path)
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert str(path) in msg, msg
    assert phrase in msg, msg
    return msg


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _kv_str(key: str, value: str) -> bytes:
    return _kv(key, 8, _s(value))


def _kv_u32(key: str, value: int) -> bytes:
    return _kv(key, 4, struct.pack("<I", value))


def _tinfo(name: str, ne: list[int], ggml_type: int = 0, offset: int = 0) -> bytes:
    dims = b"".join(struct.pack("<Q", d) for d in ne)
    return _s(name) + struct.pack("<I", len(ne)) + dims + struct.pack("<IQ", ggml_type, offset)


def _gguf(kvs: list[bytes], infos: list[bytes], data: bytes, version: int = 3, align: int = 32):
    """Hand-made GGUF bytes and the section starts {"kv", "ti", "data"}."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(infos), len(kvs))
    kv, ti = b"".join(kvs), b"".join(infos)
    body = head + kv + ti
    pad = b"\0" * (-len(body) % align)
    marks = {"kv": len(head), "ti": len(head) + len(kv), "data": len(body) + len(pad)}
    return body + pad + data, marks


def _small_gguf(**kw):
    """Tensors 'a' F32 (2, 8) at 0 and 'b' F32 (8,) at 64."""
    infos = [_tinfo("a", [8, 2], 0, 0), _tinfo("b", [8], 0, 64)]
    data = np.arange(24, dtype=np.float32).tobytes()
    return _gguf([_kv_str("general.architecture", "test")], infos, data, **kw)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _st_bytes(header: dict | bytes, data: bytes, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def _hf_folder(folder: Path, tensors: dict[str, torch.Tensor] | None = None, config: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or {"model_type": "qwen3_moe", "hidden_size": 8}))
    if tensors is not None:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


# ---------------------------------------------------------------------------------------------- GGUF: valid


V = gguf.GGUFValueType
META = {"s": ("héllo wörld", V.STRING), "u32": (7, V.UINT32), "u64": (2**40, V.UINT64), "i32": (-5, V.INT32),
        "i8": (-3, V.INT8), "f32v": (1.5, V.FLOAT32), "f64v": (0.1, V.FLOAT64), "yes": (True, V.BOOL),
        "no": (False, V.BOOL), "ints": ([1, 2, 3], V.ARRAY), "floats": ([0.5, 1.5], V.ARRAY),
        "strs": (["a", "bé", ""], V.ARRAY), "nested": ([[1, 2], [3]], V.ARRAY)}


def _write_gguf(path: Path, tensors: dict, meta: dict | None = None, align: int | None = None, **kw) -> Path:
    """Write with gguf.GGUFWriter; tensors: name -> array, or (bytes array, raw qtype) for quantized ones."""
    w = gguf.GGUFWriter(path, "qwen3moe", **kw)
    if align:
        w.add_custom_alignment(align)
    for key, (value, vtype) in (meta or {}).items():
        w.add_key_value(key, value, vtype)
    for name, t in tensors.items():
        w.add_tensor(name, *t) if isinstance(t, tuple) else w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def written_gguf(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"f32": rng.standard_normal((3, 5)).astype(np.float32),
               "f16": rng.standard_normal((4, 32)).astype(np.float16),
               "exps": rng.standard_normal((3, 2, 64)).astype(np.float32),
               "q8": (quantize(rng.standard_normal((4, 64)).astype(np.float32), QType.Q8_0), None, QType.Q8_0)}
    path = _write_gguf(tmp_path / "w.gguf", tensors, META)
    return path, {k: (v[0] if isinstance(v, tuple) else v).tobytes() for k, v in tensors.items()}


def test_gguf_metadata_values(written_gguf):
    path, _ = written_gguf
    m = read_gguf(path)
    assert m.format == "gguf"
    assert m.metadata == {"general.architecture": "qwen3moe", **{k: v for k, (v, _) in META.items()}}
    assert m.metadata["yes"] is True and type(m.metadata["u64"]) is int


def test_gguf_without_strings_is_the_whole_header_less_its_string_arrays(written_gguf, tmp_path):
    path, _ = written_gguf
    whole, tensors = read_gguf(path), read_gguf(path, strings=False)
    assert tensors.records == whole.records
    assert tensors.metadata == {k: v for k, v in whole.metadata.items() if k != "strs"}
    nested = _write_gguf(tmp_path / "n.gguf", {"x": np.ones(4, dtype=np.float32)},
                         {"ss": ([["a"], ["b", "c"]], V.ARRAY), "n": (3, V.UINT32)})
    assert read_gguf(nested).metadata["ss"] == [["a"], ["b", "c"]]
    assert read_gguf(nested, strings=False).metadata == {"general.architecture": "qwen3moe", "n": 3}


@pytest.mark.parametrize("payload, phrase", [
    (struct.pack("<IQ", 8, 2) + _s("ok") + struct.pack("<Q", 2**40), "key 'sa' runs past the end of the file"),
    (struct.pack("<IQ", 8, 2) + _s("ok") + struct.pack("<Q", 2**64 - 1), "key 'sa' runs past the end of the file"),
    (struct.pack("<IQ", 8, 2) + _s("okokokok") + b"\5\0\0", "key 'sa' runs past the end of the file"),
    (struct.pack("<IQ", 8, 2**60), "key 'sa' array length"),
])
def test_gguf_string_arrays_stepped_over_are_still_checked(tmp_path, payload, phrase):
    path = _write(tmp_path / "s.gguf", b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _kv("sa", 9, payload))
    _fails(lambda p: read_gguf(p, strings=False), path, phrase)


def test_gguf_records_and_bytes(written_gguf):
    path, written = written_gguf
    m = open_model(path)
    assert set(m.records) == set(written)
    want = {"f32": (QType.F32, (3, 5)), "f16": (QType.F16, (4, 32)), "exps": (QType.F32, (3, 2, 64)),
            "q8": (QType.Q8_0, (4, 64))}
    for name, (qtype, shape) in want.items():
        rec = m.records[name]
        assert (rec.qtype, rec.shape, rec.file) == (qtype, shape, path)
        assert rec.offset % 32 == 0
        assert m.raw(name).numpy().tobytes() == written[name]
    assert m.qtensor("exps")[1].data.shape == (2, 256)


def test_gguf_raw_is_zero_copy_and_copy_on_write(written_gguf):
    path, written = written_gguf
    m = read_gguf(path)
    rec = m.records["f32"]
    view = m.raw(rec)
    view[0] ^= 0xFF
    assert m._maps[path][rec.offset] == view[0].item()  # the view is the map
    assert m.raw(rec).data_ptr() == view.data_ptr()
    assert path.read_bytes()[rec.offset] == written["f32"][0]  # the file itself is untouched


def test_gguf_version2_and_custom_alignment(tmp_path):
    tensors = {"x": np.ones(16, dtype=np.float32), "y": np.ones(8, dtype=np.float32)}
    path = _write_gguf(tmp_path / "a.gguf", tensors, align=64)
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", 2)
    _write(path, bytes(data))
    m = read_gguf(path)
    assert m.metadata["general.alignment"] == 64
    assert all(r.offset % 64 == 0 for r in m.records.values())
    assert m.raw("y").view(torch.float32).tolist() == [1.0] * 8


def test_gguf_hand_built_reference_reads(tmp_path):
    data, marks = _small_gguf()
    m = read_gguf(_write(tmp_path / "s.gguf", data))
    assert m.records["a"].shape == (2, 8) and m.records["a"].offset == marks["data"]
    assert m.raw("b").view(torch.float32).tolist() == list(range(16, 24))


# ---------------------------------------------------------------------------------------------- GGUF: errors


def test_gguf_bad_magic_and_tiny_files(tmp_path):
    data, _ = _small_gguf()
    _fails(read_gguf, _write(tmp_path / "m.gguf", b"GGUX" + data[4:]), "not a GGUF file (bad magic)")
    _fails(read_gguf, _write(tmp_path / "e.gguf", b""), "bad magic")
    _fails(read_gguf, _write(tmp_path / "two.gguf", b"GG"), "bad magic")
    _fails(read_gguf, _write(tmp_path / "h.gguf", b"GGUF\3\0"), "truncated header")


@pytest.mark.parametrize("version, phrase", [(1, "unsupported GGUF version 1"), (4, "unsupported GGUF version 4"),
                                             (0x03000000, "big-endian")])
def test_gguf_versions(tmp_path, version, phrase):
    data, _ = _small_gguf(version=version)
    _fails(read_gguf, _write(tmp_path / "v.gguf", data), phrase)


def test_gguf_big_endian_writer(tmp_path):
    path = _write_gguf(tmp_path / "be.gguf", {"x": np.ones(4, dtype=np.float32)}, endianess=gguf.GGUFEndian.BIG)
    _fails(read_gguf, path, "big-endian")


@pytest.mark.parametrize("where, extra, phrase", [
    ("header", 10, "truncated header"), ("header", 20, "truncated header"), ("kv", 5, "truncated header"),
    ("kv", 20, "truncated header"), ("ti", 3, "truncated header"), ("ti", 20, "truncated header"),
    ("data", 0, "truncated: tensor 'a' needs bytes"), ("data", 70, "truncated: tensor 'b' needs bytes"),
])
def test_gguf_truncated(tmp_path, where, extra, phrase):
    data, marks = _small_gguf()
    cut = extra if where == "header" else marks[where] + extra
    msg = _fails(read_gguf, _write(tmp_path / "t.gguf", data[:cut]), phrase)
    if where == "data":
        assert f"but the file has {cut}" in msg


@pytest.mark.parametrize("field, phrase", [(slice(8, 16), "tensor count"), (slice(16, 24), "key/value count")])
def test_gguf_huge_header_counts_fail_fast(tmp_path, field, phrase):
    data = bytearray(_small_gguf()[0])
    data[field] = struct.pack("<Q", 2**60)
    with _lines_run() as lines:
        _fails(read_gguf, _write(tmp_path / "c.gguf", bytes(data)), phrase)
    assert lines[0] < 500, lines  # refused from the header's first fields (about 60 lines), not item by item


@pytest.mark.parametrize("kv, phrase", [
    (struct.pack("<Q", 2**60) + b"key", "length of key #0"),
    (_kv("arr", 9, struct.pack("<IQ", 4, 2**60)), "key 'arr' array length"),
    (_kv("arr", 9, struct.pack("<IQ", 8, 2**60)), "key 'arr' array length"),
    (_kv("s", 8, struct.pack("<Q", 2**60)), "length of key 's'"),
    (_kv("t", 13, b"\0" * 8), "key 't': unknown value type 13"),
    (_kv("arr", 9, struct.pack("<IQ", 77, 1)), "unknown array element type 77"),
    (_kv("b", 7, b"\x05"), "invalid bool value 5"),
    (_kv(b"\xff\xfe", 4, b"\0" * 4), "not valid UTF-8"),
    (_kv("s", 8, _s(b"\xc3\x28")), "key 's' is not valid UTF-8"),
    (_kv("sa", 9, struct.pack("<IQ", 8, 2) + _s("ok") + _s(b"\xff")), "key 'sa'[1] is not valid UTF-8"),
    (_kv("sa", 9, struct.pack("<IQ", 8, 2) + _s("ok") + struct.pack("<Q", 2**40)), "length of key 'sa'[1]"),
    (_kv("deep", 9, struct.pack("<IQ", 9, 1) * 20 + b"\0" * 64), "nested more than"),
    (_kv_u32("general.alignment", 48), "power of two"),
    (_kv_str("general.alignment", "32"), "power of two"),
    (_kv_u32("dup", 1) + _kv_u32("dup", 2), "duplicate key 'dup'"),
])
def test_gguf_bad_keys(tmp_path, kv, phrase):
    n_kv = 2 if phrase.startswith("duplicate") else 1
    infos = [_tinfo("a", [8])]
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, n_kv)
    data = head + kv + b"".join(infos) + b"\0" * 256
    with _lines_run() as lines:
        _fails(read_gguf, _write(tmp_path / "k.gguf", data), phrase)
    assert lines[0] < 1000, lines  # at most a few hundred lines of parsing, whatever length the key claims


@pytest.mark.parametrize("infos, phrase", [
    ([_tinfo("x", [8], 99)], "unknown quantization type 99 for tensor 'x'"),
    ([_tinfo("x", [256], 16)], "unsupported quantization type IQ2_XXS for tensor 'x'"),
    ([_tinfo("x", [256], 15)], "unsupported quantization type Q8_K for tensor 'x'"),
    ([_tinfo("x", [48], 8)], "tensor 'x' has rows of 48 elements, not a multiple of Q8_0's block of 32"),
    ([_tinfo("x", [])], "tensor 'x' has 0 dimensions"),
    ([_tinfo("x", [1, 1, 1, 1, 1])], "tensor 'x' has 5 dimensions"),
    ([_tinfo("x", [8, 0])], "tensor 'x' has an invalid shape"),
    ([_tinfo("x", [8, 2**64 - 2])], "tensor 'x' has an invalid shape"),
    ([_tinfo("x", [2**40, 2**40])], "tensor 'x' has an invalid shape"),
    ([_tinfo("x", [8], 0, 4)], "tensor 'x' has offset 4, not aligned to 32"),
    ([_tinfo("x", [16], 0, 0), _tinfo("y", [8], 0, 32)], "tensors 'x' and 'y' overlap"),
    ([_tinfo("x", [8], 0, 0), _tinfo("x", [8], 0, 32)], "duplicate tensor name 'x'"),
    ([_tinfo("x", [8], 0, 2**63)], "truncated: tensor 'x' needs bytes"),
    ([_tinfo("x\ny", [8], 99)], "tensor 'x\\ny'"),
])
def test_gguf_bad_tensor_infos(tmp_path, infos, phrase):
    data, _ = _gguf([], infos, b"\0" * 4096)
    _fails(read_gguf, _write(tmp_path / "i.gguf", data), phrase)


# ---------------------------------------------------------------------------------------------- Hugging Face: valid


def test_hf_single_file(tmp_path):
    tensors = {"model.embed_tokens.weight": torch.randn(6, 8), "model.norm.weight": torch.randn(8).half(),
               "model.layers.0.mlp.gate.weight": torch.randn(4, 8).bfloat16()}
    folder = _hf_folder(tmp_path / "m", tensors, {"model_type": "qwen3_moe", "num_experts": 4})
    m = open_model(folder)
    assert m.format == "safetensors"
    assert m.metadata["config"] == {"model_type": "qwen3_moe", "num_experts": 4}
    assert m.metadata["dir"] == str(folder)
    assert set(m.records) == set(tensors)
    qtypes = {torch.float32: QType.F32, torch.float16: QType.F16, torch.bfloat16: QType.BF16}
    for name, t in tensors.items():
        rec = m.records[name]
        assert (rec.qtype, rec.shape, rec.file) == (qtypes[t.dtype], tuple(t.shape), folder / "model.safetensors")
        assert m.raw(rec).numpy().tobytes() == _tensor_bytes(t)
    via_file = open_model(folder / "model.safetensors")
    assert set(via_file.records) == set(tensors)


def test_hf_zero_copy(tmp_path):
    t = torch.arange(16, dtype=torch.float32)
    folder = _hf_folder(tmp_path / "m", {"w": t})
    m = read_hf(folder)
    rec = m.records["w"]
    view = m.raw(rec)
    view[0] = 99
    assert m._maps[rec.file][rec.offset] == 99
    assert rec.file.read_bytes()[rec.offset] == 0


def test_hf_sharded(tmp_path):
    folder = _hf_folder(tmp_path / "m")
    shards = {"model-00001-of-00002.safetensors": {"a": torch.randn(2, 3), "b": torch.randn(3)},
              "model-00002-of-00002.safetensors": {"c": torch.randn(4, 4).half()}}
    weight_map = {}
    for fname, ts in shards.items():
        save_file(ts, str(folder / fname))
        weight_map.update({k: fname for k in ts})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    m = open_model(folder)
    assert set(m.records) == {"a", "b", "c"}
    assert set(m._maps) == {folder / f for f in shards}
    for fname, ts in shards.items():
        for k, t in ts.items():
            assert m.records[k].file == folder / fname
            assert m.raw(k).numpy().tobytes() == _tensor_bytes(t)


# ---------------------------------------------------------------------------------------------- Hugging Face: errors


def _st_folder(tmp_path: Path, blob: bytes) -> Path:
    folder = _hf_folder(tmp_path / "m")
    _write(folder / "model.safetensors", blob)
    return folder / "model.safetensors"


F32x4 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}


@pytest.mark.parametrize("blob, phrase", [
    (b"\x01\x02", "truncated header"),
    (_st_bytes(b"{}", b"", length=10**6), "header length 1000000 is larger than the file"),
    (_st_bytes(b"{}", b"", length=2**63), "header length"),
    (_st_bytes(b'{"w": ', b""), "header is not valid JSON"),
    (_st_bytes(b"\xff\xfe{}", b""), "header is not valid JSON"),
    pytest.param(_st_bytes(b"[" * 100000 + b"]" * 100000, b""), "header is not valid JSON", id="deep-json"),
    (_st_bytes(b"[1]", b""), "header is not a JSON object"),
    (_st_bytes(b'{"w": 1}', b""), "header entry for tensor 'w' is not an object"),
    (_st_bytes(b'{"w": {}, "w": {}}', b""), "duplicate JSON key 'w'"),
    (_st_bytes({"w": {**F32x4, "dtype": "Q9"}}, b"\0" * 16), "unknown dtype 'Q9' for tensor 'w'"),
    (_st_bytes({"w": {**F32x4, "dtype": "I64", "shape": [2]}}, b"\0" * 16), "unsupported dtype I64 for tensor 'w'"),
    (_st_bytes({"w": {**F32x4, "dtype": "F8_E4M3", "shape": [16]}}, b"\0" * 16), "unsupported dtype F8_E4M3"),
    (_st_bytes({"w": {**F32x4, "shape": [-4]}}, b"\0" * 16), "tensor 'w' has an invalid shape"),
    (_st_bytes({"w": {**F32x4, "shape": "4"}}, b"\0" * 16), "tensor 'w' has an invalid shape"),
    (_st_bytes({"w": {**F32x4, "data_offsets": [0]}}, b"\0" * 16), "tensor 'w' has invalid data_offsets"),
    (_st_bytes({"w": F32x4}, b"\0" * 8), "truncated: tensor 'w' needs data bytes 0..16"),
    (_st_bytes({"w": {**F32x4, "data_offsets": [8, 4]}}, b"\0" * 16), "truncated: tensor 'w'"),
    (_st_bytes({"w": {**F32x4, "shape": [3]}}, b"\0" * 16), "tensor 'w' has 16 bytes but shape [3] of F32 needs 12"),
    (_st_bytes({"w": F32x4, "v": {**F32x4, "data_offsets": [8, 24]}}, b"\0" * 24), "overlap"),
])
def test_hf_bad_headers(tmp_path, blob, phrase):
    path = _st_folder(tmp_path, blob)
    _fails(read_hf, path.parent, phrase)
    _fails(open_model, path, phrase)


def test_hf_config_problems(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    _fails(read_hf, folder, "no config.json in the folder")
    (folder / "config.json").write_text("{not json")
    _fails(read_hf, folder, "config.json is not valid JSON")
    (folder / "config.json").write_text("[]")
    _fails(read_hf, folder, "config is not a JSON object")


def test_hf_no_weights(tmp_path):
    _fails(read_hf, _hf_folder(tmp_path / "m"), "no model.safetensors or model.safetensors.index.json")


def _sharded(tmp_path: Path, weight_map: dict, index: dict | None = None) -> Path:
    folder = _hf_folder(tmp_path / "m")
    save_file({"a": torch.zeros(2)}, str(folder / "s1.safetensors"))
    save_file({"b": torch.zeros(2), "a": torch.ones(1)}, str(folder / "dup.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(index or {"weight_map": weight_map}))
    return folder


@pytest.mark.parametrize("weight_map, index, where, phrase", [
    ({"a": "s1.safetensors", "b": "s2.safetensors"}, None, "s2.safetensors", "cannot read file"),
    ({"a": "s1.safetensors", "z": "s1.safetensors"}, None, "s1.safetensors",
     "tensor 'z' listed in model.safetensors.index.json is missing from this shard"),
    ({"a": "../s1.safetensors"}, None, "model.safetensors.index.json", "not a plain file name"),
    ({}, {"weight_map": [1]}, "model.safetensors.index.json", "no weight_map object"),
    ({"a": "s1.safetensors", "b": "dup.safetensors"}, None, "safetensors", "tensor 'a' is also in"),
])
def test_hf_shard_problems(tmp_path, weight_map, index, where, phrase):
    folder = _sharded(tmp_path, weight_map, index)
    msg = _fails(read_hf, folder, phrase)
    assert where in msg


# ---------------------------------------------------------------------------------------------- open_model dispatch


def test_open_model_dispatch_errors(tmp_path, monkeypatch):
    _fails(open_model, tmp_path / "nope.gguf", "no such file or directory")
    _fails(open_model, _write(tmp_path / "notes.txt", b"hello"), "not a GGUF file or a Hugging Face model folder")
    _fails(open_model, _write(tmp_path / "empty.gguf", b""), "empty file")
    _fails(open_model, tmp_path, "no config.json")

    def denied(*_a, **_k):
        raise PermissionError(13, "Permission denied")

    path = _write(tmp_path / "locked.gguf", _small_gguf()[0])
    monkeypatch.setattr("moerun.formats.open", denied, raising=False)
    _fails(open_model, path, "Permission denied")
    monkeypatch.setattr("moerun.formats.gguf.open", denied, raising=False)
    _fails(read_gguf, path, "Permission denied")


# ---------------------------------------------------------------------------------------------- fuzz


def _mutations(blob: bytes, header_len: int, seed: int):
    rng = random.Random(seed)
    for _ in range(200):
        data = bytearray(blob)
        if rng.random() < 0.25:
            data = data[:rng.randrange(len(data))]
        else:
            for _ in range(rng.randint(1, 6)):
                i = rng.randrange(header_len if rng.random() < 0.85 else len(data))
                data[i] = rng.randrange(256) if rng.random() < 0.5 else data[i] ^ (1 << rng.randrange(8))
        yield bytes(data)


def _fuzz(open_fn, path: Path, blob: bytes, header_len: int, seed: int) -> int:
    """Each mutation opens or fails with one line, and the reader's work stays linear in the file's size: at
    most 500 lines of moerun code plus 10 per byte (a clean parse runs under 1 a byte; a claimed count walked
    item by item, or a quadratic check, goes far past it)."""
    failures = 0
    for data in _mutations(blob, header_len, seed):
        path.write_bytes(data)
        with _lines_run() as lines:
            try:
                open_fn(path).close()
            except ModelFormatError as e:
                assert "\n" not in str(e)
                failures += 1
        assert lines[0] <= 500 + 10 * len(data), (lines, len(data))
    return failures


def test_fuzz_gguf(written_gguf, tmp_path):
    path, _ = written_gguf
    blob = path.read_bytes()
    m = read_gguf(path)
    header_len = min(r.offset for r in m.records.values())
    failures = _fuzz(read_gguf, tmp_path / "fuzz.gguf", blob, header_len, seed=1234)
    assert 0 < failures < 200


def test_fuzz_safetensors(tmp_path):
    folder = _hf_folder(tmp_path / "m", {"a.weight": torch.randn(4, 4), "b.bias": torch.randn(4).half()})
    path = folder / "model.safetensors"
    blob = path.read_bytes()
    header_len = 8 + struct.unpack("<Q", blob[:8])[0]
    failures = _fuzz(open_model, path, blob, header_len, seed=99)
    assert 0 < failures < 200


def test_read_copies_the_bytes_and_reports_truncation(tmp_path):
    """ModelFile.read: the same bytes as the map view, in owned memory; a file cut short is a clear error."""
    path = tmp_path / "r.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_tensor("t", np.arange(64, dtype=np.float32).reshape(8, 8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    mf = open_model(path)
    got = mf.read("t")
    assert torch.equal(got, mf.raw("t")) and got.data_ptr() != mf.raw("t").data_ptr()
    rec = mf.records["t"]
    os.truncate(path, rec.offset + 10)
    with pytest.raises(ModelFormatError, match="truncated: tensor 't'"):
        mf.read("t")
