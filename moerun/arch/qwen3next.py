"""Qwen3-Next (transformers `Qwen3NextForCausalLM`, GGUF arch `qwen3next`): a hybrid of gated DeltaNet (linear
attention) layers and gated full-attention layers, three to one. What differs from the shared layers:

- layer kinds: "linear" where config.json's `layer_types` says `linear_attention` (else every
  `full_attention_interval`-th layer is attention, 4 by default); GGUF: `attention.recurrent_layers` (flags) or
  `full_attention_interval`, as llama.cpp reads them;
- linear layers (moerun.model.deltanet): q/k/v through a causal conv1d of width `ssm.conv_kernel`, the delta
  rule over `ssm.group_count` key heads of `ssm.state_size` and `ssm.time_step_rank` value heads of
  `ssm.inner_size / time_step_rank`, the gated RMS norm, the output projection;
- attention layers: q also gives a per-head output gate (attn_gate: q_proj is [heads * 2 * head_dim]),
  per-head q/k norms, partial rotary (`partial_rotary_factor`, 0.25 by default; GGUF `rope.dimension_count`);
- a shared expert scaled by sigmoid(x @ w) beside the routed ones, top-k always renormalised;
- llama.cpp names the pre-FFN norm `blk.N.post_attention_norm`;
- HF stores RMS norm weights as w - 1 (it computes (1 + w) * x) and the decay as A_log; llama.cpp's GGUF as w
  and -exp(A_log) (`ssm_a`): canonical tensors are GGUF's, so the HF sources map their values (the gated
  norm's weight is plain in both);
- HF's `in_proj_qkvz` (and older GGUFs' `ssm_in`) holds [q, k, v, z] per key head: split into attn_qkv (all
  q, all k, all v: the conv1d's channel order) and attn_gate (z); `in_proj_ba` / `ssm_ba` holds [b, a] per key
  head: kept whole (ssm_ba), split after the product;
- the multi-token-prediction layers (`mtp.*` in HF, the last `nextn_predict_layers` GGUF blocks) never run.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from moerun.arch.family import ConfigError, Family, _in_range, _int, rope_params
from moerun.arch.spec import ModelSpec
from moerun.arch.tensors import Source, TensorError
from moerun.formats.names import CName

HF_KINDS = {"linear_attention": "linear", "full_attention": "full"}
TRAITS = {"attn_gate": True, "qk_norm": "head", "shared_gate": True, "norm_topk": True}
# norms HF keeps as w - 1 (Qwen3NextRMSNorm: (1 + w) * x); the gated norm (ssm_norm) is plain
ZERO_CENTERED = ("attn_norm.weight", "ffn_norm.weight", "output_norm.weight", "attn_q_norm.weight",
                 "attn_k_norm.weight")


def interval_kinds(n_layers: int, interval: int) -> tuple[str, ...]:
    return tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(n_layers))


def gguf_fields(get, meta: dict) -> dict[str, Any]:
    blocks = _in_range(get("block_count"), "block_count", 1, 1 << 16)
    n_layers = blocks - _in_range(get("nextn_predict_layers", 0), "nextn_predict_layers", 0, blocks - 1)
    flags = get("attention.recurrent_layers")
    if flags is not None:
        if not isinstance(flags, list) or len(flags) < n_layers or not all(isinstance(f, bool) for f in flags):
            raise ConfigError(f"'attention.recurrent_layers' must have a flag for each of {n_layers} layers")
        kinds = tuple("linear" if f else "full" for f in flags[:n_layers])
    else:
        kinds = interval_kinds(n_layers, _in_range(get("full_attention_interval", 4), "full_attention_interval",
                                                   1, 1 << 16))
    v_heads = _in_range(get("ssm.time_step_rank"), "ssm.time_step_rank", 1, 1 << 20)
    inner = _int(get("ssm.inner_size"), "ssm.inner_size")
    if inner % v_heads:
        raise ConfigError(f"'ssm.inner_size' {inner} is not a multiple of 'ssm.time_step_rank' {v_heads}")
    return TRAITS | {
        "n_layers": n_layers,
        "moe_layers": (True,) * n_layers,
        "layer_kinds": kinds,
        "rope_dim": _int(get("rope.dimension_count", 0), "rope.dimension_count"),
        "ssm_conv": _in_range(get("ssm.conv_kernel"), "ssm.conv_kernel", 1, 1 << 10),
        "ssm_k_heads": _in_range(get("ssm.group_count"), "ssm.group_count", 1, 1 << 20),
        "ssm_v_heads": v_heads,
        "ssm_k_dim": _in_range(get("ssm.state_size"), "ssm.state_size", 1, 1 << 16),
        "ssm_v_dim": inner // v_heads,
    }


def hf_fields(cfg: dict) -> dict[str, Any]:
    rp = rope_params(cfg)
    if rp["rope_type"] != "default":
        raise ConfigError(f"RoPE scaling {rp['rope_type']!r} is not supported for {cfg.get('model_type')}")
    n_layers = _int(cfg["num_hidden_layers"], "num_hidden_layers")
    types = cfg.get("layer_types")
    if types is None:
        kinds = interval_kinds(n_layers, _in_range(cfg.get("full_attention_interval", 4), "full_attention_interval",
                                                   1, 1 << 16))
    elif not isinstance(types, list) or len(types) != n_layers or not set(types) <= set(HF_KINDS):
        raise ConfigError(f"'layer_types' must give one of {sorted(HF_KINDS)} for each of {n_layers} layers")
    else:
        kinds = tuple(HF_KINDS[t] for t in types)
    head_dim = _int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"], "head_dim")
    factor = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ConfigError(f"'partial_rotary_factor' must be in (0, 1], got {factor!r}")
    if cfg.get("attention_bias"):
        raise ConfigError("attention biases are not supported for this family")
    return TRAITS | {
        "layer_kinds": kinds,
        "rope_dim": int(head_dim * factor),
        "qkv_bias": False,
        "ssm_conv": _int(cfg.get("linear_conv_kernel_dim", 4), "linear_conv_kernel_dim"),
        "ssm_k_heads": _int(cfg.get("linear_num_key_heads", 16), "linear_num_key_heads"),
        "ssm_v_heads": _int(cfg.get("linear_num_value_heads", 32), "linear_num_value_heads"),
        "ssm_k_dim": _int(cfg.get("linear_key_head_dim", 128), "linear_key_head_dim"),
        "ssm_v_dim": _int(cfg.get("linear_value_head_dim", 128), "linear_value_head_dim"),
    }


def gguf_keys(spec: ModelSpec, arch: str) -> dict[str, Any]:
    a = arch
    kinds = spec.layer_kinds or ("full",) * spec.n_layers
    kv = {
        f"{a}.rope.dimension_count": spec.rotary_dim,
        f"{a}.ssm.conv_kernel": spec.ssm_conv,
        f"{a}.ssm.state_size": spec.ssm_k_dim,
        f"{a}.ssm.group_count": spec.ssm_k_heads,
        f"{a}.ssm.time_step_rank": spec.ssm_v_heads,
        f"{a}.ssm.inner_size": spec.ssm_value_dim,
        f"{a}.full_attention_interval": 4,
    }
    if kinds != interval_kinds(spec.n_layers, 4):
        kv[f"{a}.attention.recurrent_layers"] = [k == "linear" for k in kinds]
    return kv


def qkvz_rows(spec: ModelSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Rows of a fused [q, k, v, z]-per-key-head projection (HF's in_proj_qkvz) that make attn_qkv (all q, all
    k, all v) and attn_gate (all z), value heads kept in HF's grouped order."""
    nk, dk = spec.ssm_k_heads, spec.ssm_k_dim
    vz = spec.ssm_v_heads // nk * spec.ssm_v_dim  # one key head's values (and gates)
    per = 2 * dk + 2 * vz

    def part(lo: int, n: int) -> list[int]:
        return [g * per + lo + j for g in range(nk) for j in range(n)]

    return tuple(part(0, dk) + part(dk, dk) + part(2 * dk, vz)), tuple(part(2 * dk + vz, vz))


