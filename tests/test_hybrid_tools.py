"""moerun.tools for the hybrids (qwen3next, qwen35moe): presets, quantization types, GGUF and safetensors output.

Files are read back with moerun's readers, gguf.GGUFReader and transformers; with llama-cpp-python installed, its
logits on our GGUF are checked against transformers' on our safetensors folder of the same seed.
"""

from __future__ import annotations

import json
import re

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from test_tools import _read, _tokenizer_cache  # noqa: F401 (the same private tokenizer cache, autouse)

from moerun.arch import expected_shapes
from moerun.formats.names import CName
from moerun.quant.qtypes import QTensor, QType
from moerun.quant.quantize import quantize
from moerun.tools import hf_out
from moerun.tools.gguf_out import qtype_for, use_more_bits
from moerun.tools.make_model import generate_tensor, main, make_model
from moerun.tools.presets import preset

HYBRIDS = ("qwen3next", "qwen35moe")
LLAMA_ARCH = {"qwen3next": gguf.MODEL_ARCH.QWEN3NEXT, "qwen35moe": gguf.MODEL_ARCH.QWEN35MOE}
LINEAR = ("linear", "linear", "linear", "full")


# --------------------------------------------------------------------------------------- presets


@pytest.mark.parametrize("family", HYBRIDS)
def test_tiny_hybrid_presets(family):
    s = preset(f"tiny-{family}")
    assert (s.family, s.n_layers, s.layer_kinds, s.hidden, s.n_heads, s.n_kv_heads, s.head_dim, s.vocab) == \
        (family, 4, LINEAR, 64, 4, 2, 16, 512)
    assert (s.n_experts, s.n_experts_used, s.expert_ffn, s.shared_ffn, s.rope_dim, s.rms_eps, s.context_length) == \
        (8, 2, 32, 48, 4, 1e-6, 4096)
    assert (s.ssm_conv, s.ssm_k_heads, s.ssm_v_heads, s.ssm_k_dim, s.ssm_v_dim) == (4, 2, 4, 8, 16)
    assert s.attn_gate and s.qk_norm == "head" and s.shared_gate and s.norm_topk and s.hybrid
    assert (s.ssm_ba, s.ssm_v_order) == ((True, "grouped") if family == "qwen3next" else (False, "tiled"))
    assert [s.linear(i) for i in range(4)] == [True, True, True, False]
    assert s.kv_layout(0) is None and s.kv_layout(3).k == (2, 16)
    assert s.state_layout(0).conv == (2 * 2 * 8 + 4 * 16, 3) and s.state_layout(0).ssm == (4, 8, 16)


def test_hybrid_overrides_repeat_the_four_layer_pattern():
    assert preset("tiny-qwen3next", layers=8).layer_kinds == LINEAR * 2
    assert preset("tiny-qwen35moe", layers=6).layer_kinds == LINEAR + LINEAR[:2]
    s = preset("tiny-qwen3next", layers=12, ssm_v_dim=8)
    assert s.layer_kinds == LINEAR * 3 and s.moe_layers == (True,) * 12 and s.ssm_v_dim == 8


def test_full_size_hybrid_presets():
    nxt = preset("next-L4")
    assert (nxt.family, nxt.n_layers, nxt.layer_kinds, nxt.hidden, nxt.n_heads, nxt.n_kv_heads, nxt.head_dim,
            nxt.rope_dim) == ("qwen3next", 4, LINEAR, 2048, 16, 2, 256, 64)
    assert (nxt.n_experts, nxt.n_experts_used, nxt.expert_ffn, nxt.shared_ffn, nxt.vocab, nxt.rope_theta,
            nxt.context_length) == (512, 10, 512, 512, 1024, 1e7, 262144)
    assert (nxt.ssm_conv, nxt.ssm_k_heads, nxt.ssm_v_heads, nxt.ssm_k_dim, nxt.ssm_v_dim, nxt.ssm_ba) == \
        (4, 16, 32, 128, 128, True)
    assert preset("next-L8").layer_kinds == LINEAR * 2
    q35 = preset("q35-L4")
    assert (q35.family, q35.n_experts, q35.n_experts_used, q35.ssm_ba, q35.ssm_v_order) == \
        ("qwen35moe", 256, 8, False, "tiled")
    assert (q35.hidden, q35.head_dim, q35.rope_dim, q35.expert_ffn, q35.shared_ffn, q35.ssm_v_heads) == \
        (2048, 256, 64, 512, 512, 32)


# ------------------------------------------------------------------------------------ quant mix


