"""GGUF path: our conversion of each family's transformers model gives transformers' logits (F32),
and close logits when quantized (Q8_0, Q4_K)."""

import pytest
import torch
from hf_models import FAMILIES, build, reference_logits, save

from moerun.formats import open_model
from moerun.loading import load_model
from moerun.quant.qtypes import QType
from moerun.tools.convert import convert_hf_to_gguf

KERNEL_ERR = 0.3


def rel_err(got, ref):
    return ((got - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_logits_match_transformers(hf_model, tokens32, tmp_path, family):
    model, folder = hf_model(family)
    path = convert_hf_to_gguf(folder, tmp_path / "m.gguf", ftype="F32", progress=False)
    got = load_model(path).model.forward(tokens32)
    err = (got - reference_logits(model, tokens32)).abs().max().item()
    assert err < 1e-4, f"{family}: max abs error {err:.2e}"


def dequantized_reference(gguf_path, hf_folder, out):
    """transformers' model with the GGUF's weights as dequantized by gguf.quants (the independent oracle)."""
    import shutil

    import gguf
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from moerun.arch import FAMILIES as FAMS
    from moerun.formats.names import parse_gguf
    from moerun.tools.hf_out import hf_names, permute_to_hf

    loaded = load_model(gguf_path)
    spec, family = loaded.arch.spec, loaded.arch.family
    state = {}
    for t in gguf.GGUFReader(str(gguf_path)).tensors:
        cn = parse_gguf(t.name)
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        if family.hf_permute_qk and cn.kind in ("attn_q.weight", "attn_k.weight"):
            w = permute_to_hf(w, spec.n_heads if cn.kind == "attn_q.weight" else spec.n_kv_heads)
        names = hf_names(family.name, cn, spec.n_experts)
        parts = w.unbind(0) if len(names) > 1 else [w.reshape(1, -1) if cn.kind.startswith("ffn_gate_inp_sh") else w]
        state |= {n: p.contiguous() for n, p in zip(names, parts)}
    assert family.name in FAMS
    out.mkdir()
    shutil.copy(hf_folder / "config.json", out / "config.json")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def check_quantized(model, folder, path, tokens, tmp_path, fp32_bound):
    """The reference path equals transformers on the gguf.quants-dequantized weights (1e-4); the kernel
    path is within KERNEL_ERR of that, and within fp32_bound of the unquantized model.

    The kernels also round activations to 8 bits (as llama.cpp does). Measured relative logit error of
    the kernel path against the oracle: qwen3moe 14%, qwen2moe 2.8%, mixtral 19%, olmoe 2.4% (Q8_0);
    Q4_K 2.9%, Q4_K_M 5.4%. Against the fp32 model: qwen3moe 14%, qwen2moe 3.2%, mixtral 3.1%, olmoe
    5.5% (Q8_0, ~0.3% error per weight) and 40% for Q4_K and Q4_K_M (~7% per weight, 2 layers). Most of it
    is routing: random tiny routers have near-ties, and a flipped top-k choice swaps whole experts. The
    bounds are loose so that a broken quantized path still fails; the kernels' own accuracy is tested per
    matmul in test_kernels_cpu.py.
    """
    got = load_model(path, kernels=False).model.forward(tokens)
    ref = reference_logits(dequantized_reference(path, folder, tmp_path / "ref"), tokens)
    assert (got - ref).abs().max().item() < 1e-4
    fast = load_model(path).model.forward(tokens)
    err = rel_err(fast, ref)
    assert err < KERNEL_ERR, f"kernel path relative error {err:.4f} against the oracle"
    err = rel_err(fast, reference_logits(model, tokens))
    assert err < fp32_bound, f"kernel path relative error {err:.4f} against fp32"


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_gguf_matches_transformers_on_dequantized_weights(hf_model, tokens32, tmp_path, family):
    model, folder = hf_model(family)
    path = convert_hf_to_gguf(folder, tmp_path / "m.gguf", ftype="Q8_0", progress=False)
    with open_model(path) as mf:
        assert mf.records["blk.0.ffn_gate_exps.weight"].qtype == QType.Q8_0
    check_quantized(model, folder, path, tokens32, tmp_path, fp32_bound=0.3)


@pytest.fixture(scope="module")
def wide_qwen3(tmp_path_factory):
    """K-quants need rows that are multiples of 256: a qwen3moe with hidden 256 and expert FFN 256."""
    from hf_models import hf_config

    cfg = hf_config("qwen3moe")
    cfg.hidden_size, cfg.moe_intermediate_size, cfg.head_dim = 256, 256, 64
    model = build("qwen3moe", config=cfg)
    return model, save(model, tmp_path_factory.mktemp("wide"))


@pytest.mark.parametrize("ftype", ["Q4_K", "Q4_K_M"])
def test_q4_k_gguf_matches_transformers_on_dequantized_weights(wide_qwen3, tokens32, tmp_path, ftype):
    model, folder = wide_qwen3
    path = convert_hf_to_gguf(folder, tmp_path / "m.gguf", ftype=ftype, progress=False)
    with open_model(path) as mf:
        types = {r.qtype for r in mf.records.values()}
    assert QType.Q4_K in types and (QType.Q6_K in types) == (ftype == "Q4_K_M")
    check_quantized(model, folder, path, tokens32, tmp_path, fp32_bound=0.8)
