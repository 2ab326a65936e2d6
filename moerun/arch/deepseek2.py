"""DeepSeek-V2 / V2-Lite / V3 (and Moonlight, Kimi K2: V3's architecture): transformers
`DeepseekV2ForCausalLM` and `DeepseekV3ForCausalLM`, GGUF arch `deepseek2`, one family as in llama.cpp. What
differs from the shared layers:

- multi-head latent attention (moerun.model.layers): q directly or through a `q_lora_rank` latent (V3, V2;
  not V2-Lite), keys and values from one cached latent of `kv_lora_rank` plus a `qk_rope_dim` rotary key
  shared by the heads; RoPE on the rotary dims only, adjacent pairs (llama.cpp's "norm" RoPE; V3's
  `rope_interleave`).
  GGUF: head_count_kv 1, key_length / value_length the latent's (rank + rope, rank) and key_length_mla /
  value_length_mla the heads' (older files: key_length / value_length the heads', attn_kv_b whole);
- YaRN with DeepSeek's mscale: the softmax scale times mscale(factor, mscale_all_dim)^2 (GGUF
  rope.scaling.yarn_log_multiplier = 0.1 * mscale_all_dim, as llama.cpp's converter writes it);
- leading dense layers (`first_k_dense_replace`; GGUF `leading_dense_block_count`) and `n_shared_experts`
  shared experts of the routed width as one FFN (GGUF `expert_shared_count`), added unscaled;
- routing: V2 softmax over all experts, top-k greedy or within the best `topk_group` of `n_group` groups
  scored by their best expert (`topk_method` group_limited_greedy), not renormalised unless `norm_topk_prob`;
  V3 sigmoid scores, chosen with the `e_score_correction_bias` within the best groups scored by their best
  two, renormalised (`norm_topk_prob`); both times `routed_scaling_factor` (GGUF expert_gating_func,
  expert_weights_norm, expert_weights_scale, expert_group_count / expert_group_used_count, exp_probs_b.bias).
  llama.cpp scores groups by their best two whatever the gating function; the max for V2 is DeepSeek's own;
- transformers ignores V2's norm_topk_prob (every published V2 has it false); DeepSeek's code and llama.cpp
  honour it, and so does moerun;
- next-token-prediction layers (V3's `num_nextn_predict_layers`, stored past num_hidden_layers; GGUF
  nextn_predict_layers) are never run.
"""

from __future__ import annotations

import math
from typing import Any

from moerun.arch.family import ConfigError, Family, _float, _in_range, _int, rope_params, yarn_from_hf
from moerun.arch.spec import ModelSpec, Yarn

SIGMOID, SOFTMAX = 2, 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE values


def _mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def yarn_softmax_scale(head_dim: int, factor: float, mscale_all_dim: float) -> float:
    """DeepSeek's softmax scale under YaRN: head_dim^-0.5 times mscale(factor, mscale_all_dim)^2."""
    return head_dim**-0.5 * _mscale(factor, mscale_all_dim) ** 2


def _moe_layers(n_layers: int, lead: int) -> tuple[bool, ...]:
    return tuple(i >= lead for i in range(n_layers))


def _yarn_from_gguf(get, head_dim: int) -> tuple[Yarn | None, float]:
    """llama.cpp's deepseek2 YaRN: (Yarn, softmax scale). With yarn_log_multiplier L the rotary tables are
    unscaled and the scale is (1 + L ln factor)^2 / sqrt(head_dim); without it both get mscale(factor) (its
    square for the scale); rope.scaling.attn_factor multiplies both (squared in the scale)."""
    kind, factor = get("rope.scaling.type", "linear"), get("rope.scaling.factor", 0.0)
    if kind == "none" or (kind == "linear" and factor in (0, 1, 0.0, 1.0)):  # llama.cpp: no scaling
        return None, 0.0
    if kind != "yarn":
        raise ConfigError(f"RoPE scaling {kind!r} is not supported for deepseek2 (yarn only)")
    factor = _float(factor, "rope.scaling.factor")
    log_mul = _float(get("rope.scaling.yarn_log_multiplier", 0.0), "rope.scaling.yarn_log_multiplier")
    attn = _float(get("rope.scaling.attn_factor", 1.0), "rope.scaling.attn_factor")
    attn *= 1.0 if log_mul else _mscale(factor, 1.0)
    original = _int(get("rope.scaling.original_context_length", get("context_length", 4096)),
                    "rope.scaling.original_context_length")
    beta_fast = _float(get("rope.scaling.yarn_beta_fast", 32.0), "rope.scaling.yarn_beta_fast")
    beta_slow = _float(get("rope.scaling.yarn_beta_slow", 1.0), "rope.scaling.yarn_beta_slow")
    yarn = Yarn(factor, original, beta_fast, beta_slow, attn)
    return yarn, attn**2 * (1 + log_mul * math.log(factor)) ** 2 / math.sqrt(head_dim)


