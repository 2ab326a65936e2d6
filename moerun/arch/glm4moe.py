"""GLM-4.5 / 4.6 (transformers `Glm4MoeForCausalLM`, GGUF arch `glm4moe`): what differs from the shared
layers.

- partial rotary: the first `partial_rotary_factor` of each head rotates (neox halves), the rest passes
  through (GGUF: `rope.dimension_count` is the rotary dims, as llama.cpp's converter writes it);
- q/k RMS norm per head when `use_qk_norm`, q/k/v biases when `attention_bias` (GGUF: both optional tensors);
- leading dense layers (`first_k_dense_replace`; GGUF `leading_dense_block_count`);
- `n_shared_experts` shared experts of the routed width, as one FFN (GGUF `expert_shared_count` x
  `expert_feed_forward_length`, llama.cpp's rule), added unscaled;
- the sigmoid router with a correction bias (`e_score_correction_bias` -> `exp_probs_b.bias`), group-limited
  with groups scored by their best two, `norm_topk_prob`, `routed_scaling_factor` (GGUF `expert_gating_func`
  2 = sigmoid, `expert_weights_norm`, `expert_weights_scale`; `expert_group_count` / `expert_group_used_count`
  where groups are used: llama.cpp reads those for deepseek2 only, and every published GLM-4.5 has one group);
- llama.cpp names the pre-FFN norm `blk.N.post_attention_norm`;
- the next-token-prediction (NextN / MTP) layers: llama.cpp's GGUFs count them in `block_count` (the last
  `nextn_predict_layers` blocks, with `blk.N.nextn.*` tensors beside a whole layer's); checkpoints store
  them as `model.layers.{num_hidden_layers}.*`. They are never run: arch.resolve drops the tensors of layers
  past n_layers.
"""

from __future__ import annotations

from typing import Any

from moerun.arch.family import ConfigError, Family, _float, _in_range, _int, rope_params
from moerun.arch.spec import ModelSpec

SIGMOID, SOFTMAX = 2, 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE values


def _moe_layers(n_layers: int, lead: int) -> tuple[bool, ...]:
    return tuple(i >= lead for i in range(n_layers))


def _leading_dense(spec: ModelSpec) -> int:
    lead = next((i for i, moe in enumerate(spec.moe_layers) if moe), spec.n_layers)
    if spec.moe_layers != _moe_layers(spec.n_layers, lead):
        raise ValueError("glm4moe's dense layers must all come first (leading_dense_block_count)")
    return lead


def _shared_count(spec: ModelSpec) -> int:
    if spec.expert_ffn <= 0 or spec.shared_ffn % spec.expert_ffn:
        raise ValueError(f"glm4moe's shared experts are whole experts: shared_ffn {spec.shared_ffn} is not a "
                         f"multiple of expert_ffn {spec.expert_ffn}")
    return spec.shared_ffn // spec.expert_ffn


def _gguf_fields(get, meta: dict) -> dict[str, Any]:
    blocks = _in_range(get("block_count"), "block_count", 1, 1 << 16)
    nextn = _in_range(get("nextn_predict_layers", 0), "nextn_predict_layers", 0, blocks - 1)
    n_layers = blocks - nextn
    lead = _in_range(get("leading_dense_block_count", 0), "leading_dense_block_count", 0, n_layers)
    expert_ffn = _int(get("expert_feed_forward_length", 0), "expert_feed_forward_length")
    gating = _int(get("expert_gating_func", SIGMOID), "expert_gating_func")
    if gating not in (SIGMOID, SOFTMAX):
        raise ConfigError(f"'expert_gating_func' {gating} is not softmax ({SOFTMAX}) or sigmoid ({SIGMOID})")
    groups = _int(get("expert_group_count", 1) or 1, "expert_group_count")
    return {
        "n_layers": n_layers,
        "moe_layers": _moe_layers(n_layers, lead),
        "dense_ffn": _int(get("feed_forward_length", 0), "feed_forward_length") if lead else 0,
        "shared_ffn": _int(get("expert_shared_count", 0), "expert_shared_count") * expert_ffn,
        "norm_topk": bool(get("expert_weights_norm", False)),  # llama.cpp's default when the key is absent
        "rope_dim": _int(get("rope.dimension_count", 0), "rope.dimension_count"),
        "router": "sigmoid" if gating == SIGMOID else "softmax",
        "score_bias": True,  # llama.cpp requires exp_probs_b in every MoE layer of glm4moe
        "n_groups": groups,
        "topk_groups": _int(get("expert_group_used_count", 1) or 1, "expert_group_used_count") if groups > 1
        else 1,
        "group_score": "top2",
        "routed_scale": _float(get("expert_weights_scale", 1.0), "expert_weights_scale"),
    }


