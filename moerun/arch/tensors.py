"""Canonical tensors of a model file: where each (kind, layer) comes from, and the shape it must have."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

from moerun.arch.spec import ModelSpec
from moerun.formats.names import CName, HFLayout, parse_gguf, parse_hf
from moerun.formats.records import ModelFile, TensorRecord
from moerun.quant.ggml_types import QType


@dataclass(frozen=True)
class Source:
    """How to build one canonical tensor from stored records.

    records: one record, or one per expert (stacked along a new outer dimension).
    chunk:   take part `chunk` (0 or 1) of dimension `dim`: a half, or the even / odd entries when
             `interleaved` (HF fused gate_up_proj; names.HFLayout).
    transposed: the record is stored [.., in, out]; it is transposed first.
    scales: the E8M0 exponents of an HF MXFP4 pair, whose blocks are the record (read as GGUF MXFP4).
    reshape: the record's shape read as this one (same elements: HF's conv1d [C, 1, K] as [C, K]).
    rows:    these rows of the matrix (whole rows: any qtype), in this order (a family's split of a fused
             projection, or its reordering of heads: arch/qwen3next.py).
    cols:    these columns (float tensors only), in this order.
    values:  an elementwise map of a float tensor, by name (VALUE_MAPS: Qwen3-Next's norms stored as w - 1,
             its decay stored as A_log), the result float32.
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
    dim: int = -2
    interleaved: bool = False
    transposed: bool = False
    scales: TensorRecord | None = None
    reshape: tuple[int, ...] | None = None
    rows: tuple[int, ...] | None = None
    cols: tuple[int, ...] | None = None
    values: str | None = None

    @property
    def direct(self) -> bool:
        """One record, read as stored (no stacking, halving, transposing, repacking, permuting or splitting)."""
        return (len(self.records) == 1 and not self.stacked and self.chunk is None and not self.transposed
                and self.scales is None and not self.permute_heads and self.kv_b is None and self.reshape is None
                and self.rows is None and self.cols is None and self.values is None)


VALUE_MAPS = {"plus_one": lambda t: t + 1.0, "neg_exp": lambda t: -t.exp()}


class TensorError(ValueError):
    pass


def _renamed(name: str, rename: tuple[tuple[str, str], ...]) -> str:
    for prefix, to in rename:
        if name.startswith(prefix):
            return to + name[len(prefix):]
    return name


def canonical_sources(mf: ModelFile, aliases: dict[str, str] | None = None,
                      hf_aliases: tuple[tuple[str, str, HFLayout], ...] = (),
                      hf_rename: tuple[tuple[str, str], ...] = ()) -> dict[CName, Source]:
    """Map the file's tensors to canonical names (without hyperparameter-dependent transforms); `aliases` and
    `hf_aliases`: the family's own GGUF and HF names (Family.gguf_aliases, Family.hf_aliases); `hf_rename`:
    its HF name prefixes to rewrite first (Family.hf_rename)."""
    out: dict[CName, Source] = {}
    if mf.format == "gguf":
        for name, rec in mf.records.items():
            cn = parse_gguf(name, aliases)
            if cn is not None:
                out[cn] = Source((rec,))
        return out
    per_expert: dict[CName, dict[int, TensorRecord]] = defaultdict(dict)
    scales: dict[CName, TensorRecord] = {}
    for name, rec in mf.records.items():
        for m in parse_hf(_renamed(name, hf_rename), hf_aliases):
            lay = m.layout
            if m.name.expert is not None:
                per_expert[CName(m.name.kind, m.name.layer)][m.name.expert] = rec
            elif lay.mxfp4 == "scales":
                scales[m.name] = rec
            else:
                out[m.name] = Source((rec,), chunk=lay.chunk, dim=lay.dim, interleaved=lay.interleaved,
                                     transposed=lay.transposed, scales=rec if lay.mxfp4 == "blocks" else None)
    for cn, src in list(out.items()):  # MXFP4 pairs: the blocks' record stood in for its scales until here
        if src.scales is not None:
            if cn not in scales:
                raise TensorError(f"{src.records[0].name}: MXFP4 blocks without their scales")
            out[cn] = _mxfp4_pair(replace(src, scales=scales.pop(cn)))
    if scales:
        raise TensorError(f"{next(iter(scales.values())).name}: MXFP4 scales without their blocks")
    for cn, by_e in per_expert.items():
        if cn in out:
            raise TensorError(f"{cn.gguf} is stored both fused and per expert")
        if sorted(by_e) != list(range(len(by_e))):
            raise TensorError(f"{cn.gguf}: experts {_first_missing(by_e)} are missing")
        out[cn] = Source(tuple(by_e[e] for e in range(len(by_e))), stacked=True)
    return out


