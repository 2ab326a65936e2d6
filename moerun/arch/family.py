"""What distinguishes one MoE family from another, and the shared readers of hyperparameters.

Each family file (qwen3moe.py, ...) declares one `Family`; everything else is common. Hyperparameters
come from GGUF metadata (llama.cpp's keys) or from config.json, never from file names.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from moerun.arch.spec import ModelSpec, Yarn
from moerun.formats.names import HFLayout


@dataclass(frozen=True)
class Family:
    name: str  # moerun's name, e.g. "mixtral"
    gguf_arch: str  # general.architecture, e.g. "llama"
    hf_model_types: tuple[str, ...]  # config.json model_type values
    rope_style: str = "neox"
    qk_norm: str = "none"
    qkv_bias: bool = False
    shared_gate: bool = False
    norm_topk: bool = True  # default when neither the GGUF nor the config says
    norm_topk_fixed: bool = False  # the family always renormalises (mixtral), whatever the config says
    hf_expert_ffn_key: str = "moe_intermediate_size"
    hf_experts_key: tuple[str, ...] = ("num_experts", "num_local_experts")
    hf_permute_qk: bool = False  # HF stores Q/K for rotate-half RoPE; GGUF (canonical) for interleaved
    # What a family has beyond the common hyperparameters, in its own file: ModelSpec fields from GGUF metadata
    # (called with get(key, default) for "{gguf_arch}.key", and the whole metadata) or from config.json, and
    # the extra GGUF keys our writers put in a file of that family.
    gguf_aliases: tuple[tuple[str, str], ...] = ()  # (canonical kind, the family's GGUF name pattern) pairs
    # (canonical kind, ModelSpec field, value): in a GGUF file that holds that tensor, the field takes the value
    # (llama.cpp's optional tensors: GLM-4.5's q/k norms and q/k/v biases)
    gguf_optional: tuple[tuple[str, str, Any], ...] = ()
    hf_aliases: tuple[tuple[str, str, HFLayout], ...] = ()  # (canonical kind, HF pattern, layout): names.parse_hf
    gguf_fields: Callable[[Callable[[str, Any], Any], dict], dict] | None = None
    hf_fields: Callable[[dict], dict] | None = None
    gguf_keys: Callable[[ModelSpec], dict] | None = None
    # the language model's part of config.json (a multimodal checkpoint nests it: Qwen3.5's text_config)
    hf_config: Callable[[dict], dict] | None = None
    # (prefix, replacement) of HF tensor names before the name table reads them (a multimodal checkpoint's
    # model.language_model. -> model.), and prefixes of towers that are skipped with a note
    hf_rename: tuple[tuple[str, str], ...] = ()
    hf_skipped: tuple[tuple[str, str], ...] = ()  # (prefix, what it is)
    # the family's own rewrite of the canonical sources once the spec is known, called with (spec, sources,
    # file format): split fused projections, reorder heads, map stored values (arch/qwen3next.py)
    fix_sources: Callable[[ModelSpec, dict, str], None] | None = None


class ConfigError(ValueError):
    """A hyperparameter is missing or unsupported (the caller names the file)."""


def _need(d: dict, key: str, where: str) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"missing {where} key '{key}'")
    return d[key]


MAX_LAYERS = 1 << 16  # more than any model has; a header claiming more is corrupt (and would be allocated for)


def _int(v: Any, key: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"'{key}' must be an integer, got {_short(v)}")
    return v


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:80] + "..."


def _in_range(v: Any, key: str, lo: int, hi: int) -> int:
    v = _int(v, key)
    if not lo <= v <= hi:
        raise ConfigError(f"'{key}' must be in {lo}..{hi}, got {v}")
    return v


def _float(v: Any, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"'{key}' must be a number, got {_short(v)}")
    return float(v)


def _dict(v: Any, key: str) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(f"'{key}' must be an object, got {_short(v)}")
    return v


def _dense_layers(v: Any) -> set[int]:
    if v is None:
        return set()
    if not isinstance(v, list):
        raise ConfigError(f"'mlp_only_layers' must be a list of layer indices, got {_short(v)}")
    return {_int(i, "mlp_only_layers") for i in v}


def spec_from_gguf(fam: Family, meta: dict[str, Any], moe_layers: tuple[bool, ...], vocab: int) -> ModelSpec:
    a = fam.gguf_arch

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{a}.{key}", default)

    def need(key: str) -> Any:
        return _need(meta, f"{a}.{key}", "GGUF")

    hidden = _int(need("embedding_length"), "embedding_length")
    n_heads = _in_range(need("attention.head_count"), "attention.head_count", 1, 2**31)
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        raise ConfigError("per-layer attention.head_count_kv is not supported")
    expert_ffn = get("expert_feed_forward_length") or get("feed_forward_length", 0)
    rms_eps = _float(need("attention.layer_norm_rms_epsilon"), "attention.layer_norm_rms_epsilon")
    fields = {
        "family": fam.name,
        "n_layers": _in_range(need("block_count"), "block_count", 1, MAX_LAYERS),
        "hidden": hidden,
        "n_heads": n_heads,
        "n_kv_heads": _int(n_kv, "attention.head_count_kv"),
        "head_dim": _int(get("attention.key_length", hidden // n_heads), "attention.key_length"),
        "vocab": vocab,
        "n_experts": _int(get("expert_count", 0), "expert_count"),
        "n_experts_used": _int(get("expert_used_count", 0), "expert_used_count"),
        "expert_ffn": _int(expert_ffn, "expert_feed_forward_length"),
        "moe_layers": moe_layers,
        "dense_ffn": 0 if all(moe_layers) else _int(get("feed_forward_length", 0), "feed_forward_length"),
        "shared_ffn": _int(get("expert_shared_feed_forward_length", 0), "expert_shared_feed_forward_length"),
        "shared_gate": fam.shared_gate,
        "norm_topk": fam.norm_topk if fam.norm_topk_fixed else bool(get("expert_weights_norm", fam.norm_topk)),
        # stored as f32: 1e-6 reads 9.99999997e-07
        "rms_eps": float(f"{rms_eps:.7g}"),
        "rope_theta": _float(get("rope.freq_base", 10000.0), "rope.freq_base"),
        "rope_style": fam.rope_style,
        "qk_norm": fam.qk_norm,
        "qkv_bias": fam.qkv_bias,
        "clip_qkv": get("attention.clamp_kqv"),
        "tie_embeddings": False,  # set by arch.resolve from the tensors present
        "context_length": _int(get("context_length", 4096), "context_length"),
    }
    if fam.gguf_fields is not None:
        fields |= fam.gguf_fields(get, meta)
    return ModelSpec(**fields)


def rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json's RoPE parameters as one dict (transformers 5's rope_parameters, or the older rope_scaling
    beside rope_theta), with rope_type set."""
    rp = dict(_dict(cfg.get("rope_parameters"), "rope_parameters"))
    scaling = _dict(cfg.get("rope_scaling"), "rope_scaling")
    rp = {**scaling, **rp}
    rp["rope_type"] = rp.get("rope_type") or rp.get("type") or "default"
    rp.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return rp


