"""Hugging Face model folders: config.json per family, tensor names as save_pretrained writes them,
and a streaming safetensors writer (shards of ~2 GB plus model.safetensors.index.json).

Tensor names come from the one name table (moerun.formats.names.TABLE): experts per expert
(`mlp.experts.E.gate_proj` / Mixtral's `block_sparse_moe.experts.E.w1`), except Qwen3.5-MoE's, which transformers
reads fused only (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]).

The hybrids' checkpoints store some tensors other than canonically (arch/qwen3next.py, arch/qwen35moe.py); `to_hf`
and `qkvz_to_hf` write them so (the inverse of the family's fix_sources): norms but the gated one as w - 1, A_log
= log(-ssm_a), conv1d [C, 1, K]; Qwen3-Next's in_proj_qkvz [q, k, v, z] per key head (in_proj_ba is ssm_ba as
is); Qwen3.5's value heads in HF's grouped order.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moerun.arch import FAMILIES, ModelSpec, qwen3next, qwen35moe
from moerun.formats.names import TABLE, CName
from moerun.quant.qtypes import QType, tensor_bytes
from moerun.tools.gguf_out import TensorOut
from moerun.tools.outputs import progress_bar

__all__ = ["FUSED_EXPERTS", "HF_ARCHITECTURES", "HYBRIDS", "SHARD_BYTES", "hf_config", "hf_names", "hf_shape",
           "permute_to_hf", "qkvz_to_hf", "to_hf", "write_safetensors"]

SHARD_BYTES = 2 * 10**9
HF_ARCHITECTURES = {
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "olmoe": ("olmoe", "OlmoeForCausalLM"),
    "qwen3next": ("qwen3_next", "Qwen3NextForCausalLM"),
    "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
}
HYBRIDS = ("qwen3next", "qwen35moe")  # linear-attention layers beside attention (layer_types)
FUSED_EXPERTS = ("qwen35moe",)  # experts stored stacked, gate and up in one tensor
_HF_KINDS = {v: k for k, v in qwen3next.HF_KINDS.items()}
_ST_DTYPES = {QType.F32: "F32", QType.F16: "F16", QType.BF16: "BF16"}
_TORCH_DTYPES = {QType.F32: "float32", QType.F16: "float16", QType.BF16: "bfloat16"}


def hf_config(spec: ModelSpec, dtype: QType = QType.F32, special_ids: dict[str, int] | None = None) -> dict:
    """config.json for `spec` in the family's transformers format (loads with AutoConfig)."""
    if spec.family not in HF_ARCHITECTURES:
        raise ValueError(f"no Hugging Face format known for family '{spec.family}'")
    model_type, arch = HF_ARCHITECTURES[spec.family]
    qwen = spec.family in ("qwen3moe", "qwen2moe", "qwen3next")
    dense = [i for i, moe in enumerate(spec.moe_layers) if not moe]
    if dense and not qwen:
        raise ValueError(f"{spec.family} in Hugging Face format has no dense layers (layers {dense} are dense)")
    if spec.qk_norm != FAMILIES[spec.family].qk_norm or spec.rope_style != FAMILIES[spec.family].rope_style:
        raise ValueError(f"spec's q/k norm or RoPE style differs from what {spec.family} computes")
    ids = special_ids or {}
    cfg: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.n_layers,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.context_length,
        "rms_norm_eps": spec.rms_eps,
        "rope_parameters": {"rope_theta": spec.rope_theta, "rope_type": "default"},
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tie_embeddings,
        "num_experts_per_tok": spec.n_experts_used,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": ids.get("bos"),
        "eos_token_id": ids.get("eos"),
        "pad_token_id": ids.get("pad"),
        "dtype": _TORCH_DTYPES[dtype],
    }
    if spec.family in HYBRIDS:
        cfg |= _hybrid_config(spec, dense)
    elif qwen:
        cfg |= {"moe_intermediate_size": spec.expert_ffn, "intermediate_size": spec.dense_ffn or spec.expert_ffn,
                "num_experts": spec.n_experts, "norm_topk_prob": spec.norm_topk, "decoder_sparse_step": 1,
                "mlp_only_layers": dense, "use_sliding_window": False, "sliding_window": None}
        if spec.family == "qwen2moe":
            cfg |= {"shared_expert_intermediate_size": spec.shared_ffn, "qkv_bias": spec.qkv_bias}
        else:
            cfg["attention_bias"] = spec.qkv_bias
    elif spec.family == "mixtral":
        cfg |= {"intermediate_size": spec.expert_ffn, "num_local_experts": spec.n_experts, "sliding_window": None}
    else:  # olmoe
        cfg |= {"intermediate_size": spec.expert_ffn, "num_experts": spec.n_experts, "norm_topk_prob": spec.norm_topk,
                "clip_qkv": spec.clip_qkv, "attention_bias": spec.qkv_bias}
    if spec.shared_ffn and spec.family not in ("qwen2moe", *HYBRIDS):
        raise ValueError(f"{spec.family} has no shared expert in Hugging Face format")
    return cfg