def _mxfp4_pair(src: Source) -> Source:
    blocks, scales = src.records[0], src.scales
    if len(blocks.shape) < 3 or blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise TensorError(f"{blocks.name} {list(blocks.shape)} and {scales.name} {list(scales.shape)} are not "
                          "MXFP4 blocks [.., G, 16] and their scales [.., G]")
    return src


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
    shape = tuple(src.records[0].shape) if src.reshape is None else src.reshape
    if src.scales is not None:  # MXFP4 blocks [.., G, 16] hold G * 32 values per row
        shape = (*shape[:-2], shape[-2] * 32)
    if src.stacked:
        shape = (len(src.records), *shape)
    if src.transposed and len(shape) >= 2:
        shape = (*shape[:-2], shape[-1], shape[-2])
    if src.chunk is not None and len(shape) >= -src.dim:
        d = len(shape) + src.dim
        shape = (*shape[:d], shape[d] // 2, *shape[d + 1:])
    if src.kv_b is not None and len(shape) == 2:
        part, heads, nope = src.kv_b
        rank = shape[1]
        shape = (heads, rank, nope) if part == "k" else (heads, shape[0] // heads - nope, rank)
    if src.rows is not None:
        shape = (len(src.rows), *shape[1:])
    if src.cols is not None:
        shape = (*shape[:-1], len(src.cols))
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
    out = {"attn_q.weight": (spec.q_dim * (2 if spec.attn_gate else 1), H), "attn_k.weight": (spec.kv_dim, H),
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


def _linear_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """One linear-attention (gated DeltaNet) layer's tensors: q/k/v into the conv1d, the output gate z, the
    per-head decay (ssm_a = -exp(A_log), ssm_dt the softplus bias) and beta, the gated norm, the output."""
    H, C, V, nv = spec.hidden, spec.ssm_conv_dim, spec.ssm_value_dim, spec.ssm_v_heads
    out = {"attn_qkv.weight": (C, H), "attn_gate.weight": (V, H), "ssm_conv1d.weight": (C, spec.ssm_conv),
           "ssm_dt.bias": (nv,), "ssm_a": (nv,), "ssm_norm.weight": (spec.ssm_v_dim,), "ssm_out.weight": (H, V)}
    if spec.ssm_ba:
        return out | {"ssm_ba.weight": (2 * nv, H)}
    return out | {"ssm_beta.weight": (nv, H), "ssm_alpha.weight": (nv, H)}


def expected_shapes(spec: ModelSpec) -> dict[CName, tuple[int, ...]]:
    """Every tensor the forward pass reads, with its canonical torch shape."""
    H, E, I = spec.hidden, spec.n_experts, spec.expert_ffn
    want = {CName("token_embd.weight"): (spec.vocab, H), CName("output_norm.weight"): (H,)}
    if not spec.tie_embeddings:
        want[CName("output.weight")] = (spec.vocab, H)
    for i in range(spec.n_layers):
        layer = {"attn_norm.weight": (H,), "ffn_norm.weight": (H,)} | (
            _linear_shapes(spec) if spec.linear(i) else _attention_shapes(spec))
        if spec.moe_layers[i]:
            layer |= {"ffn_gate_inp.weight": (E, H), "ffn_gate_exps.weight": (E, I, H),
                      "ffn_up_exps.weight": (E, I, H), "ffn_down_exps.weight": (E, H, I)}
            if spec.router_bias:
                layer["ffn_gate_inp.bias"] = (E,)
            if spec.expert_bias:
                layer |= {"ffn_gate_exps.bias": (E, I), "ffn_up_exps.bias": (E, I), "ffn_down_exps.bias": (E, H)}
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
        raw = [r for r in (*src.records, src.scales) if r is not None and r.qtype == QType.I8]
        if raw and src.scales is None:
            raise TensorError(f"tensor '{raw[0].name}' is U8 (raw bytes): only MXFP4 blocks and scales may be")
        if src.scales is not None and len(raw) != 2:
            raise TensorError(f"MXFP4 blocks and scales must be U8: '{src.records[0].name}' is "
                              f"{src.records[0].qtype.name}, '{src.scales.name}' {src.scales.qtype.name}")
    for cn, shape in expected_shapes(spec).items():
        if cn not in sources:
            raise TensorError(f"missing tensor '{cn.gguf}'")
        got = source_shape(sources[cn])
        if not _same(got, shape):
            raise TensorError(f"tensor '{cn.gguf}' has shape {list(got)}, expected {list(shape)}")