def _rope_theta(cfg: dict[str, Any], fam: Family) -> float:
    rp = rope_params(cfg)
    if rp["rope_type"] != "default" and not (rp["rope_type"] == "yarn" and fam.hf_fields is not None):
        raise ConfigError(f"RoPE scaling {_short(rp['rope_type'])} is not supported yet")
    return _float(rp["rope_theta"], "rope_theta")


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn_from_hf(cfg: dict[str, Any]) -> Yarn | None:
    """YaRN from config.json's RoPE parameters (None for plain RoPE), its attention factor as transformers
    derives it: given, or from mscale / mscale_all_dim, or from the factor."""
    rp = rope_params(cfg)
    if rp["rope_type"] != "yarn":
        return None
    factor = _float(rp.get("factor") or 1.0, "rope factor")
    original = _int(rp.get("original_max_position_embeddings") or cfg.get("max_position_embeddings"),
                    "original_max_position_embeddings")
    attn = rp.get("attention_factor")
    if attn is None:
        m, m_all = rp.get("mscale"), rp.get("mscale_all_dim")
        attn = _mscale(factor, m) / _mscale(factor, m_all) if m and m_all else _mscale(factor)
    return Yarn(factor, original, _float(rp.get("beta_fast") or 32.0, "beta_fast"),
                _float(rp.get("beta_slow") or 1.0, "beta_slow"), _float(attn, "attention_factor"),
                bool(rp.get("truncate", True)))