def _hybrid_config(spec: ModelSpec, dense: list[int]) -> dict[str, Any]:
    """Qwen3NextConfig's / Qwen3_5MoeTextConfig's own keys: layer types, the linear layers' shape, partial rotary,
    the gated shared expert (Qwen3-Next's dense layers: mlp_only_layers; Qwen3.5 has none)."""
    if not (spec.attn_gate and spec.shared_ffn and spec.shared_gate and spec.norm_topk) or spec.qkv_bias:
        raise ValueError(f"{spec.family} in Hugging Face format has gated attention, a gated shared expert, "
                         "renormalised top-k and no q/k/v biases")
    rope = {"rope_theta": spec.rope_theta, "rope_type": "default",
            "partial_rotary_factor": spec.rotary_dim / spec.head_dim}
    cfg = {"rope_parameters": rope, "partial_rotary_factor": rope["partial_rotary_factor"],
           "attention_bias": False, "num_experts": spec.n_experts, "moe_intermediate_size": spec.expert_ffn,
           "shared_expert_intermediate_size": spec.shared_ffn, "norm_topk_prob": True,
           "layer_types": [_HF_KINDS[k] for k in spec.layer_kinds or ("full",) * spec.n_layers],
           "linear_conv_kernel_dim": spec.ssm_conv, "linear_num_key_heads": spec.ssm_k_heads,
           "linear_num_value_heads": spec.ssm_v_heads, "linear_key_head_dim": spec.ssm_k_dim,
           "linear_value_head_dim": spec.ssm_v_dim, "router_aux_loss_coef": 0.001, "output_router_logits": False}
    if spec.family == "qwen3next":
        cfg |= {"intermediate_size": spec.dense_ffn or spec.expert_ffn, "decoder_sparse_step": 1,
                "mlp_only_layers": dense}
    return cfg


def _pattern(family: str, kind: str, expert: bool) -> str:
    """The HF name pattern save_pretrained uses for `kind` in `family`, from the one name table."""
    pats = next(p for k, _, p in TABLE if k == kind)
    pats = [p for p in pats if "#" not in p and ("{E}" in p) == expert]
    mixtral_style = [p for p in pats if "block_sparse_moe" in p]
    other = [p for p in pats if "block_sparse_moe" not in p]
    pick = (mixtral_style or other) if family == "mixtral" else (other or mixtral_style)
    if not pick:
        raise ValueError(f"no Hugging Face name for '{kind}' in {family}")
    return pick[0]


def hf_names(family: str, cn: CName, n_experts: int = 0) -> list[str]:
    """HF tensor names of canonical tensor `cn`: one name, or one per expert for stacked expert tensors (one for
    them all in FUSED_EXPERTS: gate's and up's the same); Qwen3-Next's attn_qkv and attn_gate: in_proj_qkvz."""
    if family in FUSED_EXPERTS and cn.kind.endswith("_exps.weight"):
        pats = next(p for k, _, p in TABLE if k == cn.kind)
        return [next(p for p in pats if "{E}" not in p).split("#")[0].format(L=cn.layer)]
    if family == "qwen3next" and cn.kind in ("attn_qkv.weight", "attn_gate.weight"):
        return [_pattern(family, "attn_qkvz.weight", expert=False).format(L=cn.layer)]
    if cn.kind.endswith("_exps.weight"):
        pat = _pattern(family, cn.kind, expert=True)
        return [pat.format(L=cn.layer, E=e) for e in range(n_experts)]
    return [_pattern(family, cn.kind, expert=False).format(L=cn.layer)]


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Q/K rows from canonical (interleaved RoPE) to HF rotate-half order: inverse of loader._permute_rows."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_shape(spec: ModelSpec, cn: CName, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape `to_hf` gives canonical tensor `cn` of `shape` (the hybrids' conv1d [C, 1, K]; in_proj_qkvz:
    qkvz_to_hf)."""
    if spec.family in HYBRIDS and cn.kind == "ssm_conv1d.weight":
        return (shape[0], 1, shape[1])
    return tuple(shape)


def _scatter(t: torch.Tensor, index: list[int], dim: int) -> torch.Tensor:
    """out with out.index_select(dim, index) == t: undoes a Source's rows or cols."""
    return torch.empty_like(t).index_copy_(dim, torch.tensor(index, dtype=torch.long), t)


