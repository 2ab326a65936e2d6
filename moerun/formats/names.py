"""The one table of tensor names: GGUF and Hugging Face names <-> canonical (kind, layer, expert).

Canonical kinds are llama.cpp's GGUF names without the `blk.N.` prefix. Routed experts are canonical
as stacked 3-D tensors (`ffn_gate_exps` [E, I, H], `ffn_up_exps` [E, I, H], `ffn_down_exps` [E, H, I]);
Hugging Face stores them per expert (`{E}` in the pattern) or fused (`gate_up_proj`, split in two). A family
whose checkpoints hold a tensor in another layout names it in its own file with an `HFLayout`
(Family.hf_aliases: gpt-oss's transposed, interleaved and MXFP4 experts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

L = "model.layers.{L}."

# kind                       GGUF name                         Hugging Face names (any family)
TABLE: list[tuple[str, str, tuple[str, ...]]] = [
    ("token_embd.weight",         "token_embd.weight",            ("model.embed_tokens.weight",)),
    ("output_norm.weight",        "output_norm.weight",           ("model.norm.weight",)),
    ("output.weight",             "output.weight",                ("lm_head.weight",)),
    ("attn_norm.weight",          "blk.{L}.attn_norm.weight",     (L + "input_layernorm.weight",)),
    ("attn_q.weight",             "blk.{L}.attn_q.weight",        (L + "self_attn.q_proj.weight",)),
    ("attn_k.weight",             "blk.{L}.attn_k.weight",        (L + "self_attn.k_proj.weight",)),
    ("attn_v.weight",             "blk.{L}.attn_v.weight",        (L + "self_attn.v_proj.weight",)),
    ("attn_output.weight",        "blk.{L}.attn_output.weight",   (L + "self_attn.o_proj.weight",)),
    ("attn_q.bias",               "blk.{L}.attn_q.bias",          (L + "self_attn.q_proj.bias",)),
    ("attn_k.bias",               "blk.{L}.attn_k.bias",          (L + "self_attn.k_proj.bias",)),
    ("attn_v.bias",               "blk.{L}.attn_v.bias",          (L + "self_attn.v_proj.bias",)),
    ("attn_output.bias",          "blk.{L}.attn_output.bias",     (L + "self_attn.o_proj.bias",)),
    ("attn_sinks.weight",         "blk.{L}.attn_sinks.weight",    (L + "self_attn.sinks",)),
    ("attn_q_norm.weight",        "blk.{L}.attn_q_norm.weight",   (L + "self_attn.q_norm.weight",)),
    ("attn_k_norm.weight",        "blk.{L}.attn_k_norm.weight",   (L + "self_attn.k_norm.weight",)),
    # multi-head latent attention (DeepSeek): q via a low-rank latent, keys and values from a cached latent
    ("attn_q_a.weight",           "blk.{L}.attn_q_a.weight",      (L + "self_attn.q_a_proj.weight",)),
    ("attn_q_a_norm.weight",      "blk.{L}.attn_q_a_norm.weight", (L + "self_attn.q_a_layernorm.weight",)),
    ("attn_q_b.weight",           "blk.{L}.attn_q_b.weight",      (L + "self_attn.q_b_proj.weight",)),
    ("attn_kv_a_mqa.weight",      "blk.{L}.attn_kv_a_mqa.weight",
     (L + "self_attn.kv_a_proj_with_mqa.weight",)),
    ("attn_kv_a_norm.weight",     "blk.{L}.attn_kv_a_norm.weight", (L + "self_attn.kv_a_layernorm.weight",)),
    ("attn_kv_b.weight",          "blk.{L}.attn_kv_b.weight",     (L + "self_attn.kv_b_proj.weight",)),
    ("attn_k_b.weight",           "blk.{L}.attn_k_b.weight",      ()),
    ("attn_v_b.weight",           "blk.{L}.attn_v_b.weight",      ()),
    # linear attention (gated DeltaNet: Qwen3-Next, Qwen3.5); attn_qkvz (Qwen3-Next's fused q/k/v/z, and older
    # GGUFs' ssm_in) and ssm_ba are split by the family at load (arch/qwen3next.py)
    ("attn_qkv.weight",           "blk.{L}.attn_qkv.weight",      (L + "linear_attn.in_proj_qkv.weight",)),
    ("attn_gate.weight",          "blk.{L}.attn_gate.weight",     (L + "linear_attn.in_proj_z.weight",)),
    ("attn_qkvz.weight",          "blk.{L}.ssm_in.weight",        (L + "linear_attn.in_proj_qkvz.weight",)),
    ("ssm_conv1d.weight",         "blk.{L}.ssm_conv1d.weight",    (L + "linear_attn.conv1d.weight",)),
    ("ssm_dt.bias",               "blk.{L}.ssm_dt.bias",          (L + "linear_attn.dt_bias",)),
    ("ssm_a",                     "blk.{L}.ssm_a",                (L + "linear_attn.A_log",)),
    ("ssm_ba.weight",             "blk.{L}.ssm_ba.weight",        (L + "linear_attn.in_proj_ba.weight",)),
    ("ssm_beta.weight",           "blk.{L}.ssm_beta.weight",      (L + "linear_attn.in_proj_b.weight",)),
    ("ssm_alpha.weight",          "blk.{L}.ssm_alpha.weight",     (L + "linear_attn.in_proj_a.weight",)),
    ("ssm_norm.weight",           "blk.{L}.ssm_norm.weight",      (L + "linear_attn.norm.weight",)),
    ("ssm_out.weight",            "blk.{L}.ssm_out.weight",       (L + "linear_attn.out_proj.weight",)),
    ("ffn_norm.weight",           "blk.{L}.ffn_norm.weight",      (L + "post_attention_layernorm.weight",)),
    ("ffn_gate_inp.weight",       "blk.{L}.ffn_gate_inp.weight",  (L + "mlp.gate.weight", L + "block_sparse_moe.gate.weight",
                                                                   L + "mlp.router.weight")),
    ("ffn_gate_inp.bias",         "blk.{L}.ffn_gate_inp.bias",    (L + "mlp.router.bias",)),
    ("exp_probs_b.bias",          "blk.{L}.exp_probs_b.bias",     (L + "mlp.gate.e_score_correction_bias",)),
    ("ffn_gate_exps.weight",      "blk.{L}.ffn_gate_exps.weight", (L + "mlp.experts.{E}.gate_proj.weight",
                                                                   L + "block_sparse_moe.experts.{E}.w1.weight",
                                                                   L + "mlp.experts.gate_up_proj#0")),
    ("ffn_up_exps.weight",        "blk.{L}.ffn_up_exps.weight",   (L + "mlp.experts.{E}.up_proj.weight",
                                                                   L + "block_sparse_moe.experts.{E}.w3.weight",
                                                                   L + "mlp.experts.gate_up_proj#1")),
    ("ffn_down_exps.weight",      "blk.{L}.ffn_down_exps.weight", (L + "mlp.experts.{E}.down_proj.weight",
                                                                   L + "block_sparse_moe.experts.{E}.w2.weight",
                                                                   L + "mlp.experts.down_proj")),
    # per-expert biases [E, I] / [E, H] (gpt-oss; its HF names: arch/gptoss.py)
    ("ffn_gate_exps.bias",        "blk.{L}.ffn_gate_exps.bias",   ()),
    ("ffn_up_exps.bias",          "blk.{L}.ffn_up_exps.bias",     ()),
    ("ffn_down_exps.bias",        "blk.{L}.ffn_down_exps.bias",   ()),
    ("ffn_gate_shexp.weight",     "blk.{L}.ffn_gate_shexp.weight", (L + "mlp.shared_expert.gate_proj.weight",
                                                                   L + "mlp.shared_experts.gate_proj.weight")),
    ("ffn_up_shexp.weight",       "blk.{L}.ffn_up_shexp.weight",   (L + "mlp.shared_expert.up_proj.weight",
                                                                   L + "mlp.shared_experts.up_proj.weight")),
    ("ffn_down_shexp.weight",     "blk.{L}.ffn_down_shexp.weight", (L + "mlp.shared_expert.down_proj.weight",
                                                                   L + "mlp.shared_experts.down_proj.weight")),
    ("ffn_gate_inp_shexp.weight", "blk.{L}.ffn_gate_inp_shexp.weight", (L + "mlp.shared_expert_gate.weight",)),
    # dense FFN (layers without experts)
    ("ffn_gate.weight",           "blk.{L}.ffn_gate.weight",      (L + "mlp.gate_proj.weight",)),
    ("ffn_up.weight",             "blk.{L}.ffn_up.weight",        (L + "mlp.up_proj.weight",)),
    ("ffn_down.weight",           "blk.{L}.ffn_down.weight",      (L + "mlp.down_proj.weight",)),
]

# Tensor classes, for reporting bytes (inspect, estimate).
CLASSES = {
    "token_embd.weight": "embeddings", "output.weight": "head", "output_norm.weight": "norms",
    "attn_norm.weight": "norms", "ffn_norm.weight": "norms", "attn_q_norm.weight": "norms",
    "attn_k_norm.weight": "norms", "attn_q_a_norm.weight": "norms", "attn_kv_a_norm.weight": "norms",
    "ssm_norm.weight": "norms",
    "ffn_gate_inp.weight": "router", "ffn_gate_inp.bias": "router",
    "exp_probs_b.bias": "router", "ffn_gate_inp_shexp.weight": "shared_experts",
    "ffn_gate_exps.weight": "routed_experts", "ffn_up_exps.weight": "routed_experts",
    "ffn_down_exps.weight": "routed_experts", "ffn_gate_exps.bias": "routed_experts",
    "ffn_up_exps.bias": "routed_experts", "ffn_down_exps.bias": "routed_experts", "ffn_gate_shexp.weight": "shared_experts",
    "ffn_up_shexp.weight": "shared_experts", "ffn_down_shexp.weight": "shared_experts",
    "ffn_gate.weight": "dense_ffn", "ffn_up.weight": "dense_ffn", "ffn_down.weight": "dense_ffn",
}  # everything else (attn_*) is "attention"


def tensor_class(kind: str) -> str:
    return CLASSES.get(kind, "attention")


@dataclass(frozen=True, order=True)
class CName:
    """Canonical tensor name. `expert` is set only for one expert's slice of an HF per-expert tensor."""

    kind: str
    layer: int | None = None
    expert: int | None = None

    @property
    def gguf(self) -> str:
        return gguf_name(self.kind, self.layer)


