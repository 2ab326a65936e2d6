"""gpt-oss (transformers `GptOssForCausalLM`, GGUF arch `gpt-oss`): what differs from the shared layers.

- attention sinks (a learned logit per head in the softmax's denominator: `self_attn.sinks` ->
  `attn_sinks.weight`), biases on q/k/v and on the output projection;
- sliding-window attention on the layers `layer_types` marks (GGUF: `attention.sliding_window`, and llama.cpp's
  pattern: layer i slides when i % n < n - 1, n = `attention.sliding_window_pattern`, 2 when absent);
- YaRN RoPE on neox halves (`rope_parameters`; GGUF `rope.scaling.*`). gpt-oss's config says `truncate: false`
  (the correction range is not rounded to whole dimensions) and GGUF has no key for it, so a gpt-oss GGUF is read
  with the checkpoints' value (llama.cpp rounds it: its frequencies differ slightly between those dimensions);
- the router has a bias and takes the top k of its logits, then a softmax over those k (llama.cpp's
  SOFTMAX_WEIGHT gating);
- every expert has biases on its three projections, and the clamped SwiGLU: g = min(g, limit),
  u = clamp(u, -limit, limit), h = g * sigmoid(alpha g) * (u + 1) (alpha 1.702, limit 7: llama.cpp has them as
  constants, so a GGUF carries no key for them);
- checkpoints store the experts fused and transposed (`gate_up_proj` [E, H, 2I], gate and up interleaved
  column by column, `down_proj` [E, I, H], biases `gate_up_proj_bias` / `down_proj_bias`), the published ones in
  MXFP4 (`*_blocks` / `*_scales`, [E, rows, in / 32, 16] and [E, rows, in / 32], rows not transposed), read here
  as GGUF's MXFP4 without rounding anything;
- llama.cpp names the pre-FFN norm `blk.N.post_attention_norm` and the router `ffn_gate_inp` (with a bias).
"""

from __future__ import annotations

from typing import Any

from moerun.arch.family import (
    ConfigError,
    Family,
    _float,
    _in_range,
    _int,
    rope_params,
    yarn_from_gguf,
    yarn_from_hf,
    yarn_gguf_keys,
)
from moerun.formats.names import HFLayout

ALPHA, LIMIT = 1.702, 7.0  # llama.cpp's constants for gpt-oss's clamped SwiGLU
KINDS = {"sliding_attention": "sliding", "full_attention": "full"}
# transformers' GptOssConfig defaults, for a config.json that leaves RoPE out
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
DEFAULT_THETA = 150000.0

_E = "model.layers.{L}.mlp.experts."
HF_ALIASES = (
    ("ffn_gate_exps.weight", _E + "gate_up_proj", HFLayout(chunk=0, interleaved=True, transposed=True)),
    ("ffn_up_exps.weight", _E + "gate_up_proj", HFLayout(chunk=1, interleaved=True, transposed=True)),
    ("ffn_down_exps.weight", _E + "down_proj", HFLayout(transposed=True)),
    ("ffn_gate_exps.bias", _E + "gate_up_proj_bias", HFLayout(chunk=0, dim=-1, interleaved=True)),
    ("ffn_up_exps.bias", _E + "gate_up_proj_bias", HFLayout(chunk=1, dim=-1, interleaved=True)),
    ("ffn_down_exps.bias", _E + "down_proj_bias", HFLayout()),
    ("ffn_gate_exps.weight", _E + "gate_up_proj_blocks", HFLayout(chunk=0, interleaved=True, mxfp4="blocks")),
    ("ffn_gate_exps.weight", _E + "gate_up_proj_scales", HFLayout(chunk=0, interleaved=True, mxfp4="scales")),
    ("ffn_up_exps.weight", _E + "gate_up_proj_blocks", HFLayout(chunk=1, interleaved=True, mxfp4="blocks")),
    ("ffn_up_exps.weight", _E + "gate_up_proj_scales", HFLayout(chunk=1, interleaved=True, mxfp4="scales")),
    ("ffn_down_exps.weight", _E + "down_proj_blocks", HFLayout(mxfp4="blocks")),
    ("ffn_down_exps.weight", _E + "down_proj_scales", HFLayout(mxfp4="scales")),
)

# what every gpt-oss has, whichever file it comes from
TRAITS = {"attn_sinks": True, "attn_out_bias": True, "router": "topk_softmax", "router_bias": True,
          "expert_act": "swiglu_oai", "expert_bias": True, "norm_topk": False}