def to_hf(spec: ModelSpec, cn: CName, t: torch.Tensor) -> torch.Tensor:
    """Canonical float tensor `t` of `cn` as `spec`'s family stores it in HF format (module docstring); the family's
    fix_sources reads it back to `t` (exactly in float32 but for A_log)."""
    if spec.family not in HYBRIDS:
        return t
    kind = cn.kind
    if kind in qwen3next.ZERO_CENTERED:
        return t - 1.0
    if spec.family == "qwen35moe" and cn.layer is not None and spec.linear(cn.layer):
        qk = 2 * spec.ssm_k_heads * spec.ssm_k_dim
        v_rows = qwen35moe.tiled(spec, spec.ssm_v_dim)
        heads = qwen35moe.tiled(spec, 1)
        qkv = list(range(qk)) + [qk + j for j in v_rows]
        index, dim = {"attn_qkv.weight": (qkv, 0), "ssm_conv1d.weight": (qkv, 0), "attn_gate.weight": (v_rows, 0),
                      "ssm_beta.weight": (heads, 0), "ssm_alpha.weight": (heads, 0), "ssm_dt.bias": (heads, -1),
                      "ssm_a": (heads, -1), "ssm_out.weight": (v_rows, -1)}.get(kind, (None, 0))
        if index is not None:
            t = _scatter(t, index, dim)
    if kind == "ssm_a":
        return (-t).log()
    if kind == "ssm_conv1d.weight":
        return t.unsqueeze(1)
    return t


def qkvz_to_hf(spec: ModelSpec, qkv: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Qwen3-Next's in_proj_qkvz ([q, k, v, z] per key head) from canonical attn_qkv and attn_gate."""
    qkv_rows, z_rows = qwen3next.qkvz_rows(spec)
    out = torch.empty((qkv.shape[0] + z.shape[0], *qkv.shape[1:]), dtype=qkv.dtype)
    out[list(qkv_rows)] = qkv
    out[list(z_rows)] = z
    return out


def _header(tensors: Sequence[TensorOut]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        entries[t.name] = {"dtype": _ST_DTYPES[t.qtype], "shape": list(t.shape),
                           "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def _shards(tensors: Sequence[TensorOut], shard_bytes: int) -> list[list[TensorOut]]:
    shards: list[list[TensorOut]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def write_safetensors(folder: Path, tensors: Sequence[TensorOut], *, shard_bytes: int | None = None,
                      progress: bool = True) -> list[Path]:
    """Write `tensors` (float types) into `folder` as model.safetensors or numbered shards + index, streamed.

    Shards hold at most `shard_bytes` (default SHARD_BYTES, ~2 GB) unless one tensor is larger.
    """
    for t in tensors:
        if t.qtype not in _ST_DTYPES:
            raise ValueError(f"safetensors holds float tensors; '{t.name}' is {t.qtype.name}")
    shards = _shards(tensors, shard_bytes or SHARD_BYTES)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    total = sum(t.nbytes for t in tensors)
    with progress_bar(total, folder.name, progress) as bar:
        for name, shard in zip(names, shards):
            header = _header(shard)
            with open(folder / name, "wb") as f:
                f.write(struct.pack("<Q", len(header)))
                f.write(header)
                for t in shard:
                    written = 0
                    for chunk in t.produce():
                        data = chunk.contiguous().numpy() if isinstance(chunk, torch.Tensor) else np.asarray(chunk)
                        data.tofile(f)
                        written += data.nbytes
                        bar.update(data.nbytes)
                    if written != tensor_bytes(t.qtype, t.shape):
                        raise RuntimeError(f"tensor '{t.name}': produced {written} bytes, expected {t.nbytes}")
    if n > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [folder / name for name in names]
