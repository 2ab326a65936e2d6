"""Qwen3.5-MoE (transformers `Qwen3_5MoeForCausalLM`, and the multimodal `Qwen3_5MoeForConditionalGeneration`
checkpoint; GGUF arch `qwen35moe`): Qwen3-Next's hybrid (arch/qwen3next.py) with these differences:

- the linear layers' projections are separate (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a: attn_qkv,
  attn_gate, ssm_beta, ssm_alpha);
- llama.cpp's converter reorders value heads from HF's grouped order (key head g's r value heads together) to
  a tiled one (value head j reads key head j % nk): canonical tensors are GGUF's, so an HF checkpoint's value
  rows (attn_qkv's v part, attn_gate, beta, alpha, the conv1d's v channels, the decay vectors) and ssm_out's
  columns are reordered at load (ssm_v_order "tiled");
- RoPE is Qwen's interleaved MRoPE over (time, height, width) sections: for text every section's position is
  the token's, which is plain partial rotary; GGUF `rope.dimension_sections` is written as llama.cpp requires;
- the multimodal checkpoint nests the language model's config in `text_config` and its tensors under
  `model.language_model.`; the vision tower (`model.visual.`) is skipped with a note.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from moerun.arch import qwen3next
from moerun.arch.family import ConfigError, Family, _dict
from moerun.arch.spec import ModelSpec
from moerun.arch.tensors import Source
from moerun.formats.names import CName


def _text_config(cfg: dict) -> dict:
    text = _dict(cfg.get("text_config"), "text_config")
    if not text:
        return cfg
    if not isinstance(text.get("num_hidden_layers"), int):
        raise ConfigError("'text_config' has no 'num_hidden_layers'")
    return {"tie_word_embeddings": cfg.get("tie_word_embeddings", False)} | text


def tiled(spec: ModelSpec, size: int) -> list[int]:
    """Indices that put value heads of `size` entries each from grouped order (key head g's r heads together) into
    tiled order (tiled head j = ri * nk + g is grouped head g * r + ri)."""
    nk = spec.ssm_k_heads
    r = spec.ssm_v_heads // nk
    return [(g * r + ri) * size + j for ri in range(r) for g in range(nk) for j in range(size)]


def fix_sources(spec: ModelSpec, sources: dict[CName, Source], fmt: str) -> None:
    qwen3next.fix_sources(spec, sources, fmt)
    if fmt == "gguf":
        return
    qk = 2 * spec.ssm_k_heads * spec.ssm_k_dim
    v_rows = tiled(spec, spec.ssm_v_dim)
    heads = tuple(tiled(spec, 1))
    qkv_rows = tuple(range(qk)) + tuple(qk + j for j in v_rows)
    changes = {"attn_qkv.weight": {"rows": qkv_rows}, "ssm_conv1d.weight": {"rows": qkv_rows},
               "attn_gate.weight": {"rows": tuple(v_rows)}, "ssm_beta.weight": {"rows": heads},
               "ssm_alpha.weight": {"rows": heads}, "ssm_dt.bias": {"cols": heads}, "ssm_a": {"cols": heads},
               "ssm_out.weight": {"cols": tuple(v_rows)}}
    for cn, src in list(sources.items()):
        if cn.kind in changes and spec.linear(cn.layer):
            sources[cn] = replace(src, **changes[cn.kind])


def _gguf_keys(spec: ModelSpec) -> dict[str, Any]:
    """Qwen3-Next's keys and the MRoPE sections llama.cpp requires: rotary pair i belongs to section i % 3
    (interleaved), so section k counts the pairs i < rotary_dim / 2 with i % 3 == k ([11, 11, 10, 0] for 32
    pairs, the published models'); a pair outside every section would not rotate."""
    pairs = spec.rotary_dim // 2
    sections = [-(-(pairs - k) // 3) for k in range(3)] + [0]
    return qwen3next.gguf_keys(spec, "qwen35moe") | {"qwen35moe.rope.dimension_sections": sections}


FAMILY = Family(
    name="qwen35moe", gguf_arch="qwen35moe", hf_model_types=("qwen3_5_moe", "qwen3_5_moe_text"), norm_topk=True,
    norm_topk_fixed=True, qk_norm="head", shared_gate=True,
    gguf_aliases=(("ffn_norm.weight", "blk.{L}.post_attention_norm.weight"),),
    gguf_fields=lambda get, meta: qwen3next.gguf_fields(get, meta) | {"ssm_v_order": "tiled"},
    hf_fields=lambda cfg: qwen3next.hf_fields(cfg) | {"ssm_v_order": "tiled"},
    gguf_keys=_gguf_keys, fix_sources=fix_sources, hf_config=_text_config,
    hf_rename=(("model.language_model.", "model."),), hf_skipped=(("model.visual.", "vision tower"),),
)
