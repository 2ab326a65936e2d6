"""Canonical tensors of a model file: where each (kind, layer) comes from, and the shape it must have."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from moerun.arch.spec import ModelSpec
from moerun.formats.names import CName, parse_gguf, parse_hf
from moerun.formats.records import ModelFile, TensorRecord


@dataclass(frozen=True)
class Source:
    """How to build one canonical tensor from stored records.

    records: one record, or one per expert (stacked along a new outer dimension).
    chunk:   take half `chunk` (0 or 1) of dimension -2 (HF fused gate_up_proj).
    permute_heads: reorder Q/K rows from rotate-half to interleaved RoPE layout, with this many heads.
    kv_b:    MLA's latent up-projection stored whole ([heads * (nope + v), rank]: HF, older GGUFs): (part,
             heads, nope) takes part "k" as llama.cpp's attn_k_b [heads, rank, nope] or "v" as attn_v_b
             [heads, v, rank].
    """

    records: tuple[TensorRecord, ...]
    chunk: int | None = None
    permute_heads: int | None = None
    stacked: bool = False
    kv_b: tuple[str, int, int] | None = None


class TensorError(ValueError):
    pass


def canonical_sources(mf: ModelFile, aliases: dict[str, str] | None = None) -> dict[CName, Source]:
    """Map the file's tensors to canonical names (without hyperparameter-dependent transforms); `aliases`: the
    family's own GGUF names (Family.gguf_aliases)."""
    out: dict[CName, Source] = {}
    if mf.format == "gguf":
        for name, rec in mf.records.items():
            cn = parse_gguf(name, aliases)
            if cn is not None:
                out[cn] = Source((rec,))
        return out
    per_expert: dict[CName, dict[int, TensorRecord]] = defaultdict(dict)
    for name, rec in mf.records.items():
        for m in parse_hf(name):
            if m.name.expert is not None:
                per_expert[CName(m.name.kind, m.name.layer)][m.name.expert] = rec
            else:
                out[m.name] = Source((rec,), chunk=m.chunk)
    for cn, by_e in per_expert.items():
        if cn in out:
            raise TensorError(f"{cn.gguf} is stored both fused and per expert")
        if sorted(by_e) != list(range(len(by_e))):
            raise TensorError(f"{cn.gguf}: experts {_first_missing(by_e)} are missing")
        out[cn] = Source(tuple(by_e[e] for e in range(len(by_e))), stacked=True)
    return out


def _first_missing(present: dict[int, TensorRecord], limit: int = 8) -> str:
    """The first few expert numbers absent from `present`: at most len(present) + limit steps, even when a
    stored name claims expert 10**11."""
    missing = []
    for e in range(max(present)):
        if e not in present:
            missing.append(e)
            if len(missing) == limit:
                return f"{missing} and more"
    return str(missing)


