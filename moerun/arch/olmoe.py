"""OLMoE: RMSNorm over the whole q and k projections (not per head); optional clip_qkv; top-k not renormalised."""

from moerun.arch.family import Family

FAMILY = Family(name="olmoe", gguf_arch="olmoe", hf_model_types=("olmoe",), qk_norm="full", norm_topk=False,
                hf_expert_ffn_key="intermediate_size")