def fix_sources(spec: ModelSpec, sources: dict[CName, Source], fmt: str) -> None:
    """HF's stored values to GGUF's (norms, A_log), fused q/k/v/z split; both formats."""
    qkv_rows, z_rows = qkvz_rows(spec)
    for i in range(spec.n_layers):
        fused = sources.pop(CName("attn_qkvz.weight", i), None)
        if fused is not None:
            if CName("attn_qkv.weight", i) in sources:
                raise TensorError(f"layer {i} has both a fused q/k/v/z projection and attn_qkv")
            sources[CName("attn_qkv.weight", i)] = replace(fused, rows=qkv_rows)
            sources[CName("attn_gate.weight", i)] = replace(fused, rows=z_rows)
    if fmt == "gguf":
        return
    for cn, src in list(sources.items()):
        if cn.kind in ZERO_CENTERED:
            sources[cn] = replace(src, values="plus_one")
        elif cn.kind == "ssm_a":
            sources[cn] = replace(src, values="neg_exp")
        elif cn.kind == "ssm_conv1d.weight" and len(src.records[0].shape) == 3:  # [C, 1, K]
            shape = src.records[0].shape
            sources[cn] = replace(src, reshape=(shape[0], shape[2]))


FAMILY = Family(
    name="qwen3next", gguf_arch="qwen3next", hf_model_types=("qwen3_next",), norm_topk=True, norm_topk_fixed=True,
    qk_norm="head", shared_gate=True,
    gguf_aliases=(("ffn_norm.weight", "blk.{L}.post_attention_norm.weight"),),
    gguf_fields=lambda get, meta: gguf_fields(get, meta) | {"ssm_ba": True},
    hf_fields=lambda cfg: hf_fields(cfg) | {"ssm_ba": True},
    gguf_keys=lambda spec: gguf_keys(spec, "qwen3next"), fix_sources=fix_sources,
)