def test_hybrid_qtypes():
    cn = CName
    for ftype in ("Q8_0", "Q4_K", "Q4_K_M", "MXFP4_MOE"):
        for kind, shape in (("ssm_conv1d.weight", (8192, 4)), ("ssm_a", (32,)), ("ssm_dt.bias", (32,)),
                            ("ssm_norm.weight", (128,))):
            assert qtype_for(cn(kind, 0), shape, ftype, n_layers=4) == QType.F32, (ftype, kind)
    base = {"Q8_0": QType.Q8_0, "Q4_K": QType.Q4_K, "MXFP4_MOE": QType.Q8_0}
    for ftype, qtype in base.items():
        for kind, shape in (("attn_qkv.weight", (8192, 2048)), ("attn_gate.weight", (4096, 2048)),
                            ("ssm_out.weight", (2048, 4096)), ("ssm_ba.weight", (64, 2048)),
                            ("ssm_beta.weight", (32, 2048)), ("ssm_alpha.weight", (32, 2048))):
            assert qtype_for(cn(kind, 1), shape, ftype, n_layers=4) == qtype, (ftype, kind)
    # Q4_K_M: attn_qkv counts with attn_v (one per layer): Q6_K on use_more_bits' layers, as llama-quantize
    for i in range(8):
        want = QType.Q6_K if use_more_bits(i, 8) else QType.Q4_K
        assert qtype_for(cn("attn_qkv.weight", i), (8192, 2048), "Q4_K_M", n_layers=8) == want
        assert qtype_for(cn("attn_gate.weight", i), (4096, 2048), "Q4_K_M", n_layers=8) == QType.Q4_K
        assert qtype_for(cn("ssm_ba.weight", i), (64, 2048), "Q4_K_M", n_layers=8) == QType.Q4_K
    assert qtype_for(cn("ssm_ba.weight", 0), (8, 64), "Q4_K", n_layers=4) == QType.Q8_0  # rows of 64


# -------------------------------------------------------------------------------------------- GGUF


@pytest.mark.parametrize("ftype", ["F32", "Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_gguf_round_trip(tmp_path, family, ftype):
    """`make-model tiny-<family>` reads back as the preset's spec, every tensor of llama.cpp's name and the type
    qtype_for gives, holding the generated values (quantized)."""
    path = tmp_path / "m.gguf"
    assert main([f"tiny-{family}", str(path), "--ftype", ftype, "--seed", "3", "--no-progress"]) == 0
    spec = preset(f"tiny-{family}")
    mf, arch, w = _read(path)
    assert arch.spec == spec and arch.notes == ()
    for cn, shape in expected_shapes(spec).items():
        want = generate_tensor(cn, shape, seed=3)
        qtype = qtype_for(cn, shape, ftype, n_layers=spec.n_layers)
        assert w[cn].qtype == qtype, cn
        if qtype != QType.F32:
            want = QTensor.from_bytes(quantize(want, qtype), qtype, shape).dequantize()
        torch.testing.assert_close(w[cn].dequantize().reshape(shape), want, rtol=0, atol=0, msg=cn.gguf)
    mf.close()

    r = gguf.GGUFReader(path)
    allowed = [re.compile(re.escape(gguf.TENSOR_NAMES[t]).replace(r"\{bid\}", r"\d+") + r"(\.(weight|bias))?$")
               for t in gguf.MODEL_TENSORS[LLAMA_ARCH[family]]]
    assert [t.name for t in r.tensors if not any(rx.match(t.name) for rx in allowed)] == []
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.0.ssm_conv1d.weight"] == types["blk.0.ssm_a"] == types["blk.0.ssm_dt.bias"] == QType.F32
    assert r.fields["general.architecture"].contents() == family
    assert r.fields[f"{family}.ssm.inner_size"].contents() == spec.ssm_value_dim


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_random_values_are_a_stable_model(family):
    """The decay ssm_a is negative (-A, A in [0.01, 16]), the conv1d's weights of scale kernel ** -0.5, norms ~1."""
    spec = preset(f"tiny-{family}", ssm_v_heads=64)
    shapes = expected_shapes(spec)
    a = generate_tensor(CName("ssm_a", 0), shapes[CName("ssm_a", 0)])
    assert (a < -0.01).all() and (a > -16).all() and a.min() < -8 and a.max() > -8
    conv = generate_tensor(CName("ssm_conv1d.weight", 1), shapes[CName("ssm_conv1d.weight", 1)])
    assert 0.4 < conv.std() < 0.6
    for kind in ("ssm_norm.weight", "attn_norm.weight"):
        assert (generate_tensor(CName(kind, 2), shapes[CName(kind, 2)]) - 1).abs().max() < 0.2
    assert generate_tensor(CName("ssm_dt.bias", 0), shapes[CName("ssm_dt.bias", 0)]).abs().max() < 0.2


def test_hybrid_q4_k_m_mix(tmp_path):
    spec = preset("tiny-qwen3next", layers=8, hidden=256, expert_ffn=256, shared_ffn=256, ssm_v_dim=64)
    path = make_model(spec, tmp_path / "m.gguf", ftype="Q4_K_M", progress=False)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    for i in range(8):
        more = QType.Q6_K if use_more_bits(i, 8) else QType.Q4_K
        assert types[f"blk.{i}.{'attn_v' if i % 4 == 3 else 'attn_qkv'}.weight"] == more
        assert types[f"blk.{i}.ffn_down_exps.weight"] == more
        if i % 4 != 3:
            assert types[f"blk.{i}.attn_gate.weight"] == types[f"blk.{i}.ssm_ba.weight"] == QType.Q4_K
            assert types[f"blk.{i}.ssm_out.weight"] == QType.Q4_K  # rows of the value dims, 4 * 64
            assert types[f"blk.{i}.ssm_conv1d.weight"] == types[f"blk.{i}.ssm_norm.weight"] == QType.F32
    mf, arch, _ = _read(path)
    assert arch.spec == spec
    mf.close()


# ------------------------------------------------------------------------------------ safetensors


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_safetensors_round_trip(tmp_path, family):
    """The folder holds what the family's checkpoints hold (norms w - 1, A_log, conv1d [C, 1, K], Qwen3-Next's
    in_proj_qkvz and in_proj_ba, Qwen3.5's fused experts), loads into transformers with every weight used, and
    back into moerun as the same spec and canonical values."""
    transformers = pytest.importorskip("transformers")
    spec = preset(f"tiny-{family}")
    folder = make_model(spec, tmp_path / "hf", fmt="safetensors", seed=5, progress=False)
    mf, arch, w = _read(folder)
    assert arch.spec == spec
    for cn, shape in expected_shapes(spec).items():
        exact = 1e-6 if cn.kind == "ssm_a" else 0  # stored as A_log
        torch.testing.assert_close(w[cn].dequantize().reshape(shape), generate_tensor(cn, shape, seed=5),
                                   rtol=exact, atol=exact, msg=cn.gguf)
    mf.close()

    with safe_open(folder / "model.safetensors", "pt") as f:
        names = set(f.keys())
        p = "model.layers.0."
        a = generate_tensor(CName("ssm_a", 0), (spec.ssm_v_heads,), seed=5)
        a_log = f.get_tensor(p + "linear_attn.A_log")
        torch.testing.assert_close(-a_log.exp(), a if family == "qwen3next" else a[hf_out.qwen35moe.tiled(spec, 1)])
        norm = generate_tensor(CName("attn_norm.weight", 0), (spec.hidden,), seed=5)
        torch.testing.assert_close(f.get_tensor(p + "input_layernorm.weight") + 1, norm, rtol=0, atol=0)
        assert list(f.get_slice(p + "linear_attn.conv1d.weight").get_shape()) == [spec.ssm_conv_dim, 1, 4]
    fused = {"qwen3next": ("in_proj_qkvz", "in_proj_ba"), "qwen35moe": ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                        "in_proj_a")}[family]
    assert {n.split(".")[-2] for n in names if ".linear_attn.in_proj" in n} == set(fused)
    experts = {n.split("mlp.experts.")[1] for n in names if n.startswith("model.layers.3.mlp.experts.")}
    assert experts == ({"gate_up_proj", "down_proj"} if family == "qwen35moe" else
                       {f"{e}.{p}.weight" for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")})
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]

    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert type(model).__name__ == hf_out.HF_ARCHITECTURES[family][1]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4, 5]])).logits
    assert torch.isfinite(logits).all() and 0.1 < float(logits.std()) < 10


