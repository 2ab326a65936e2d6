"""ModelSpec: every hyperparameter the forward pass needs, validated in one place."""

from __future__ import annotations

import math
from dataclasses import dataclass

ROPE_STYLES = ("neox", "interleaved")  # neox: rotate halves; interleaved: rotate pairs (GPT-J / llama.cpp "norm")
QK_NORMS = ("none", "head", "full")  # per head (qwen3moe) or over the whole projection (olmoe)
ATTENTIONS = ("gqa", "mla")  # grouped-query attention; DeepSeek's multi-head latent attention
# attention over the whole context, over the last `sliding_window` positions, or linear attention (gated DeltaNet:
# a fixed-size recurrent state per sequence instead of a KV cache)
LAYER_KINDS = ("full", "sliding", "linear")
SSM_V_ORDERS = ("grouped", "tiled")  # value head j of a linear layer reads key head j // (nv / nk), or j % nk
# softmax: softmax over all experts, top-k (renormalised with norm_topk); topk_softmax: top-k of the logits, softmax
# over those k (gpt-oss); sigmoid: sigmoid scores, chosen by score + correction bias, group-limited (DeepSeek-V3, GLM)
ROUTERS = ("softmax", "topk_softmax", "sigmoid")
GROUP_SCORES = ("max", "top2")  # a group's score for group-limited routing: its best expert (V2), its best two (V3)
EXPERT_ACTS = ("swiglu", "swiglu_oai")  # silu(g) * u; gpt-oss: min(g, l) * sigmoid(a g) * (clamp(u, -l, l) + 1)
RING_ROWS = 16  # the most positions of one sequence a step writes before attending (the fused decode path's rows)


@dataclass(frozen=True)
class KVLayout:
    """What one layer's KV cache keeps per position: the key's and the value's trailing shapes (a value of
    shape () is none: MLA keeps one latent), and how many positions (window; 0: all of them)."""

    k: tuple[int, ...]
    v: tuple[int, ...]
    window: int = 0

    def elems(self) -> int:
        return math.prod(self.k) + (math.prod(self.v) if self.v else 0)

    def ring_blocks(self, block_size: int) -> int:
        """Blocks of a windowed layer's ring (per sequence): position p lives in block (p // block_size) % n of
        it, so after RING_ROWS new positions are written each still finds the window - 1 before it."""
        return -(-(self.window + RING_ROWS - 2) // block_size) + 1

    def held(self, positions: int, block_size: int = 16) -> int:
        """Positions of one sequence the cache keeps for a context of `positions`: all, or a window's ring."""
        return min(positions, self.ring_blocks(block_size) * block_size) if self.window else positions


@dataclass(frozen=True)
class StateLayout:
    """What one linear-attention layer keeps per sequence, whatever the context: the causal conv1d's last
    inputs [channels, kernel - 1] and the delta rule's matrix per value head [heads, k_dim, v_dim]."""

    conv: tuple[int, int]
    ssm: tuple[int, int, int]

    def elems(self) -> int:
        return math.prod(self.conv) + math.prod(self.ssm)


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE scaling: frequencies interpolated by `factor` below the correction range set by beta_fast /
    beta_slow over `original_context`, extrapolated above it; cos and sin scaled by `attention_factor`."""

    factor: float
    original_context: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    def __post_init__(self):
        if not (self.factor >= 1.0 and self.original_context > 0 and self.beta_fast > 0 and self.beta_slow > 0
                and self.attention_factor > 0):
            raise ValueError(f"invalid YaRN parameters {self}")


@dataclass(frozen=True)
class ModelSpec:
    family: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    n_experts: int
    n_experts_used: int
    expert_ffn: int
    moe_layers: tuple[bool, ...]  # per layer: routed experts (True) or a dense FFN (False)
    dense_ffn: int = 0  # FFN width of the dense layers
    shared_ffn: int = 0  # shared-expert FFN width; 0 means no shared expert
    shared_gate: bool = False  # shared expert scaled by sigmoid(x @ gate) (qwen2moe)
    norm_topk: bool = True  # renormalise the k chosen router probabilities
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_style: str = "neox"
    qk_norm: str = "none"
    qkv_bias: bool = False
    clip_qkv: float | None = None
    tie_embeddings: bool = False
    context_length: int = 4096
    # attention variants (shared layers in moerun.model.layers; each family's file says which it uses)
    attention: str = "gqa"
    rope_dim: int = 0  # rotary dimensions per head (0: all of head_dim); the rest pass through (partial rotary)
    yarn: Yarn | None = None
    attn_out_bias: bool = False  # a bias on the output projection
    attn_sinks: bool = False  # a learned logit per head in the softmax's denominator
    sliding_window: int = 0
    layer_kinds: tuple[str, ...] = ()  # per layer, LAYER_KINDS; () means every layer attends to everything
    attn_scale: float = 0.0  # the softmax scale; 0: head_dim ** -0.5
    attn_gate: bool = False  # the q projection also gives a per-head output gate: out * sigmoid(gate) (Qwen3-Next)
    # linear-attention layers (layer kind "linear": gated DeltaNet, Qwen3-Next / Qwen3.5)
    ssm_conv: int = 0  # the causal conv1d's kernel width over q, k and v
    ssm_k_heads: int = 0  # key (and query) heads
    ssm_v_heads: int = 0  # value heads, a multiple of the key heads
    ssm_k_dim: int = 0  # per-head key dims (the state's rows)
    ssm_v_dim: int = 0  # per-head value dims (the state's columns)
    ssm_v_order: str = "grouped"  # how value heads map to key heads (SSM_V_ORDERS): HF's order, or llama.cpp's
    ssm_ba: bool = False  # beta and alpha from one projection, per key head [b (r), a (r)] (Qwen3-Next's in_proj_ba)
    q_lora_rank: int = 0  # MLA (attention == "mla"): q through a rank-q_lora_rank bottleneck (0: direct)
    kv_lora_rank: int = 0  # MLA: the compressed latent the KV cache holds
    qk_nope_dim: int = 0  # MLA: per-head query/key dims without RoPE
    qk_rope_dim: int = 0  # MLA: per-head dims with RoPE (one rotary key shared by all heads)
    v_head_dim: int = 0  # MLA: per-head value dims
    # routing
    router: str = "softmax"
    router_bias: bool = False  # the router's projection has a bias (gpt-oss)
    score_bias: bool = False  # a per-expert correction bias added to the scores for choosing only (V3, GLM)
    n_groups: int = 1  # group-limited routing: experts in n_groups groups, the top topk_groups groups kept
    topk_groups: int = 1
    group_score: str = "max"
    routed_scale: float = 1.0  # the routed experts' weights scaled by this (routed_scaling_factor)
    # experts
    expert_act: str = "swiglu"
    expert_bias: bool = False  # biases on every expert's projections (gpt-oss)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self):
        positive = ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "vocab", "context_length")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if len(self.moe_layers) != self.n_layers:
            raise ValueError(f"moe_layers has {len(self.moe_layers)} entries for {self.n_layers} layers")
        if any(self.moe_layers):
            if not 0 < self.n_experts_used <= self.n_experts:
                raise ValueError(f"experts used {self.n_experts_used} must be in 1..{self.n_experts}")
            if self.expert_ffn <= 0:
                raise ValueError("expert_ffn must be positive")
        if not all(self.moe_layers) and self.dense_ffn <= 0:
            raise ValueError("dense layers present but dense_ffn is not set")
        if self.rope_style not in ROPE_STYLES:
            raise ValueError(f"rope_style {self.rope_style!r} not in {ROPE_STYLES}")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm {self.qk_norm!r} not in {QK_NORMS}")
        for name, allowed in (("attention", ATTENTIONS), ("router", ROUTERS), ("group_score", GROUP_SCORES),
                              ("expert_act", EXPERT_ACTS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} {getattr(self, name)!r} not in {allowed}")
        if self.layer_kinds:
            if len(self.layer_kinds) != self.n_layers or not set(self.layer_kinds) <= set(LAYER_KINDS):
                raise ValueError(f"layer_kinds must give one of {LAYER_KINDS} for each of {self.n_layers} layers")
            if "sliding" in self.layer_kinds and self.sliding_window <= 0:
                raise ValueError("sliding layers need sliding_window > 0")
            if "linear" in self.layer_kinds:
                if min(self.ssm_conv, self.ssm_k_heads, self.ssm_v_heads, self.ssm_k_dim, self.ssm_v_dim) <= 0 \
                        or self.ssm_v_heads % self.ssm_k_heads:
                    raise ValueError("linear layers need ssm_conv, ssm_k_heads, ssm_v_heads (a multiple of the "
                                     "key heads), ssm_k_dim and ssm_v_dim > 0")
                if self.ssm_v_order not in SSM_V_ORDERS:
                    raise ValueError(f"ssm_v_order {self.ssm_v_order!r} not in {SSM_V_ORDERS}")
        if not 0 <= self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ValueError(f"rope_dim {self.rope_dim} must be even and at most head_dim {self.head_dim}")
        if self.n_groups < 1 or not 1 <= self.topk_groups <= self.n_groups or (
                self.n_experts and self.n_experts % self.n_groups):
            raise ValueError(f"expert groups: {self.topk_groups} of {self.n_groups} must divide {self.n_experts} "
                             "experts")
        if self.attention == "mla":
            if min(self.kv_lora_rank, self.qk_nope_dim, self.qk_rope_dim, self.v_head_dim) <= 0 or \
                    self.qk_rope_dim % 2 or self.head_dim != self.qk_nope_dim + self.qk_rope_dim or \
                    self.q_lora_rank < 0:
                raise ValueError("MLA needs kv_lora_rank, qk_nope_dim, an even qk_rope_dim, v_head_dim > 0, "
                                 "q_lora_rank >= 0 and head_dim = qk_nope_dim + qk_rope_dim")
            if self.n_kv_heads != 1 or self.qkv_bias or self.qk_norm != "none" or self.clip_qkv is not None:
                raise ValueError("MLA has one latent KV head (n_kv_heads 1) and no q/k/v biases, norms or "
                                 "clipping")
        if self.routed_scale <= 0 or self.attn_scale < 0:
            raise ValueError("routed_scale must be > 0 and attn_scale >= 0")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Dimensions per head that RoPE rotates."""
        if self.attention == "mla":
            return self.qk_rope_dim
        return self.rope_dim or self.head_dim

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5

    @property
    def attn_out_dim(self) -> int:
        """The output projection's input: every head's value."""
        return self.n_heads * (self.v_head_dim if self.attention == "mla" else self.head_dim)

    def linear(self, layer: int) -> bool:
        """Whether `layer` is a linear-attention (gated DeltaNet) layer: a recurrent state, no KV cache."""
        return bool(self.layer_kinds) and self.layer_kinds[layer] == "linear"

    @property
    def hybrid(self) -> bool:
        """Some layers are linear attention (a fixed-size state per sequence), the others attention."""
        return "linear" in self.layer_kinds

    @property
    def ssm_conv_dim(self) -> int:
        """Channels of a linear layer's conv1d: q, k (key heads) and v (value heads)."""
        return 2 * self.ssm_k_heads * self.ssm_k_dim + self.ssm_v_heads * self.ssm_v_dim

    @property
    def ssm_value_dim(self) -> int:
        return self.ssm_v_heads * self.ssm_v_dim

    def state_layout(self, layer: int) -> StateLayout | None:
        """What linear layer `layer` keeps per sequence (None for an attention layer)."""
        if not self.linear(layer):
            return None
        return StateLayout((self.ssm_conv_dim, self.ssm_conv - 1), (self.ssm_v_heads, self.ssm_k_dim, self.ssm_v_dim))

    def state_bytes(self, dtype_bytes: int = 4) -> int:
        """Bytes of one sequence's recurrent state over every linear layer (fixed: it does not grow)."""
        return sum(self.state_layout(i).elems() for i in range(self.n_layers) if self.linear(i)) * dtype_bytes

    def kv_layout(self, layer: int) -> KVLayout | None:
        """What layer `layer`'s KV cache holds per position (moerun.engine.kv_cache); MLA: one latent, the
        normed compression and the rotated key that every head shares; a sliding layer: the last
        `sliding_window` positions only; a linear layer: none (None; its state: state_layout)."""
        if self.linear(layer):
            return None
        if self.attention == "mla":
            return KVLayout((self.kv_lora_rank + self.qk_rope_dim,), ())
        return KVLayout((self.n_kv_heads, self.head_dim), (self.n_kv_heads, self.head_dim),
                        self.sliding_window if self.sliding(layer) else 0)

    def kv_bytes(self, layer: int, positions: int, dtype_bytes: float, v_bytes: float | None = None) -> int:
        """Bytes of layer `layer`'s KV cache for `positions` positions (of one sequence), at dtype_bytes per key
        value and v_bytes per value value (None: the same; a quantized type's bytes per value are fractions); a
        linear layer's recurrent state (float32 always, whatever the KV type) for any positions > 0."""
        st = self.state_layout(layer)
        if st is not None:
            return st.elems() * 4 if positions > 0 else 0
        lay = self.kv_layout(layer)
        vb = dtype_bytes if v_bytes is None else v_bytes
        per = math.prod(lay.k) * dtype_bytes + (math.prod(lay.v) * vb if lay.v else 0)
        return math.ceil(lay.held(positions) * per)

    def sliding(self, layer: int) -> bool:
        """Whether `layer` attends to the last `sliding_window` positions only."""
        return bool(self.layer_kinds) and self.layer_kinds[layer] == "sliding"

    @property
    def fused_decode(self) -> bool:
        """Whether the fused C decode path (moerun.model.fused) computes this model: grouped-query attention (gated,
        partial rotary, sinks, windows, biases), multi-head latent attention (absorbed, over the latent cache), gated
        DeltaNet layers, any routing (softmax, top-k-softmax, sigmoid with correction bias, groups and scale),
        shared experts and dense layers: every family moerun loads."""
        return self.attention in ("gqa", "mla")
