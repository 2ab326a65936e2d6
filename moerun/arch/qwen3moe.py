"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): RMSNorm on q and k per head; renormalised top-k."""

from moerun.arch.family import Family

FAMILY = Family(name="qwen3moe", gguf_arch="qwen3moe", hf_model_types=("qwen3_moe",), qk_norm="head",
                norm_topk=True)