YARN_KEYS = ("rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
             "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow", "rope.scaling.yarn_attn_factor")


def yarn_from_gguf(get: Callable[[str, Any], Any], truncate: bool = True) -> Yarn | None:
    """YaRN from llama.cpp's `rope.scaling.*` keys (None unless the type is yarn). The attention factor is
    `yarn_attn_factor` when given, else 0.1 ln(factor) + 1 (what llama.cpp and transformers compute); GGUF has no
    key for truncation, so the family says (`truncate`)."""
    kind, factor, original, fast, slow, attn = (get(k, None) for k in YARN_KEYS)
    if kind != "yarn":
        if kind not in (None, "none", "linear") or (kind == "linear" and factor not in (None, 0.0, 1.0)):
            raise ConfigError(f"RoPE scaling {_short(kind)} is not supported yet")
        return None
    factor = _float(factor, "rope.scaling.factor")
    return Yarn(factor, _int(original, "rope.scaling.original_context_length"),
                _float(fast if fast is not None else 32.0, "rope.scaling.yarn_beta_fast"),
                _float(slow if slow is not None else 1.0, "rope.scaling.yarn_beta_slow"),
                _float(attn, "rope.scaling.yarn_attn_factor") if attn is not None else _mscale(factor), truncate)


def yarn_gguf_keys(arch: str, yarn: Yarn | None) -> dict[str, Any]:
    """llama.cpp's `rope.scaling.*` keys for `yarn` (the inverse of yarn_from_gguf; none without YaRN)."""
    if yarn is None:
        return {}
    kv: dict[str, Any] = {f"{arch}.rope.scaling.type": "yarn", f"{arch}.rope.scaling.factor": float(yarn.factor),
                          f"{arch}.rope.scaling.original_context_length": yarn.original_context}
    if yarn.beta_fast != 32.0 or yarn.beta_slow != 1.0:
        kv |= {f"{arch}.rope.scaling.yarn_beta_fast": float(yarn.beta_fast),
               f"{arch}.rope.scaling.yarn_beta_slow": float(yarn.beta_slow)}
    if abs(yarn.attention_factor - _mscale(yarn.factor)) > 1e-6:
        kv[f"{arch}.rope.scaling.yarn_attn_factor"] = float(yarn.attention_factor)
    return kv


