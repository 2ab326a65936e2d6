"""Named model shapes as ModelSpec builders, with overrides of any ModelSpec field.

    preset("tiny-qwen3moe")                      # hidden 64, 2 layers, 8 experts, top-2
    preset("a3b-L4", n_layers=6)                 # Qwen3-30B-A3B's layer shape, 6 layers
    preset("tiny-mixtral", layers=3, vocab=1024) # short aliases: see ALIASES
    preset("qwen3moe-30b", experts=128)          # Qwen3-30B-A3B whole: every layer, vocabulary and expert

The tiny shapes are what the tests write on the fly; `a3b-*` is the benchmark shape (DESIGN.md), `v2lite-*`
DeepSeek-V2-Lite's, `next-*` Qwen3-Next-80B-A3B's and `q35-*` Qwen3.5-35B-A3B's (hybrids: three linear-attention
layers to one attention layer); those keep a few layers and a small vocabulary.

Full depth (FULL_DEPTH: name -> the real model's routed expert count): every layer and the real vocabulary, for
benchmarks against llama.cpp on the same files:

    qwen3moe-30b   Qwen3-30B-A3B        48 layers, vocab 151,936, 32 of 128 experts (top-8 of 768)
    qwen35moe-35b  Qwen3.5-35B-A3B      40 layers, vocab 248,320, 32 of 256 experts (top-8 of 512)
    gptoss-20b     gpt-oss-20b          24 layers, vocab 201,088, all 32 experts (top-4 of 2880)
    glm45-air      GLM-4.5-Air          46 layers (the first dense), vocab 151,552, 10 of 128 experts (top-8 of 1408)
    v2lite         DeepSeek-V2-Lite     27 layers (the first dense), vocab 102,400, 16 of 64 experts (top-6 of 1408)

Routed experts are fewer than the real model's (so a quantized file and a second engine's copy of it fit in 24 GiB
of RAM), never fewer than top-k: everything a decode step reads (attention, top-k experts of the real width, shared
experts, dense layers, the head) is the real model's, so the weight bytes read per token match it but for the
routers: each MoE layer's [experts, hidden] F32 matrix, read whole, is smaller (a token reads 1-4% fewer bytes:
Qwen3.5-35B-A3B at Q4_K_M 1.90 GB where the real one reads 1.98 GB). The files are much smaller (Q4_K_M: 5.4 GB,
4.0 GB, 10.1 GB and 3.5 GB; gpt-oss-20b, the real model, 12.1 GB in MXFP4). `experts=N` (make-model `--experts
N`) gives more, FULL_DEPTH[name] the real count. bench/full_depth.py writes them through llama.cpp's quantizer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from moerun.arch import FAMILIES, ModelSpec, gptoss, qwen3next
from moerun.arch.deepseek2 import yarn_softmax_scale
from moerun.arch.family import with_family_defaults
from moerun.arch.spec import Yarn

__all__ = ["ALIASES", "FULL_DEPTH", "PRESETS", "apply_overrides", "preset", "preset_names"]

# Short override names (command-line flags) -> ModelSpec fields.
ALIASES = {
    "layers": "n_layers", "heads": "n_heads", "kv_heads": "n_kv_heads", "experts": "n_experts",
    "experts_used": "n_experts_used", "top_k": "n_experts_used", "ffn": "expert_ffn", "context": "context_length",
    "eps": "rms_eps", "theta": "rope_theta",
}

# Per-family traits of the tiny shapes: (rms eps, rope theta, shared expert FFN width).
_TINY_TRAITS = {
    "qwen3moe": (1e-6, 1e6, 0),
    "qwen2moe": (1e-6, 1e6, 64),
    "mixtral": (1e-5, 1e6, 0),
    "olmoe": (1e-5, 1e4, 0),
}


def _family_spec(family: str, **fields: Any) -> ModelSpec:
    """A ModelSpec of `family` with that family's fixed traits (RoPE style, q/k norm, biases, routing)."""
    fam = FAMILIES[family]
    n_layers = fields["n_layers"]
    base = {"family": family, "moe_layers": (True,) * n_layers, "norm_topk": fam.norm_topk,
            "qkv_bias": fam.qkv_bias, "rope_style": fam.rope_style, "qk_norm": fam.qk_norm,
            "shared_gate": fam.shared_gate}
    return with_family_defaults(fam, ModelSpec(**(base | fields)))


def _tiny(family: str) -> ModelSpec:
    eps, theta, shared = _TINY_TRAITS[family]
    return _family_spec(family, n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, vocab=512,
                        n_experts=8, n_experts_used=2, expert_ffn=32, shared_ffn=shared, rms_eps=eps,
                        rope_theta=theta, context_length=4096)