def _pattern_kinds(n_layers: int, pattern: Any) -> tuple[str, ...]:
    """llama.cpp's sliding-window pattern: per-layer flags, or n (layer i slides when i % n < n - 1)."""
    if isinstance(pattern, list):
        if len(pattern) != n_layers or not all(isinstance(p, bool) for p in pattern):
            raise ConfigError(f"'attention.sliding_window_pattern' must have a flag for each of {n_layers} layers")
        return tuple("sliding" if p else "full" for p in pattern)
    n = _in_range(pattern, "attention.sliding_window_pattern", 0, 1 << 16)
    return tuple("sliding" if n == 0 or i % n < n - 1 else "full" for i in range(n_layers))


def _gguf_fields(get, meta: dict) -> dict[str, Any]:
    n_layers = _in_range(get("block_count"), "block_count", 1, 1 << 16)
    yarn = yarn_from_gguf(get, truncate=False)
    return TRAITS | {
        "sliding_window": _in_range(get("attention.sliding_window"), "attention.sliding_window", 1, 1 << 30),
        "layer_kinds": _pattern_kinds(n_layers, get("attention.sliding_window_pattern", 2)),
        "yarn": yarn,
    }


def _hf_fields(cfg: dict) -> dict[str, Any]:
    if cfg.get("rope_parameters") is None and cfg.get("rope_scaling") is None:
        cfg = cfg | {"rope_parameters": DEFAULT_ROPE | {"rope_theta": cfg.get("rope_theta", DEFAULT_THETA)}}
    rp = rope_params(cfg)
    if rp["rope_type"] not in ("yarn", "default"):
        raise ConfigError(f"RoPE scaling {rp['rope_type']!r} is not supported for gpt_oss")
    n_layers = _int(cfg["num_hidden_layers"], "num_hidden_layers")
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or not set(types) <= set(KINDS):
        raise ConfigError(f"'layer_types' must give one of {sorted(KINDS)} for each of {n_layers} layers")
    window = cfg.get("sliding_window")
    bias = bool(cfg.get("attention_bias", True))
    return TRAITS | {
        "layer_kinds": tuple(KINDS[t] for t in types),
        "sliding_window": _int(window, "sliding_window") if "sliding_attention" in types else 0,
        "yarn": yarn_from_hf(cfg),
        "rope_theta": _float(rp.get("rope_theta") or DEFAULT_THETA, "rope_theta"),
        "rms_eps": _float(cfg.get("rms_norm_eps", 1e-5), "rms_norm_eps"),
        "qkv_bias": bias,
        "attn_out_bias": bias,
        "swiglu_alpha": _float(cfg.get("swiglu_alpha", ALPHA), "swiglu_alpha"),
        "swiglu_limit": _float(cfg.get("swiglu_limit", LIMIT), "swiglu_limit"),
    }


def _gguf_keys(spec) -> dict[str, Any]:
    wrong = {k: getattr(spec, k) for k, v in TRAITS.items() if k != "norm_topk" and getattr(spec, k) != v}
    if wrong or (spec.swiglu_alpha, spec.swiglu_limit) != (ALPHA, LIMIT):
        raise ValueError(f"a gpt-oss GGUF cannot say {wrong or 'swiglu alpha / limit'} (llama.cpp's gpt-oss has "
                         f"sinks, biases, top-k-softmax routing and the clamped SwiGLU with alpha {ALPHA}, limit "
                         f"{LIMIT})")
    a = "gpt-oss"
    kv: dict[str, Any] = {f"{a}.attention.sliding_window": spec.sliding_window or spec.context_length}
    kinds = spec.layer_kinds or ("full",) * spec.n_layers
    if kinds != _pattern_kinds(spec.n_layers, 2):
        kv[f"{a}.attention.sliding_window_pattern"] = [k == "sliding" for k in kinds]
    return kv | yarn_gguf_keys(a, spec.yarn)


FAMILY = Family(
    name="gptoss", gguf_arch="gpt-oss", hf_model_types=("gpt_oss",), norm_topk=False,
    hf_expert_ffn_key="intermediate_size", hf_experts_key=("num_local_experts",),
    gguf_aliases=(("ffn_norm.weight", "blk.{L}.post_attention_norm.weight"),),
    gguf_optional=(("attn_q.bias", "qkv_bias", True),),
    hf_aliases=HF_ALIASES, gguf_fields=_gguf_fields, hf_fields=_hf_fields, gguf_keys=_gguf_keys,
)