def _gguf_fields(get, meta: dict) -> dict[str, Any]:
    blocks = _in_range(get("block_count"), "block_count", 1, 1 << 16)
    n_layers = blocks - _in_range(get("nextn_predict_layers", 0), "nextn_predict_layers", 0, blocks - 1)
    lead = _in_range(get("leading_dense_block_count", 0), "leading_dense_block_count", 0, n_layers)
    rope = _int(get("rope.dimension_count"), "rope.dimension_count")
    mla = get("attention.key_length_mla") is not None  # else an older file: key/value_length are the heads'
    head_dim = _int(get("attention.key_length_mla" if mla else "attention.key_length"),
                    "attention.key_length_mla")
    expert_ffn = _int(get("expert_feed_forward_length", 0), "expert_feed_forward_length")
    gating = _int(get("expert_gating_func", SOFTMAX), "expert_gating_func")  # llama.cpp's default here
    if gating not in (SIGMOID, SOFTMAX):
        raise ConfigError(f"'expert_gating_func' {gating} is not softmax ({SOFTMAX}) or sigmoid ({SIGMOID})")
    groups = _int(get("expert_group_count", 1) or 1, "expert_group_count")
    yarn, scale = _yarn_from_gguf(get, head_dim)
    return {
        "n_layers": n_layers,
        "moe_layers": _moe_layers(n_layers, lead),
        "dense_ffn": _int(get("feed_forward_length", 0), "feed_forward_length") if lead else 0,
        "shared_ffn": _int(get("expert_shared_count", 0), "expert_shared_count") * expert_ffn,
        "norm_topk": bool(get("expert_weights_norm", False)),
        "n_kv_heads": 1,
        "head_dim": head_dim,
        "rope_style": "interleaved",
        "attention": "mla",
        "q_lora_rank": _int(get("attention.q_lora_rank", 0), "attention.q_lora_rank"),
        "kv_lora_rank": _int(get("attention.kv_lora_rank"), "attention.kv_lora_rank"),
        "qk_nope_dim": head_dim - rope,
        "qk_rope_dim": rope,
        "v_head_dim": _int(get("attention.value_length_mla" if mla else "attention.value_length"),
                           "attention.value_length_mla"),
        "yarn": yarn,
        "attn_scale": scale,
        "router": "sigmoid" if gating == SIGMOID else "softmax",
        "n_groups": groups,
        "topk_groups": _int(get("expert_group_used_count", 1) or 1, "expert_group_used_count") if groups > 1
        else 1,
        "group_score": "top2" if gating == SIGMOID else "max",
        "routed_scale": _float(get("expert_weights_scale", 1.0), "expert_weights_scale"),
    }


def _hf_fields(cfg: dict) -> dict[str, Any]:
    v3 = cfg.get("model_type") != "deepseek_v2"
    n_layers = _int(cfg["num_hidden_layers"], "num_hidden_layers")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ConfigError("DeepSeek projections with biases (attention_bias, mlp_bias) are not supported")
    if _int(cfg.get("moe_layer_freq", 1), "moe_layer_freq") != 1:
        raise ConfigError("'moe_layer_freq' other than 1 is not supported")
    scoring = cfg.get("scoring_func", "sigmoid" if v3 else "softmax")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise ConfigError(f"scoring_func {scoring!r} is not {cfg.get('model_type')}'s")
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if method not in (("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")):
        raise ConfigError(f"topk_method {method!r} is not supported for {cfg.get('model_type')}")
    grouped = v3 or method == "group_limited_greedy"
    lead = _in_range(cfg.get("first_k_dense_replace") or 0, "first_k_dense_replace", 0, n_layers)
    nope = _int(cfg.get("qk_nope_head_dim"), "qk_nope_head_dim")
    rope = _int(cfg.get("qk_rope_head_dim"), "qk_rope_head_dim")
    expert_ffn = _int(cfg.get("moe_intermediate_size"), "moe_intermediate_size")
    yarn = yarn_from_hf(cfg)
    m_all = rope_params(cfg).get("mscale_all_dim") if yarn is not None else None
    scale = yarn_softmax_scale(nope + rope, yarn.factor, _float(m_all, "mscale_all_dim")) if m_all else 0.0
    return {
        "moe_layers": _moe_layers(n_layers, lead),
        "dense_ffn": _int(cfg.get("intermediate_size", 0), "intermediate_size") if lead else 0,
        "shared_ffn": _int(cfg.get("n_shared_experts") or 0, "n_shared_experts") * expert_ffn,
        "norm_topk": bool(cfg.get("norm_topk_prob", v3)),
        "n_kv_heads": 1,
        "head_dim": nope + rope,
        "qkv_bias": False,
        "rope_style": "interleaved" if not v3 or cfg.get("rope_interleave", True) else "neox",
        "attention": "mla",
        "q_lora_rank": _int(cfg.get("q_lora_rank") or 0, "q_lora_rank"),
        "kv_lora_rank": _int(cfg.get("kv_lora_rank"), "kv_lora_rank"),
        "qk_nope_dim": nope,
        "qk_rope_dim": rope,
        "v_head_dim": _int(cfg.get("v_head_dim"), "v_head_dim"),
        "yarn": yarn,
        "attn_scale": scale,
        "router": "sigmoid" if v3 else "softmax",
        "score_bias": v3,
        "n_groups": _int(cfg.get("n_group") or 1, "n_group") if grouped else 1,
        "topk_groups": _int(cfg.get("topk_group") or 1, "topk_group") if grouped else 1,
        "group_score": "top2" if v3 else "max",
        "routed_scale": _float(cfg.get("routed_scaling_factor", 1.0), "routed_scaling_factor"),
    }


