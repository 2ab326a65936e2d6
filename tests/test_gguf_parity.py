"""GGUF path: our conversion of each family's transformers model gives transformers' logits (F32),
and close logits when quantized (Q8_0, Q4_K)."""

import pytest
import torch
from hf_models import FAMILIES, build, reference_logits, save

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


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_gguf_matches_transformers_on_dequantized_weights(hf_model, tokens32, tmp_path, family):
    model, folder = hf_model(family)
    path = convert_hf_to_gguf(folder, tmp_path / "m.gguf", ftype="Q8_0", progress=False)
    loaded = load_model(path, kernels=False)
    assert loaded.file.records["blk.0.ffn_gate_exps.weight"].qtype == QType.Q8_0
    got = loaded.model.forward(tokens32)
    ref = reference_logits(dequantized_reference(path, folder, tmp_path / "ref"), tokens32)
    assert (got - ref).abs().max().item() < 1e-4
    # The quantized kernels also round the activations to 8 bits (as llama.cpp does): measured relative
    # logit error against the same oracle: qwen3moe 14%, qwen2moe 2.8%, mixtral 19%, olmoe 2.4% (Q8_0);
    # Q4_K 2.9%, Q4_K_M 5.4% -- driven by routing flips on near-tied random routers. The kernels' own
    # accuracy is tested per matmul in test_kernels_cpu.py.
    fast = load_model(path).model.forward(tokens32)
    err = rel_err(fast, ref)
    assert err < KERNEL_ERR, f"{family}: kernel path relative error {err:.4f}"
    # Against the fp32 model (kernel path), measured: qwen3moe 14%, qwen2moe 3.2%, mixtral 3.1%, olmoe 5.5%.
    # Q8_0 itself is ~0.3% per weight; the rest is routing: random tiny routers have near-ties, and a
    # flipped top-k choice on 2 of 32 tokens swaps whole experts. Bounded loosely so a broken quantized
    # path still fails.
    err = rel_err(fast, reference_logits(model, tokens32))
    assert err < 0.3, f"{family}: Q8_0 relative error {err:.4f}"


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
    loaded = load_model(path, kernels=False)
    types = {r.qtype for r in loaded.file.records.values()}
    assert QType.Q4_K in types and (QType.Q6_K in types) == (ftype == "Q4_K_M")
    got = loaded.model.forward(tokens32)
    ref = reference_logits(dequantized_reference(path, folder, tmp_path / "ref"), tokens32)
    assert (got - ref).abs().max().item() < 1e-4
    fast = load_model(path).model.forward(tokens32)
    err = rel_err(fast, ref)
    assert err < KERNEL_ERR, f"{ftype}: kernel path relative error {err:.4f}"
    # Against the fp32 model: measured 40% relative logit error (Q4_K and Q4_K_M alike). Q4_K's weight
    # error is ~7% relative RMS, compounded over 2 layers and amplified by routing flips on random
    # routers. Loose bound, as above.
    err = rel_err(fast, reference_logits(model, tokens32))
    assert err < 0.8, f"{ftype} relative error {err:.4f}"
