"""Model families: ModelFile (records + metadata) -> Arch (family, ModelSpec, canonical tensor sources)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from moerun.arch import deepseek2, glm4moe, gptoss, mixtral, olmoe, qwen2moe, qwen3moe, qwen3next, qwen35moe
from moerun.arch.family import ConfigError, Family, gguf_metadata, spec_from_gguf, spec_from_hf
from moerun.arch.spec import ModelSpec
from moerun.arch.tensors import (
    Source,
    TensorError,
    canonical_sources,
    check_sources,
    expected_shapes,
    source_shape,
)
from moerun.errors import ModelFormatError
from moerun.formats.names import CName
from moerun.formats.records import ModelFile

FAMILIES: dict[str, Family] = {f.name: f for f in (qwen3moe.FAMILY, qwen2moe.FAMILY, mixtral.FAMILY, olmoe.FAMILY,
                                                glm4moe.FAMILY, deepseek2.FAMILY,
                                                gptoss.FAMILY, qwen3next.FAMILY, qwen35moe.FAMILY)}

__all__ = [
    "FAMILIES",
    "Arch",
    "Family",
    "ModelSpec",
    "Source",
    "expected_shapes",
    "family_of",
    "gguf_metadata",
    "resolve",
]


@dataclass(frozen=True)
class Arch:
    family: Family
    spec: ModelSpec
    sources: dict[CName, Source]
    notes: tuple[str, ...] = ()  # what a user should know about how the file was read (a tower skipped)


def family_of(mf: ModelFile) -> Family:
    if mf.format == "gguf":
        arch = mf.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFormatError(mf.path, "missing metadata key 'general.architecture'")
        for f in FAMILIES.values():
            if f.gguf_arch == arch:
                if arch == "llama" and not mf.metadata.get("llama.expert_count"):
                    raise ModelFormatError(mf.path, "architecture 'llama' without experts is a dense model, "
                                                    "not a Mixture-of-Experts model")
                return f
        raise ModelFormatError(mf.path, f"unknown architecture '{arch}' (supported: {_known('gguf_arch')})")
    model_type = mf.metadata.get("config", {}).get("model_type")
    for f in FAMILIES.values():
        if model_type in f.hf_model_types:
            return f
    raise ModelFormatError(mf.path, f"unknown model_type '{model_type}' (supported: {_known('hf_model_types')})")


def _known(attr: str) -> str:
    names = []
    for f in FAMILIES.values():
        v = getattr(f, attr)
        names += list(v) if isinstance(v, tuple) else [v]
    return ", ".join(sorted(set(names)))


def resolve(mf: ModelFile) -> Arch:
    """Family, hyperparameters and canonical tensor sources of an opened model file, checked for consistency."""
    fam = family_of(mf)
    try:
        sources = canonical_sources(mf, dict(fam.gguf_aliases), fam.hf_aliases, fam.hf_rename)
        notes = tuple(f"the checkpoint's {what} ({prefix}*) is skipped: moerun runs the language model"
                      for prefix, what in fam.hf_skipped
                      if mf.format != "gguf" and any(n.startswith(prefix) for n in mf.records))
        if mf.format == "gguf":
            n_layers = mf.metadata.get(f"{fam.gguf_arch}.block_count")
            n_layers = n_layers if isinstance(n_layers, int) and 0 < n_layers < 1 << 16 else 0
            moe = tuple(CName("ffn_gate_inp.weight", i) in sources for i in range(n_layers))
            embd = sources.get(CName("token_embd.weight"))
            if embd is None:
                raise TensorError("missing tensor 'token_embd.weight'")
            spec = spec_from_gguf(fam, mf.metadata, moe, vocab=embd.records[0].shape[0])
            spec = replace(spec, tie_embeddings=CName("output.weight") not in sources)
            present = {cn.kind for cn in sources}
            spec = replace(spec, **{f: v for kind, f, v in fam.gguf_optional if kind in present})
        else:
            cfg = mf.metadata["config"]
            spec = spec_from_hf(fam, fam.hf_config(cfg) if fam.hf_config is not None else cfg)
            if spec.tie_embeddings:
                sources.pop(CName("output.weight"), None)
            if fam.hf_permute_qk:
                for kind, heads in (("attn_q.weight", spec.n_heads), ("attn_k.weight", spec.n_kv_heads)):
                    for i in range(spec.n_layers):
                        cn = CName(kind, i)
                        if cn in sources:
                            sources[cn] = replace(sources[cn], permute_heads=heads)
        # layers past the model's (next-token-prediction blocks: GLM-4.5, DeepSeek-V3) are never run
        sources = {cn: src for cn, src in sources.items() if cn.layer is None or cn.layer < spec.n_layers}
        if spec.attention == "mla":
            _split_kv_b(spec, sources)
        if fam.fix_sources is not None:
            fam.fix_sources(spec, sources, mf.format)
        check_sources(spec, sources)
    except (ConfigError, TensorError, ValueError) as e:
        raise ModelFormatError(mf.path, str(e)) from None
    return Arch(fam, spec, sources, notes)


def _split_kv_b(spec: ModelSpec, sources: dict[CName, Source]) -> None:
    """MLA's latent up-projection stored whole (HF's kv_b_proj, older GGUFs' attn_kv_b) -> the key and value
    parts llama.cpp's converter writes today (attn_k_b, attn_v_b), which the forward pass reads."""
    for i in range(spec.n_layers):
        cn = CName("attn_kv_b.weight", i)
        src = sources.pop(cn, None)
        if src is not None:
            want = (spec.n_heads * (spec.qk_nope_dim + spec.v_head_dim), spec.kv_lora_rank)
            if source_shape(src) != want:
                got = list(source_shape(src))
                raise TensorError(f"tensor '{cn.gguf}' has shape {got}, expected {list(want)}")
            for part in ("k", "v"):
                sources.setdefault(CName(f"attn_{part}_b.weight", i), replace(src, kv_b=(part, spec.n_heads,
                                                                                        spec.qk_nope_dim)))