def _yarn_keys(a: str, spec: ModelSpec) -> dict[str, Any]:
    """rope.scaling.* for llama.cpp's deepseek2: the rotary tables unscaled and the softmax scale as
    yarn_log_multiplier (what llama.cpp reads both from)."""
    y = spec.yarn
    r = f"{a}.rope.scaling"
    kv = {f"{r}.type": "yarn", f"{r}.factor": float(y.factor),
          f"{r}.original_context_length": y.original_context, f"{r}.yarn_beta_fast": float(y.beta_fast),
          f"{r}.yarn_beta_slow": float(y.beta_slow)}
    m = math.sqrt(spec.softmax_scale * math.sqrt(spec.head_dim))  # mscale(factor, mscale_all_dim)
    log_mul = (m - 1) / math.log(y.factor) if y.factor > 1 else 0.0
    if abs(y.attention_factor - 1) < 1e-6 and abs(log_mul) > 1e-9:
        return kv | {f"{r}.yarn_log_multiplier": log_mul}
    if abs(y.attention_factor - _mscale(y.factor, 1.0)) < 1e-6 and abs(m - y.attention_factor) < 1e-6:
        return kv  # llama.cpp without a multiplier: both scaled by mscale(factor)
    raise ValueError(f"llama.cpp's deepseek2 YaRN cannot express attention factor {y.attention_factor:g} "
                     f"with softmax scale {spec.softmax_scale:g} (it needs mscale = mscale_all_dim)")


def _gguf_keys(spec: ModelSpec) -> dict[str, Any]:
    if spec.attention != "mla" or spec.rope_style != "interleaved":
        raise ValueError("deepseek2 attends through MLA with RoPE on adjacent pairs (a rope_interleave=false "
                         "checkpoint cannot be written for llama.cpp)")
    if spec.router not in ("sigmoid", "softmax") or \
            spec.group_score != ("top2" if spec.router == "sigmoid" else "max"):
        raise ValueError("deepseek2 routes by softmax (groups by their best expert) or sigmoid scores "
                         "(groups by their best two)")
    lead = next((i for i, moe in enumerate(spec.moe_layers) if moe), spec.n_layers)
    if spec.moe_layers != _moe_layers(spec.n_layers, lead):
        raise ValueError("deepseek2's dense layers must all come first (leading_dense_block_count)")
    if spec.expert_ffn <= 0 or spec.shared_ffn % spec.expert_ffn:
        raise ValueError(f"deepseek2's shared experts are whole experts: shared_ffn {spec.shared_ffn} is not "
                         f"a multiple of expert_ffn {spec.expert_ffn}")
    if spec.attn_scale and spec.yarn is None:
        raise ValueError("deepseek2 sets its softmax scale through YaRN's mscale only")
    a, rank = "deepseek2", spec.kv_lora_rank
    kv = {
        f"{a}.leading_dense_block_count": lead,
        f"{a}.attention.kv_lora_rank": rank,
        f"{a}.attention.key_length": rank + spec.qk_rope_dim,
        f"{a}.attention.value_length": rank,
        f"{a}.attention.key_length_mla": spec.head_dim,
        f"{a}.attention.value_length_mla": spec.v_head_dim,
        f"{a}.rope.dimension_count": spec.qk_rope_dim,
        f"{a}.expert_shared_count": spec.shared_ffn // spec.expert_ffn,
        f"{a}.expert_gating_func": SIGMOID if spec.router == "sigmoid" else SOFTMAX,
        f"{a}.expert_weights_scale": float(spec.routed_scale),
        f"{a}.expert_weights_norm": spec.norm_topk,
    }
    # llama.cpp needs the key but at V2-Lite's layer counts (its converter writes it only when set); 0: none
    kv[f"{a}.attention.q_lora_rank"] = spec.q_lora_rank
    if spec.n_groups > 1:
        kv |= {f"{a}.expert_group_count": spec.n_groups, f"{a}.expert_group_used_count": spec.topk_groups}
    if spec.yarn is not None:
        kv |= _yarn_keys(a, spec)
    return kv


FAMILY = Family(
    name="deepseek2", gguf_arch="deepseek2", hf_model_types=("deepseek_v2", "deepseek_v3", "kimi_k2"),
    rope_style="interleaved", norm_topk=False, hf_experts_key=("n_routed_experts",),
    gguf_optional=(("exp_probs_b.bias", "score_bias", True),),
    gguf_fields=_gguf_fields, hf_fields=_hf_fields, gguf_keys=_gguf_keys,
)
