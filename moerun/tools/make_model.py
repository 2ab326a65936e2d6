"""Synthetic models with random weights, as GGUF files or Hugging Face safetensors folders.

    make_model("tiny-qwen3moe", "/tmp/tiny.gguf")                          # F32 GGUF
    make_model("a3b-L4", "/tmp/a3b.gguf", ftype="Q4_K_M")                   # the benchmark model
    make_model(preset("tiny-mixtral", layers=3), "/tmp/mx", fmt="safetensors")

    python -m moerun.tools.make_model tiny-olmoe /tmp/olmoe.gguf --ftype Q8_0 --layers 4

Weights are a pure function of (seed, tensor name, part): each expert of a stacked tensor and each
block of rows of a large matrix has its own torch.Generator, so memory stays bounded by one part,
and the GGUF and safetensors outputs of the same seed hold the same float values (before
quantization). Matrices are normal(0, 1/sqrt(fan_in)) (linear attention's conv1d: 1/sqrt(kernel width)), norms
1 + normal(0, 0.02), biases normal(0, 0.02) (ssm_dt's too); ssm_a, the decay -exp(A_log), is -uniform(0.01, 16).
The safetensors output stores what the family's checkpoints store (moerun.tools.hf_out.to_hf: Qwen3-Next's norms
as w - 1, A_log, fused or reordered projections), which loads back to the same canonical values.

Router skew (`router_skew=S`, `--router-skew S`; 0, the default, leaves every weight bit-identical).
Random routers route near uniformly, so expert caches see no popular experts; S > 0 makes expert
popularity Zipf-like while routing still depends on the token:
  * a fixed random unit direction u (from the seed, shared by all layers) is added to every row of
    token_embd.weight (rows have norm ~1), so typical hidden states have a large positive
    component along u (x·u ~ sqrt(hidden/2) after the RMS norm at the first layer, less deeper down);
  * row e of each layer's ffn_gate_inp.weight gets + S * log(1/(rank(e)+1)) * u * sqrt(2/hidden), the
    rank being a per-layer random permutation of the experts (from the seed). Typical tokens thus see
    a router logit bias of about -S * log(rank+1) on top of the token-dependent N(0, 1) logits:
    rank 0 is favoured, rank 1 by S*log 2 less, and so on (a Zipf law with exponent ~S on the logits).
    Attention and expert outputs also write along u, so deeper layers see a weaker or even reversed
    x·u (then the low ranks are favoured): the routing is still skewed, just not in rank order.
On tiny-qwen3moe (8 experts, top-2) S=2 makes the top expert ~4x as frequent as uniform (in nearly every
top-2); with 32 experts ~16x, and LRU's decode hit rate at 4 slots rises from 0.31 (S=0) to 0.81.
The embedding offset shifts every output logit alike when embeddings are tied; untied heads gain a
small static per-token logit bias. Other tensors are unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from moerun.arch import FAMILIES, ModelSpec, expected_shapes, gguf_metadata
from moerun.arch.family import spec_from_hf
from moerun.formats.names import CName, gguf_name
from moerun.quant.qtypes import QType
from moerun.quant.quantize import quantize
from moerun.tools.gguf_out import FTYPES, TensorOut, file_type, gguf_shape, qtype_for, write_gguf
from moerun.tools.hf_out import (
    FUSED_EXPERTS,
    HYBRIDS,
    hf_config,
    hf_names,
    hf_shape,
    permute_to_hf,
    qkvz_to_hf,
    to_hf,
    write_safetensors,
)
from moerun.tools.outputs import atomic_dir, error_line
from moerun.tools.parallel import ordered_map, worker_pool
from moerun.tools.presets import ALIASES, preset, preset_names
from moerun.tools.tokenizer import build_tokenizer, gguf_tokenizer_metadata, special_ids, write_hf_tokenizer

__all__ = ["generate_part", "generate_tensor", "gguf_tensors", "main", "make_model", "model_metadata", "n_parts",
           "skew_popularity_ranks"]

PART_ELEMS = 1 << 22  # rows of a 2-D matrix are generated in blocks of at most this many weights
_HF_DTYPES = {"F32": QType.F32, "F16": QType.F16, "BF16": QType.BF16}


# ------------------------------------------------------------------------------------------ weights


def _generator(seed: int, name: str, part: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}\0{name}\0{part}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _part_rows(shape: tuple[int, ...]) -> int:
    """Rows of dimension 0 per part: one expert of a 3-D tensor, a block of rows of a 2-D one."""
    if len(shape) != 2:
        return 1 if len(shape) == 3 else shape[0]
    return max(1, PART_ELEMS // shape[1])


def _random_part(cn: CName, shape: tuple[int, ...], rows: int, gen: torch.Generator) -> torch.Tensor:
    if cn.kind == "ssm_a":  # -A with A uniform in [0.01, 16] (HF: A_log = log U(0, 16))
        return torch.rand((rows, *shape[1:]), generator=gen, dtype=torch.float32).mul_(-15.99).sub_(0.01)
    x = torch.randn((rows, *shape[1:]), generator=gen, dtype=torch.float32)
    if "norm" in cn.kind:
        return x.mul_(0.02).add_(1.0)
    if cn.kind.endswith(".bias"):
        return x.mul_(0.02)
    return x.mul_(shape[-1] ** -0.5)


def _skew_direction(seed: int, hidden: int) -> torch.Tensor:
    """The router-skew direction u: a unit vector of length `hidden`, a function of the seed only."""
    u = torch.randn(hidden, generator=_generator(seed, "router_skew.direction", 0), dtype=torch.float32)
    return u / u.norm()


def _skew_ranks(seed: int, layer: int, n_experts: int) -> torch.Tensor:
    """Popularity rank of each expert of `layer` (0 = most popular): a random permutation from the seed."""
    order = torch.randperm(n_experts, generator=_generator(seed, f"router_skew.rank.{layer}", 0))
    return torch.empty_like(order).scatter_(0, order, torch.arange(n_experts))


def skew_popularity_ranks(seed: int, layer: int, n_experts: int) -> list[int]:
    """Popularity rank per expert (0 = most popular) that `router_skew` gives layer `layer`."""
    return _skew_ranks(seed, layer, n_experts).tolist()


def _apply_skew(cn: CName, shape: tuple[int, ...], x: torch.Tensor, row0: int, seed: int, skew: float) \
        -> torch.Tensor:
    """Add the router-skew components (module docstring) to rows row0.. of `cn`; other tensors unchanged."""
    if not skew or len(shape) != 2 or cn.kind not in ("token_embd.weight", "ffn_gate_inp.weight"):
        return x
    hidden = shape[1]
    u = _skew_direction(seed, hidden)
    if cn.kind == "token_embd.weight":
        return x.add_(u)
    ranks = _skew_ranks(seed, cn.layer or 0, shape[0])[row0:row0 + x.shape[0]]
    scale = -skew * torch.log1p(ranks.to(torch.float32)) * (0.5 / hidden) ** 0.5
    return x.add_(scale[:, None] * u[None, :])


def n_parts(shape: tuple[int, ...]) -> int:
    return -(-shape[0] // _part_rows(shape))


def generate_part(cn: CName, shape: tuple[int, ...], seed: int, part: int, router_skew: float = 0.0) \
        -> torch.Tensor:
    """Part `part` of tensor `cn` along dimension 0: expert `part` of a stacked tensor, or a block of rows."""
    step = _part_rows(shape)
    rows = min(step, shape[0] - part * step)
    x = _random_part(cn, shape, rows, _generator(seed, cn.gguf, part))
    x = _apply_skew(cn, shape, x, part * step, seed, router_skew)
    return x[0] if len(shape) == 3 else x


def generate_tensor(cn: CName, shape: tuple[int, ...], seed: int = 0, router_skew: float = 0.0) -> torch.Tensor:
    """The whole canonical float32 tensor (for tests and small tensors)."""
    parts = [generate_part(cn, shape, seed, i, router_skew) for i in range(n_parts(shape))]
    return torch.stack(parts) if len(shape) == 3 else torch.cat(parts)


# --------------------------------------------------------------------------------------------- GGUF


def model_metadata(spec: ModelSpec, ftype: str, name: str) -> dict:
    """GGUF metadata of a synthetic model: llama.cpp hyperparameters, general.*, tokenizer."""
    meta = gguf_metadata(FAMILIES[spec.family], spec)
    meta |= {"general.name": name, "general.file_type": file_type(ftype), "general.quantization_version": 2}
    return meta | gguf_tokenizer_metadata(build_tokenizer(spec.vocab, spec.family), spec.family)


def gguf_tensors(spec: ModelSpec, ftype: str, seed: int = 0, pool: ThreadPoolExecutor | None = None,
                 router_skew: float = 0.0, shape_only: bool = False) -> list[TensorOut]:
    """Every tensor of a synthetic GGUF model, with producers that generate and quantize part by part
    (several parts at once on `pool`); shape_only: no producers (the data is left a hole of zeros)."""
    out = []
    for cn, shape in expected_shapes(spec).items():
        qtype = qtype_for(cn, shape, ftype, n_layers=spec.n_layers, tied_embeddings=spec.tie_embeddings)

        def produce(cn=cn, shape=shape, qtype=qtype) -> Iterator[torch.Tensor]:
            def part(i: int) -> torch.Tensor:
                return quantize(generate_part(cn, shape, seed, i, router_skew), qtype)

            return ordered_map(part, range(n_parts(shape)), pool)

        name = gguf_name(cn.kind, cn.layer, dict(FAMILIES[spec.family].gguf_aliases))
        out.append(TensorOut(name, qtype, gguf_shape(cn, shape), None if shape_only else produce))
    return out


# -------------------------------------------------------------------------------------- safetensors


def _fused_experts(cn: CName, shape: tuple[int, ...], name: str, dtype: QType, seed: int) -> TensorOut:
    """One stacked HF tensor of every expert (FUSED_EXPERTS): gate_up_proj [E, 2I, H] for ffn_gate_exps (each
    expert's gate rows, then its up rows) or down_proj [E, H, I]."""
    parts = [cn] if cn.kind == "ffn_down_exps.weight" else [cn, CName("ffn_up_exps.weight", cn.layer)]

    def produce() -> Iterator[torch.Tensor]:
        for e in range(shape[0]):
            yield quantize(torch.cat([generate_part(c, shape, seed, e) for c in parts]), dtype)

    return TensorOut(name, dtype, (shape[0], shape[1] * len(parts), shape[2]), produce)


def _hf_tensors(spec: ModelSpec, dtype: QType, seed: int, router_skew: float = 0.0) -> list[TensorOut]:
    """Tensors of the safetensors folder, per expert (or fused: FUSED_EXPERTS), under save_pretrained's names,
    stored as the family stores them (hf_out.to_hf)."""
    permute = {"attn_q.weight": spec.n_heads, "attn_k.weight": spec.n_kv_heads} if \
        FAMILIES[spec.family].hf_permute_qk else {}
    shapes = expected_shapes(spec)
    out = []
    for cn, shape in shapes.items():
        names = hf_names(spec.family, cn, spec.n_experts)
        if spec.family in FUSED_EXPERTS and len(shape) == 3:
            if cn.kind != "ffn_up_exps.weight":  # in gate_up_proj with ffn_gate_exps
                out.append(_fused_experts(cn, shape, names[0], dtype, seed))
            continue
        if spec.family == "qwen3next" and cn.kind in ("attn_qkv.weight", "attn_gate.weight"):
            if cn.kind == "attn_qkv.weight":
                gate = CName("attn_gate.weight", cn.layer)

                def produce(cn=cn, shape=shape, gate=gate) -> Iterator[torch.Tensor]:
                    yield quantize(qkvz_to_hf(spec, generate_tensor(cn, shape, seed),
                                              generate_tensor(gate, shapes[gate], seed)), dtype)

                out.append(TensorOut(names[0], dtype, (shape[0] + shapes[gate][0], shape[1]), produce))
            continue
        if len(shape) == 3:
            for e, name in enumerate(names):
                def produce(cn=cn, shape=shape, e=e) -> Iterator[torch.Tensor]:
                    yield quantize(generate_part(cn, shape, seed, e, router_skew), dtype)

                out.append(TensorOut(name, dtype, shape[1:], produce))
            continue

        def produce(cn=cn, shape=shape) -> Iterator[torch.Tensor]:
            if cn.kind in permute:
                yield quantize(permute_to_hf(generate_tensor(cn, shape, seed, router_skew), permute[cn.kind]),
                               dtype)
                return
            if spec.family in HYBRIDS:
                yield quantize(to_hf(spec, cn, generate_tensor(cn, shape, seed, router_skew)), dtype)
                return
            for i in range(n_parts(shape)):
                yield quantize(generate_part(cn, shape, seed, i, router_skew), dtype)

        out.append(TensorOut(names[0], dtype, hf_shape(spec, cn, shape), produce))
    return out


def _write_hf(spec: ModelSpec, out_path: Path, ftype: str, seed: int, overwrite: bool, progress: bool,
              router_skew: float = 0.0) -> Path:
    dtype = _HF_DTYPES.get(ftype.upper())
    if dtype is None:
        raise ValueError(f"safetensors output holds float weights: ftype must be F32, F16 or BF16, not {ftype}")
    tok = build_tokenizer(spec.vocab, spec.family)
    config = hf_config(spec, dtype, special_ids(tok))
    back = spec_from_hf(FAMILIES[spec.family], config)
    if back != spec:
        lost = [f.name for f in dataclasses.fields(spec) if getattr(back, f.name) != getattr(spec, f.name)]
        raise ValueError(f"{spec.family} config.json cannot express this spec's {', '.join(lost)}")
    tensors = _hf_tensors(spec, dtype, seed, router_skew)
    with atomic_dir(out_path, overwrite) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        ids = special_ids(tok)
        gen_cfg = {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]}
        (tmp / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
        write_hf_tokenizer(tok, tmp, spec.family)
        write_safetensors(tmp, tensors, progress=progress)
    return out_path


# --------------------------------------------------------------------------------------------- entry


def make_model(preset_or_spec: str | ModelSpec, out_path: str | Path, fmt: str = "gguf", ftype: str = "F32",
               seed: int = 0, overwrite: bool = False, progress: bool = True, name: str | None = None,
               threads: int | None = None, router_skew: float = 0.0, shape_only: bool = False) -> Path:
    """Write a model with random weights and a generated byte-level BPE tokenizer.

    preset_or_spec: a preset name (see moerun.tools.presets) or a ModelSpec.
    out_path: the .gguf file, or the folder of a Hugging Face model (fmt="safetensors").
    fmt: "gguf" or "safetensors".
    ftype: GGUF: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K, Q4_K_M or MXFP4_MOE (llama.cpp's mixes);
           safetensors: F32, F16 or BF16.
    seed: weights are a deterministic function of (seed, tensor name).
    overwrite: replace an existing output (otherwise FileExistsError; nothing is touched).
    progress: show a progress bar by bytes (only when stderr is a terminal).
    name: general.name in GGUF (default: the preset name, or "<family>-synthetic").
    threads: parts quantized at once (default: one per CPU); torch runs single-threaded meanwhile.
    router_skew: S >= 0; 0 (default) is plain random weights. S > 0 biases the routers so expert
           popularity is Zipf-like (rank r's logit lowered by ~S*log(r+1) for typical tokens; see the
           module docstring), still token-dependent. Deterministic from the seed.
    shape_only: GGUF only: metadata and tensor records of the right types and sizes, the data left zeros in a
           sparse file (no disk, no time): for `moerun estimate` and `inspect` on a model you do not have.
    Returns the path written.
    """
    spec = preset(preset_or_spec) if isinstance(preset_or_spec, str) else preset_or_spec
    name = name or (preset_or_spec if isinstance(preset_or_spec, str) else f"{spec.family}-synthetic")
    if ftype.upper() not in FTYPES:
        raise ValueError(f"unknown ftype '{ftype}' (known: {', '.join(FTYPES)})")
    if not router_skew >= 0:
        raise ValueError(f"router_skew must be >= 0, got {router_skew}")
    out_path = Path(out_path)
    if fmt == "gguf":
        meta = model_metadata(spec, ftype, name)
        with worker_pool(threads) as pool:
            return write_gguf(out_path, meta, gguf_tensors(spec, ftype, seed, pool, router_skew, shape_only),
                              overwrite=overwrite, progress=progress)
    if shape_only:
        raise ValueError("--shape-only writes GGUF files only")
    if fmt == "safetensors":
        return _write_hf(spec, out_path, ftype, seed, overwrite, progress, router_skew)
    raise ValueError(f"unknown format '{fmt}' (gguf or safetensors)")


def _parse_value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if "," in text:
        return tuple(_parse_value(t) for t in text.split(","))
    return text


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog or "python -m moerun.tools.make_model",
                                description="Write a synthetic MoE model with random weights.")
    p.add_argument("preset", help=f"shape: {', '.join(preset_names())}")
    p.add_argument("out", help="output .gguf file, or folder for --format safetensors")
    p.add_argument("--format", dest="fmt", choices=("gguf", "safetensors"), default="gguf")
    p.add_argument("--ftype", default="F32", help=f"{', '.join(FTYPES)} (safetensors: F32, F16, BF16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--name", help="general.name (GGUF)")
    p.add_argument("--threads", type=int, help="parts quantized at once (default: one per CPU)")
    p.add_argument("--shape-only", action="store_true",
                   help="write the metadata and tensor records only, the data a sparse hole of zeros: a file of "
                        "the model's shape and size for `moerun estimate` / `inspect` (GGUF)")
    p.add_argument("--router-skew", type=float, default=0.0, metavar="S",
                   help="bias the routers so expert popularity is Zipf-like: for typical tokens the expert of "
                        "popularity rank r loses ~S*log(r+1) in router logit (0, the default: plain random "
                        "weights; 2-4 makes a few experts dominate); deterministic from --seed")
    for flag in ("family", "layers", "hidden", "heads", "kv-heads", "head-dim", "experts", "experts-used",
                 "expert-ffn", "shared-ffn", "dense-ffn", "vocab", "context"):
        p.add_argument(f"--{flag}", type=str if flag == "family" else int, help="override the preset's value")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override any ModelSpec field, e.g. --set rope_theta=1e6 (repeatable)")
    args = p.parse_args(argv)
    overrides = {k: getattr(args, k) for k in ("family", "layers", "hidden", "heads", "kv_heads", "head_dim",
                                              "experts", "experts_used", "expert_ffn", "shared_ffn",
                                              "dense_ffn", "vocab", "context")}
    fields = {f.name for f in dataclasses.fields(ModelSpec)} | set(ALIASES)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            p.error(f"--set wants FIELD=VALUE with a ModelSpec field, got '{item}'")
        overrides[key] = _parse_value(value)
    try:
        spec = preset(args.preset, **overrides)
        path = make_model(spec, args.out, fmt=args.fmt, ftype=args.ftype, seed=args.seed,
                          overwrite=args.overwrite, progress=not args.no_progress, name=args.name or args.preset,
                          threads=args.threads, router_skew=args.router_skew, shape_only=args.shape_only)
    except (ValueError, FileExistsError, IsADirectoryError, NotADirectoryError) as e:
        print(error_line(e), file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