def _tiny_glm4moe() -> ModelSpec:
    """GLM-4.5's features at the tiny size: a leading dense layer, two shared experts, half-rotary heads with q/k
    norms and biases, the sigmoid router with a correction bias over 4 groups of 2 experts (best 2 groups kept)
    and a routed scale."""
    spec = _family_spec("glm4moe", n_layers=3, moe_layers=(False, True, True), hidden=64, n_heads=4, n_kv_heads=2,
                        head_dim=16, vocab=512, n_experts=8, n_experts_used=2, expert_ffn=32, shared_ffn=64,
                        dense_ffn=96, rms_eps=1e-5, rope_theta=1e6, context_length=4096, qkv_bias=True,
                        rope_dim=8, router="sigmoid", score_bias=True, n_groups=4, topk_groups=2,
                        group_score="top2", routed_scale=2.5)
    return dataclasses.replace(spec, qk_norm="head")  # GLM-4.5's q/k norm (GLM-4.5-Air has none)


def _deepseek(v3: bool, **fields: Any) -> ModelSpec:
    """DeepSeek's MLA with YaRN (factor and mscale_all_dim as V2-Lite / V3 set them), a leading dense layer
    and two shared experts; V2: softmax routing, greedy, not renormalised; V3: the q latent, sigmoid routing
    with a correction bias within the best groups, renormalised, a routed scale."""
    head_dim = fields["qk_nope_dim"] + fields["qk_rope_dim"]
    m_all = 1.0 if v3 else 0.707
    yarn = Yarn(40.0, fields.pop("original_context"), attention_factor=1.0)
    routing = {"router": "sigmoid", "score_bias": True, "norm_topk": True, "n_groups": 4, "topk_groups": 2,
               "group_score": "top2", "routed_scale": 2.5} if v3 else {"norm_topk": False}
    return _family_spec("deepseek2", n_kv_heads=1, head_dim=head_dim, attention="mla", yarn=yarn,
                        attn_scale=yarn_softmax_scale(head_dim, yarn.factor, m_all), rms_eps=1e-6,
                        rope_theta=10000.0, **(routing | fields))


def _tiny_deepseek(v3: bool) -> ModelSpec:
    return _deepseek(v3, n_layers=3, moe_layers=(False, True, True), hidden=64, n_heads=4, vocab=512,
                     n_experts=8, n_experts_used=2, expert_ffn=32, shared_ffn=64, dense_ffn=96,
                     context_length=4096, original_context=256, q_lora_rank=24 if v3 else 0, kv_lora_rank=32,
                     qk_nope_dim=16, qk_rope_dim=8, v_head_dim=16)


def _v2_lite(n_layers: int) -> ModelSpec:
    """DeepSeek-V2-Lite's shape (27 layers there), with its vocabulary."""
    return _deepseek(False, n_layers=n_layers, moe_layers=(False,) + (True,) * (n_layers - 1), hidden=2048,
                     n_heads=16, vocab=102400, n_experts=64, n_experts_used=6, expert_ffn=1408,
                     shared_ffn=2816, dense_ffn=10944, context_length=163840, original_context=4096,
                     kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128)


def _gptoss(n_layers: int, window: int, yarn: Yarn, **dims: Any) -> ModelSpec:
    """gpt-oss's traits: sinks, biases everywhere, sliding windows on even layers, YaRN, top-k-softmax routing,
    the clamped SwiGLU."""
    kinds = tuple("sliding" if i % 2 == 0 else "full" for i in range(n_layers))
    return _family_spec("gptoss", n_layers=n_layers, qkv_bias=True, rms_eps=1e-5, rope_theta=150000.0,
                        sliding_window=window, layer_kinds=kinds, yarn=yarn, **(gptoss.TRAITS | dims))


def _tiny_gptoss() -> ModelSpec:
    """gpt-oss at the tiny size: a window of 8 (shorter than the tests' prompts), YaRN x4 over 512 positions."""
    return _gptoss(2, 8, Yarn(4.0, 512, attention_factor=0.1 * math.log(4.0) + 1, truncate=False), hidden=64,
                   n_heads=4, n_kv_heads=2, head_dim=16, vocab=512, n_experts=8, n_experts_used=2, expert_ffn=32,
                   context_length=2048)