def source_shape(src: Source) -> tuple[int, ...]:
    shape = src.records[0].shape
    if src.stacked:
        shape = (len(src.records), *shape)
    if src.chunk is not None and len(shape) >= 2:
        shape = (*shape[:-2], shape[-2] // 2, shape[-1])
    if src.kv_b is not None and len(shape) == 2:
        part, heads, nope = src.kv_b
        rank = shape[1]
        shape = (heads, rank, nope) if part == "k" else (heads, shape[0] // heads - nope, rank)
    return tuple(shape)


def _attention_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """One layer's attention tensors (canonical kinds) with their shapes."""
    H, nh = spec.hidden, spec.n_heads
    if spec.attention == "mla":
        rank, rope = spec.kv_lora_rank, spec.qk_rope_dim
        out = {"attn_kv_a_mqa.weight": (rank + rope, H), "attn_kv_a_norm.weight": (rank,),
               "attn_k_b.weight": (nh, rank, spec.qk_nope_dim),
               "attn_v_b.weight": (nh, spec.v_head_dim, rank), "attn_output.weight": (H, spec.attn_out_dim)}
        if spec.q_lora_rank:
            q = spec.q_lora_rank
            return out | {"attn_q_a.weight": (q, H), "attn_q_a_norm.weight": (q,),
                          "attn_q_b.weight": (spec.q_dim, q)}
        return out | {"attn_q.weight": (spec.q_dim, H)}
    out = {"attn_q.weight": (spec.q_dim, H), "attn_k.weight": (spec.kv_dim, H),
           "attn_v.weight": (spec.kv_dim, H), "attn_output.weight": (H, spec.attn_out_dim)}
    if spec.qkv_bias:
        out |= {"attn_q.bias": (spec.q_dim,), "attn_k.bias": (spec.kv_dim,), "attn_v.bias": (spec.kv_dim,)}
    if spec.attn_out_bias:
        out["attn_output.bias"] = (H,)
    if spec.attn_sinks:
        out["attn_sinks.weight"] = (nh,)
    if spec.qk_norm == "head":
        out |= {"attn_q_norm.weight": (spec.head_dim,), "attn_k_norm.weight": (spec.head_dim,)}
    elif spec.qk_norm == "full":
        out |= {"attn_q_norm.weight": (spec.q_dim,), "attn_k_norm.weight": (spec.kv_dim,)}
    return out


def expected_shapes(spec: ModelSpec) -> dict[CName, tuple[int, ...]]:
    """Every tensor the forward pass reads, with its canonical torch shape."""
    H, E, I = spec.hidden, spec.n_experts, spec.expert_ffn
    want = {CName("token_embd.weight"): (spec.vocab, H), CName("output_norm.weight"): (H,)}
    if not spec.tie_embeddings:
        want[CName("output.weight")] = (spec.vocab, H)
    for i in range(spec.n_layers):
        layer = {"attn_norm.weight": (H,), "ffn_norm.weight": (H,)} | _attention_shapes(spec)
        if spec.moe_layers[i]:
            layer |= {"ffn_gate_inp.weight": (E, H), "ffn_gate_exps.weight": (E, I, H),
                      "ffn_up_exps.weight": (E, I, H), "ffn_down_exps.weight": (E, H, I)}
            if spec.router_bias:
                layer["ffn_gate_inp.bias"] = (E,)
            if spec.score_bias:
                layer["exp_probs_b.bias"] = (E,)
            if spec.shared_ffn:
                S = spec.shared_ffn
                layer |= {"ffn_gate_shexp.weight": (S, H), "ffn_up_shexp.weight": (S, H),
                          "ffn_down_shexp.weight": (H, S)}
                if spec.shared_gate:
                    layer["ffn_gate_inp_shexp.weight"] = (1, H)
        else:
            F = spec.dense_ffn
            layer |= {"ffn_gate.weight": (F, H), "ffn_up.weight": (F, H), "ffn_down.weight": (H, F)}
        want |= {CName(k, i): s for k, s in layer.items()}
    return want


def _same(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    # GGUF stores 1-row matrices such as the shared-expert gate [1, H] as 1-D [H].
    return a == b or (len(b) == 2 and b[0] == 1 and a == b[1:])


def _check_stacked(cn: CName, src: Source) -> None:
    first = src.records[0]
    for e, rec in enumerate(src.records):
        if (rec.shape, rec.qtype) != (first.shape, first.qtype):
            raise TensorError(f"{cn.gguf}: expert {e} is {rec.qtype.name} {list(rec.shape)}, expert 0 is "
                              f"{first.qtype.name} {list(first.shape)}")


def check_sources(spec: ModelSpec, sources: dict[CName, Source]) -> None:
    for i in range(spec.n_layers):  # a header claiming more layers than stored stops here, before expected_shapes
        if CName("attn_norm.weight", i) not in sources:
            raise TensorError(f"missing tensor '{CName('attn_norm.weight', i).gguf}'")
    for cn, src in sources.items():
        if src.stacked:
            _check_stacked(cn, src)
    for cn, shape in expected_shapes(spec).items():
        if cn not in sources:
            raise TensorError(f"missing tensor '{cn.gguf}'")
        got = source_shape(sources[cn])
        if not _same(got, shape):
            raise TensorError(f"tensor '{cn.gguf}' has shape {list(got)}, expected {list(shape)}")