@dataclass(frozen=True)
class HFLayout:
    """How a Hugging Face tensor holds a canonical one, beyond its name.

    chunk: the canonical tensor is part `chunk` (0 or 1) of dimension `dim` (-2: a matrix's rows, -1: a
    bias), the first or second half, or with `interleaved` the even or odd entries (gpt-oss's gate_up_proj:
    gate 0::2, up 1::2). transposed: stored [in, out] (x @ W), transposed to [out, in] first. mxfp4: "blocks"
    or "scales" of an MXFP4 pair (uint8 [.., rows, G, 16] nibbles, and [.., rows, G] E8M0 exponents)."""

    chunk: int | None = None
    dim: int = -2
    interleaved: bool = False
    transposed: bool = False
    mxfp4: str | None = None


@dataclass(frozen=True)
class HFMatch:
    """An HF tensor name resolved: canonical name and layout (for fused gate_up, which half: chunk 0 gate, 1 up)."""

    name: CName
    layout: HFLayout = HFLayout()


def gguf_name(kind: str, layer: int | None = None, aliases: dict[str, str] | None = None) -> str:
    """The GGUF name of a canonical tensor; `aliases` (a family's, kind -> pattern) where llama.cpp names it
    differently in that family (gpt-oss and GLM-4.5 call the pre-FFN norm post_attention_norm)."""
    g = (aliases or {}).get(kind) or next((g for k, g, _ in TABLE if k == kind), None)
    if g is None:
        raise KeyError(kind)
    return g.format(L=layer) if "{L}" in g else g