def _gptoss_20b(n_layers: int = 24) -> ModelSpec:
    """gpt-oss-20b's shape (openai/gpt-oss-20b's config.json): 64 query heads, 8 KV heads of 64, 32 experts top-4 of
    width 2880, vocabulary 201088, window 128 on even layers, YaRN x32 over 4096."""
    return _gptoss(n_layers, 128, Yarn(32.0, 4096, attention_factor=0.1 * math.log(32.0) + 1, truncate=False),
                   hidden=2880, n_heads=64, n_kv_heads=8, head_dim=64, vocab=201088, n_experts=32, n_experts_used=4,
                   expert_ffn=2880, context_length=131072)


def _hybrid(family: str, n_layers: int, **dims: Any) -> ModelSpec:
    """Qwen3-Next's traits (qwen3next) or Qwen3.5's (qwen35moe): every 4th layer gated attention with partial
    rotary, the others gated DeltaNet; a gated shared expert. qwen3next: beta and alpha from one projection;
    qwen35moe: value heads in llama.cpp's tiled order."""
    own = {"ssm_ba": True} if family == "qwen3next" else {"ssm_v_order": "tiled"}
    return _family_spec(family, n_layers=n_layers, layer_kinds=qwen3next.interval_kinds(n_layers, 4),
                        **(qwen3next.TRAITS | own | dims))


def _tiny_hybrid(family: str) -> ModelSpec:
    """The tiny shape with 4 layers (linear, linear, linear, full), 2 key heads of 8 and 4 value heads of 16 (two
    value heads per key head: the grouped and tiled orders differ), a quarter of each head rotated."""
    return _hybrid(family, 4, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, vocab=512, n_experts=8,
                   n_experts_used=2, expert_ffn=32, shared_ffn=48, rope_dim=4, rms_eps=1e-6,
                   rope_theta=1e6 if family == "qwen3next" else 1e4, context_length=4096, ssm_conv=4,
                   ssm_k_heads=2, ssm_v_heads=4, ssm_k_dim=8, ssm_v_dim=16)


def _next_80b(n_layers: int) -> ModelSpec:
    """Qwen3-Next-80B-A3B's layer shape (48 layers there), with a small vocabulary as a3b-*: 16 query heads and 2 KV
    heads of 256 (64 rotated), 512 experts top-10 of width 512, a shared expert of 512; linear layers of 16 key
    heads and 32 value heads of 128, conv width 4."""
    return _hybrid("qwen3next", n_layers, hidden=2048, n_heads=16, n_kv_heads=2, head_dim=256, rope_dim=64,
                   vocab=1024, n_experts=512, n_experts_used=10, expert_ffn=512, shared_ffn=512, rms_eps=1e-6,
                   rope_theta=1e7, context_length=262144, ssm_conv=4, ssm_k_heads=16, ssm_v_heads=32,
                   ssm_k_dim=128, ssm_v_dim=128)


def _q35_35b(n_layers: int) -> ModelSpec:
    """Qwen3.5-35B-A3B's layer shape (40 layers there; transformers' Qwen3_5MoeTextConfig defaults), with a small
    vocabulary: next-*'s but 256 experts top-8 (RoPE theta and context as next-*)."""
    return dataclasses.replace(_next_80b(n_layers), family="qwen35moe", ssm_ba=False, ssm_v_order="tiled",
                               n_experts=256, n_experts_used=8)


def _a3b(n_layers: int) -> ModelSpec:
    return _family_spec("qwen3moe", n_layers=n_layers, hidden=2048, n_heads=32, n_kv_heads=4, head_dim=128,
                        vocab=1024, n_experts=128, n_experts_used=8, expert_ffn=768, rms_eps=1e-6,
                        rope_theta=1e6, context_length=32768)


def _glm45_air(n_layers: int = 46) -> ModelSpec:
    """GLM-4.5-Air's shape (zai-org/GLM-4.5-Air's config.json; transformers' Glm4MoeConfig defaults but head_dim,
    which they leave to hidden / heads): 96 query heads and 8 KV heads of 128 with biases and no q/k norm, half of
    each head rotated, one leading dense layer of 10944, 128 experts top-8 of width 1408 and one shared expert,
    sigmoid routing with a correction bias in one group, renormalised, unscaled. The next-token-prediction layer
    is left out (never run)."""
    return _family_spec("glm4moe", n_layers=n_layers, moe_layers=(False,) + (True,) * (n_layers - 1), hidden=4096,
                        n_heads=96, n_kv_heads=8, head_dim=128, vocab=151552, n_experts=128, n_experts_used=8,
                        expert_ffn=1408, shared_ffn=1408, dense_ffn=10944, rms_eps=1e-5, rope_theta=1e6,
                        context_length=131072, qkv_bias=True, rope_dim=64, router="sigmoid", score_bias=True,
                        n_groups=1, topk_groups=1, group_score="top2", routed_scale=1.0)