def test_hybrid_safetensors_refuses_what_config_json_cannot_say(tmp_path):
    with pytest.raises(ValueError, match="no dense layers"):
        make_model(preset("tiny-qwen35moe", moe_layers=(False, True, True, True), dense_ffn=64), tmp_path / "a",
                   fmt="safetensors", progress=False)
    with pytest.raises(ValueError, match="gated shared expert"):
        make_model(preset("tiny-qwen3next", shared_ffn=0), tmp_path / "b", fmt="safetensors", progress=False)


@pytest.mark.parametrize("family", HYBRIDS)
def test_llama_cpp_on_our_gguf_agrees_with_transformers_on_our_safetensors(tmp_path, family):
    """The two outputs of one seed compute the same model: llama.cpp's logits on the GGUF within 2e-3 of
    transformers' on the folder (measured 3e-4 and 4e-4 on logits of size ~4). llama.cpp's loader takes value heads
    as wide as key heads (ssm_v_dim = ssm_k_dim), and qwen35moe's rope.dimension_sections (11, 11, 10) must fit in
    the rotated dims (rope_dim 64)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    transformers = pytest.importorskip("transformers")
    over = {"ssm_v_dim": 8} | ({"head_dim": 128, "rope_dim": 64} if family == "qwen35moe" else {})
    spec = preset(f"tiny-{family}", **over)
    path = make_model(spec, tmp_path / "m.gguf", seed=2, progress=False)
    folder = make_model(spec, tmp_path / "hf", fmt="safetensors", seed=2, progress=False)
    ids = list(range(3, 40, 2))
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=1, logits_all=True, verbose=False, n_batch=64)
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[:len(ids)]))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    assert (theirs - ref).abs().max().item() < 2e-3