def spec_from_hf(fam: Family, cfg: dict[str, Any]) -> ModelSpec:
    if cfg.get("use_sliding_window"):
        raise ConfigError("sliding-window attention is not supported yet")
    n_layers = _in_range(_need(cfg, "num_hidden_layers", "config.json"), "num_hidden_layers", 1, MAX_LAYERS)
    hidden = _int(_need(cfg, "hidden_size", "config.json"), "hidden_size")
    n_heads = _in_range(_need(cfg, "num_attention_heads", "config.json"), "num_attention_heads", 1, 2**31)
    n_experts = next((cfg[k] for k in fam.hf_experts_key if cfg.get(k)), None)
    if n_experts is None:
        raise ConfigError(f"missing config.json key '{fam.hf_experts_key[0]}'")
    step = _in_range(cfg.get("decoder_sparse_step") or 1, "decoder_sparse_step", 1, MAX_LAYERS)
    dense = _dense_layers(cfg.get("mlp_only_layers"))
    moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers))
    norm_topk = fam.norm_topk if fam.norm_topk_fixed else bool(cfg.get("norm_topk_prob", fam.norm_topk))
    fields = {
        "family": fam.name,
        "n_layers": n_layers,
        "hidden": hidden,
        "n_heads": n_heads,
        "n_kv_heads": _int(cfg.get("num_key_value_heads") or n_heads, "num_key_value_heads"),
        "head_dim": _int(cfg.get("head_dim") or hidden // n_heads, "head_dim"),
        "vocab": _int(_need(cfg, "vocab_size", "config.json"), "vocab_size"),
        "n_experts": _int(n_experts, "num_experts"),
        "n_experts_used": _int(_need(cfg, "num_experts_per_tok", "config.json"), "num_experts_per_tok"),
        "expert_ffn": _int(_need(cfg, fam.hf_expert_ffn_key, "config.json"), fam.hf_expert_ffn_key),
        "moe_layers": moe_layers,
        "dense_ffn": _int(cfg.get("intermediate_size", 0) if not all(moe_layers) else 0, "intermediate_size"),
        "shared_ffn": _int(cfg.get("shared_expert_intermediate_size", 0) or 0,
                           "shared_expert_intermediate_size"),
        "shared_gate": fam.shared_gate,
        "norm_topk": norm_topk,
        "rms_eps": _float(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
        "rope_theta": _rope_theta(cfg, fam),
        "rope_style": fam.rope_style,
        "qk_norm": fam.qk_norm,
        "qkv_bias": bool(cfg.get("qkv_bias", cfg.get("attention_bias", fam.qkv_bias))),
        "clip_qkv": cfg.get("clip_qkv"),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "context_length": _int(cfg.get("max_position_embeddings", 4096), "max_position_embeddings"),
    }
    if fam.hf_fields is not None:
        fields |= fam.hf_fields(cfg)
    return ModelSpec(**fields)


def gguf_metadata(fam: Family, spec: ModelSpec) -> dict[str, Any]:
    """llama.cpp's hyperparameter keys for `spec` (what our writers put in a GGUF file)."""
    a = fam.gguf_arch
    kv: dict[str, Any] = {
        "general.architecture": a,
        f"{a}.block_count": spec.n_layers,
        f"{a}.context_length": spec.context_length,
        f"{a}.embedding_length": spec.hidden,
        f"{a}.feed_forward_length": spec.dense_ffn or spec.expert_ffn,
        f"{a}.attention.head_count": spec.n_heads,
        f"{a}.attention.head_count_kv": spec.n_kv_heads,
        f"{a}.attention.key_length": spec.head_dim,
        f"{a}.attention.value_length": spec.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": spec.rms_eps,
        f"{a}.rope.freq_base": spec.rope_theta,
        f"{a}.rope.dimension_count": spec.head_dim,
        f"{a}.vocab_size": spec.vocab,
        f"{a}.expert_count": spec.n_experts,
        f"{a}.expert_used_count": spec.n_experts_used,
        f"{a}.expert_feed_forward_length": spec.expert_ffn,
        f"{a}.expert_weights_norm": spec.norm_topk,
    }
    if spec.shared_ffn:
        kv[f"{a}.expert_shared_feed_forward_length"] = spec.shared_ffn
    if spec.clip_qkv is not None:
        kv[f"{a}.attention.clamp_kqv"] = float(spec.clip_qkv)
    if fam.gguf_keys is not None:
        kv |= fam.gguf_keys(spec)
    return kv


def with_family_defaults(fam: Family, spec: ModelSpec) -> ModelSpec:
    """`spec` with the family's fixed traits (used by tools that build a spec by hand)."""
    return replace(spec, family=fam.name, rope_style=fam.rope_style, qk_norm=fam.qk_norm,
                   shared_gate=fam.shared_gate)