# Full-depth presets (module docstring) -> the real model's routed experts; the presets hold fewer by default.
FULL_DEPTH = {"qwen3moe-30b": 128, "qwen35moe-35b": 256, "gptoss-20b": 32, "glm45-air": 128, "v2lite": 64}


def _fewer(spec: ModelSpec, n_experts: int) -> ModelSpec:
    if not spec.n_experts_used <= n_experts <= spec.n_experts:
        raise ValueError(f"{n_experts} experts: want top-k {spec.n_experts_used} to {spec.n_experts}")
    return dataclasses.replace(spec, n_experts=n_experts)


PRESETS: dict[str, Callable[[], ModelSpec]] = {
    "tiny-qwen3moe": lambda: _tiny("qwen3moe"),
    "tiny-qwen2moe": lambda: _tiny("qwen2moe"),
    "tiny-mixtral": lambda: _tiny("mixtral"),
    "tiny-olmoe": lambda: _tiny("olmoe"),
    "tiny-glm4moe": _tiny_glm4moe,
    "tiny-deepseek2": lambda: _tiny_deepseek(False),
    "tiny-deepseek3": lambda: _tiny_deepseek(True),
    "tiny-gptoss": _tiny_gptoss,
    "gptoss-20b": _gptoss_20b,
    "gptoss-20b-L4": lambda: _gptoss_20b(4),
    "a3b-L4": lambda: _a3b(4),
    "a3b-L12": lambda: _a3b(12),
    "v2lite-L4": lambda: _v2_lite(4),
    "tiny-qwen3next": lambda: _tiny_hybrid("qwen3next"),
    "tiny-qwen35moe": lambda: _tiny_hybrid("qwen35moe"),
    "next-L4": lambda: _next_80b(4),
    "next-L8": lambda: _next_80b(8),
    "q35-L4": lambda: _q35_35b(4),
    # full depth, real vocabularies, fewer routed experts (FULL_DEPTH has the real counts)
    "qwen3moe-30b": lambda: _fewer(dataclasses.replace(_a3b(48), vocab=151936), 32),
    "qwen35moe-35b": lambda: _fewer(dataclasses.replace(_q35_35b(40), vocab=248320), 32),
    "glm45-air": lambda: _fewer(_glm45_air(), 10),
    "v2lite": lambda: _fewer(_v2_lite(27), 16),
}


def preset_names() -> list[str]:
    return list(PRESETS)


def apply_overrides(spec: ModelSpec, **overrides: Any) -> ModelSpec:
    """`spec` with fields replaced. Keys are ModelSpec field names or ALIASES; None values are ignored.

    Changing `family` re-applies that family's fixed traits; changing `n_layers` without giving
    `moe_layers` keeps the leading dense layers and makes every other layer a MoE layer, and without giving
    `layer_kinds` repeats the layer pattern (sliding / full / linear) from the first layer on.
    """
    fields = {f.name for f in dataclasses.fields(ModelSpec)}
    changes: dict[str, Any] = {}
    for key, value in overrides.items():
        if value is None:
            continue
        name = ALIASES.get(key, key)
        if name not in fields:
            raise ValueError(f"unknown model field '{key}' (known: {', '.join(sorted(fields | set(ALIASES)))})")
        changes[name] = tuple(value) if name == "moe_layers" else value
    if "n_layers" in changes and "moe_layers" not in changes:
        n = changes["n_layers"]
        lead = min(n, next((i for i, moe in enumerate(spec.moe_layers) if moe), spec.n_layers))
        changes["moe_layers"] = (False,) * lead + (True,) * (n - lead)
    if "n_layers" in changes and "layer_kinds" not in changes and spec.layer_kinds:
        changes["layer_kinds"] = tuple(spec.layer_kinds[i % len(spec.layer_kinds)] for i in range(changes["n_layers"]))
    if "family" in changes:
        if changes["family"] not in FAMILIES:
            raise ValueError(f"unknown family '{changes['family']}' (known: {', '.join(FAMILIES)})")
        fam = FAMILIES[changes["family"]]
        changes = {"norm_topk": fam.norm_topk, "qkv_bias": fam.qkv_bias} | changes
        return with_family_defaults(fam, dataclasses.replace(spec, **changes))
    return dataclasses.replace(spec, **changes)


def preset(name: str, **overrides: Any) -> ModelSpec:
    """The named shape (see PRESETS) with `overrides` applied (see apply_overrides)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset '{name}' (known: {', '.join(PRESETS)})")
    return apply_overrides(PRESETS[name](), **overrides)