def _regex(pattern: str) -> re.Pattern:
    chunk = None
    if "#" in pattern:
        pattern, chunk = pattern.split("#")
    rx = re.escape(pattern).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
    return re.compile(rx + "$"), None if chunk is None else int(chunk)


_HF = [(kind, *_regex(p)) for kind, _, pats in TABLE for p in pats]


def _gguf_rx(pattern: str) -> re.Pattern:
    return re.compile(re.escape(pattern).replace(r"\{L\}", r"(?P<L>\d+)") + "$")


_GGUF = [(kind, _gguf_rx(g)) for kind, g, _ in TABLE]


def parse_gguf(name: str, aliases: dict[str, str] | None = None) -> CName | None:
    """The canonical name of a GGUF tensor name (None when unknown); a family's `aliases` first."""
    table = [(kind, _gguf_rx(g)) for kind, g in (aliases or {}).items()]
    for kind, rx in table + _GGUF:
        m = rx.match(name)
        if m:
            return CName(kind, int(m["L"]) if "L" in rx.groupindex else None)
    return None


def parse_hf(name: str, aliases: tuple[tuple[str, str, HFLayout], ...] = ()) -> list[HFMatch]:
    """All canonical tensors an HF name feeds (two for a fused gate_up tensor); [] when unknown. A family's
    `aliases` ((kind, pattern, layout), Family.hf_aliases) are tried first and, when one matches, alone."""
    own = [(kind, _regex(p)[0], layout) for kind, p, layout in aliases]
    generic = [(kind, rx, HFLayout(chunk)) for kind, rx, chunk in _HF]
    for table in (own, generic):
        out = []
        for kind, rx, layout in table:
            m = rx.match(name)
            if m:
                layer = int(m["L"]) if "L" in rx.groupindex else None
                expert = int(m["E"]) if "E" in rx.groupindex else None
                out.append(HFMatch(CName(kind, layer, expert), layout))
        if out:
            return out
    return []
