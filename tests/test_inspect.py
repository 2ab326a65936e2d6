"""`moerun inspect`: parameter counts against transformers, and one-line errors on bad files."""

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
from hf_models import FAMILIES

from moerun.cli import main


def _inspect(*args):
    return subprocess.run([sys.executable, "-m", "moerun", "inspect", *map(str, args)], capture_output=True,
                          text=True, timeout=120, check=False)


def independent_counts(model):
    """Total and active parameters counted from the transformers model (experts: k of E)."""
    cfg = model.config
    k = cfg.num_experts_per_tok
    n_exp = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    total = active = 0.0
    for name, p in model.named_parameters():
        total += p.numel()
        routed = ".experts." in name and "shared" not in name
        active += p.numel() * k / n_exp if routed else p.numel()
    return int(total), round(active)


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_counts_match_transformers(hf_model, family):
    model, folder = hf_model(family)
    total, active = independent_counts(model)
    r = _inspect(folder, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["family"] == family
    assert info["total_params"] == total
    assert info["active_params"] == active
    assert info["experts"] == 8 and info["experts_used"] == 2
    assert info["shared_experts"] == (1 if family == "qwen2moe" else 0)
    # bytes read per token: all F32 tensors but the embedding table (one row) and 6 of 8 experts
    emb = model.config.vocab_size * 64 * 4
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and "shared" not in n) * 4
    assert info["bytes_per_token"] == total * 4 - emb + 64 * 4 - experts + experts * 2 // 8


def test_inspect_human_output(hf_model):
    from click.testing import CliRunner

    _, folder = hf_model("qwen2moe")
    r = CliRunner().invoke(main, ["inspect", str(folder)])
    assert r.exit_code == 0, r.output
    assert "qwen2moe" in r.output and "active per token" in r.output and "routed_experts" in r.output


def _gguf(path, arch="qwen3moe", tensors=None, kv=None):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for k, v in (kv or {}).items():
        w.add_uint32(k, v)
    for name, a in tensors or [("token_embd.weight", np.zeros((4, 8), np.float32))]:
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _assert_one_line_error(r, path, phrase):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert str(path) in lines[0] and phrase in lines[0], lines[0]


def test_unknown_architecture(tmp_path):
    p = _gguf(tmp_path / "m.gguf", arch="notamoe")
    _assert_one_line_error(_inspect(p), p, "unknown architecture 'notamoe'")


def test_missing_tensor(tmp_path):
    kv = {"qwen3moe.block_count": 1, "qwen3moe.embedding_length": 8, "qwen3moe.attention.head_count": 2}
    p = _gguf(tmp_path / "m.gguf", kv=kv)
    _assert_one_line_error(_inspect(p), p, "missing")


def test_truncated_file(tmp_path):
    p = _gguf(tmp_path / "m.gguf")
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 40])
    _assert_one_line_error(_inspect(p), p, "truncated")


def test_corrupt_header(tmp_path):
    p = _gguf(tmp_path / "m.gguf")
    data = bytearray(p.read_bytes())
    data[:4] = b"GGUX"
    p.write_bytes(bytes(data))
    _assert_one_line_error(_inspect(p), p, "not a GGUF file")


def test_unknown_qtype(tmp_path):
    p = _gguf(tmp_path / "m.gguf")
    data = bytearray(p.read_bytes())
    name = b"token_embd.weight"
    i = data.index(name) + len(name)
    n_dims = struct.unpack_from("<I", data, i)[0]
    struct.pack_into("<I", data, i + 4 + 8 * n_dims, 99)  # ggml type field of the tensor info
    p.write_bytes(bytes(data))
    _assert_one_line_error(_inspect(p), p, "unknown quantization type 99")


def test_tensor_size_mismatch(tmp_path, hf_model):
    """A safetensors header whose byte range does not match the tensor's shape."""
    import shutil

    _, folder = hf_model("qwen3moe")
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    st = bad / "model.safetensors"
    data = bytearray(st.read_bytes())
    n = struct.unpack_from("<Q", data)[0]
    header = json.loads(data[8:8 + n])
    name = "model.norm.weight"
    header[name]["shape"] = [header[name]["shape"][0] * 2]
    new = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(new) == n
    data[8:8 + n] = new
    st.write_bytes(bytes(data))
    _assert_one_line_error(_inspect(bad), st, name)