def _hf_fields(cfg: dict) -> dict[str, Any]:
    rp = rope_params(cfg)
    if rp["rope_type"] != "default":
        raise ConfigError(f"RoPE scaling {rp['rope_type']!r} is not supported for glm4_moe")
    n_layers = _int(cfg["num_hidden_layers"], "num_hidden_layers")
    lead = _in_range(cfg.get("first_k_dense_replace", 1), "first_k_dense_replace", 0, n_layers)
    head_dim = _int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"], "head_dim")
    factor = _float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)),
                    "partial_rotary_factor")
    if not 0 < factor <= 1:
        raise ConfigError(f"'partial_rotary_factor' must be in (0, 1], got {factor}")
    expert_ffn = _int(cfg.get("moe_intermediate_size"), "moe_intermediate_size")
    groups = _int(cfg.get("n_group") or 1, "n_group")
    return {
        "moe_layers": _moe_layers(n_layers, lead),
        "dense_ffn": _int(cfg.get("intermediate_size", 0), "intermediate_size") if lead else 0,
        "shared_ffn": _int(cfg.get("n_shared_experts", 1) or 0, "n_shared_experts") * expert_ffn,
        "qk_norm": "head" if cfg.get("use_qk_norm") else "none",
        "rope_dim": int(head_dim * factor),
        "router": "sigmoid",
        "score_bias": True,
        "n_groups": groups,
        "topk_groups": _int(cfg.get("topk_group") or 1, "topk_group"),
        "group_score": "top2",
        "routed_scale": _float(cfg.get("routed_scaling_factor", 1.0), "routed_scaling_factor"),
    }


def _gguf_keys(spec: ModelSpec) -> dict[str, Any]:
    if spec.router not in ("sigmoid", "softmax") or not spec.score_bias or spec.group_score != "top2":
        raise ValueError("glm4moe routes by sigmoid (or softmax) scores with a correction bias, groups by "
                         "their top 2")
    a = "glm4moe"
    kv = {
        f"{a}.rope.dimension_count": spec.rotary_dim,
        f"{a}.leading_dense_block_count": _leading_dense(spec),
        f"{a}.expert_shared_count": _shared_count(spec),
        f"{a}.expert_gating_func": SIGMOID if spec.router == "sigmoid" else SOFTMAX,
        f"{a}.expert_weights_scale": float(spec.routed_scale),
        f"{a}.expert_weights_norm": spec.norm_topk,
    }
    if spec.n_groups > 1:
        kv |= {f"{a}.expert_group_count": spec.n_groups, f"{a}.expert_group_used_count": spec.topk_groups}
    return kv


FAMILY = Family(
    name="glm4moe", gguf_arch="glm4moe", hf_model_types=("glm4_moe",), norm_topk=True,
    hf_experts_key=("n_routed_experts",),
    gguf_aliases=(("ffn_norm.weight", "blk.{L}.post_attention_norm.weight"),),
    gguf_optional=(("attn_q_norm.weight", "qk_norm", "head"), ("attn_q.bias", "qkv_bias", True)),
    gguf_fields=_gguf_fields, hf_fields=_hf_fields, gguf_keys=_gguf_keys,
)
