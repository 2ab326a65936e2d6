"""Mixtral: llama layers with 8 experts; GGUF arch `llama`; interleaved RoPE (HF Q/K rows are permuted)."""

from moerun.arch.family import Family

FAMILY = Family(name="mixtral", gguf_arch="llama", hf_model_types=("mixtral",), rope_style="interleaved",
                norm_topk=True, norm_topk_fixed=True, hf_expert_ffn_key="intermediate_size",
                hf_experts_key=("num_local_experts",), hf_permute_qk=True)
