"""Qwen2-MoE / Qwen1.5-MoE: q/k/v biases; a shared expert scaled by sigmoid(x @ w_gate); top-k not renormalised."""

from moerun.arch.family import Family

FAMILY = Family(name="qwen2moe", gguf_arch="qwen2moe", hf_model_types=("qwen2_moe",), qkv_bias=True,
                shared_gate=True, norm_topk=False)
