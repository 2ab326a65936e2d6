"""ModelSpec: every hyperparameter the forward pass needs, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass

ROPE_STYLES = ("neox", "interleaved")  # neox: rotate halves; interleaved: rotate pairs (GPT-J / llama.cpp "norm")
QK_NORMS = ("none", "head", "full")  # per head (qwen3moe) or over the whole projection (olmoe)


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

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim
