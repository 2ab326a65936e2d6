"""Tiny random Hugging Face MoE models, one per family: the independent reference for parity tests."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("qwen3moe", "qwen2moe", "mixtral", "olmoe")
COMMON = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "num_experts_per_tok": 2, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def hf_config(family: str):
    import transformers as tf

    if family == "qwen3moe":
        return tf.Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=8, moe_intermediate_size=32,
                                 intermediate_size=128, norm_topk_prob=True, rope_theta=1e6)
    if family == "qwen2moe":
        return tf.Qwen2MoeConfig(**COMMON, num_experts=8, moe_intermediate_size=32, intermediate_size=128,
                                 shared_expert_intermediate_size=48, norm_topk_prob=False)
    if family == "mixtral":
        return tf.MixtralConfig(**COMMON, num_local_experts=8, intermediate_size=32, rope_theta=1e6)
    if family == "olmoe":
        return tf.OlmoeConfig(**COMMON, num_experts=8, intermediate_size=32, norm_topk_prob=False,
                              eos_token_id=0, pad_token_id=1)
    raise KeyError(family)


def build(family: str, seed: int = 0, config=None):
    """A randomly initialised transformers model with perturbed norms (so every weight matters)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config or hf_config(family), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5 * 2)
    return model


def save(model, path: Path, fused: bool = False) -> Path:
    """save_pretrained per expert (the default) or with fused 3-D expert tensors, plus a byte-level tokenizer."""
    from moerun.tools.tokenizer import build_tokenizer, write_hf_tokenizer

    model.save_pretrained(path, save_original_format=not fused)
    write_hf_tokenizer(build_tokenizer(model.config.vocab_size), path)
    return path


def reference_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens[None]).logits[0].float()
