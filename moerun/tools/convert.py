"""Convert a model moerun can open (a Hugging Face folder, or a GGUF file) to GGUF, tensor by tensor.

    convert_hf_to_gguf("Qwen3-30B-A3B/", "a3b.gguf", ftype="Q4_K_M")
    python -m moerun.tools.convert Qwen3-30B-A3B/ a3b.gguf --ftype Q4_K_M

The model is read with moerun's own readers (formats.open_model -> arch.resolve), so the output
holds the canonical tensors (stacked experts, Mixtral Q/K in llama.cpp's interleaved-RoPE order)
under their GGUF names with llama.cpp's hyperparameter keys. Each tensor (each expert, for
per-expert checkpoints) is dequantized to float32 and quantized to `qtype_for(...)` on its way to
the file; a tensor already stored in its target type is copied as is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from moerun.arch import Arch, Source, expected_shapes, gguf_metadata, resolve
from moerun.errors import MoerunError
from moerun.formats import open_model
from moerun.formats.names import gguf_name
from moerun.formats.records import ModelFile, TensorRecord
from moerun.quant.qtypes import QTensor, QType
from moerun.quant.quantize import quantize
from moerun.text.tokenizer import hf_chat_templates
from moerun.tools.gguf_out import FTYPES, TensorOut, file_type, gguf_shape, qtype_for, write_gguf
from moerun.tools.outputs import error_line
from moerun.tools.parallel import ordered_map, worker_pool
from moerun.tools.tokenizer import (
    PRE_PATTERNS,
    build_tokenizer,
    gguf_tokenizer_metadata,
    hf_tokenizer_to_gguf,
)
from moerun.weights.loader import materialize

__all__ = ["convert_hf_to_gguf", "gguf_tensor_plan", "main", "tokenizer_metadata"]


def _pre_tokenizer_name(tok_json: dict[str, Any]) -> str:
    """llama.cpp's tokenizer.ggml.pre for a byte-level BPE tokenizer.json; raises if not byte-level."""
    pre = tok_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if "ByteLevel" not in kinds:
        raise ValueError("tokenizer.json is not a byte-level BPE tokenizer (SentencePiece-style tokenizers "
                         "are not supported by this converter yet)")
    split = next((s for s in steps if s.get("type") == "Split"), None)
    if split is None:
        return "gpt2"
    return PRE_PATTERNS.get((split.get("pattern") or {}).get("Regex"), "default")


def _special_ids(folder: Path, vocab: dict[str, int]) -> dict[str, int]:
    """bos/eos/pad ids from tokenizer_config.json and config.json, where they say."""
    ids: dict[str, int] = {}
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
    for key in ("bos", "eos", "pad"):
        tok = tc.get(f"{key}_token")
        tok = tok.get("content") if isinstance(tok, dict) else tok
        if isinstance(tok, str) and tok in vocab:
            ids[key] = vocab[tok]
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    for key in ("bos", "eos", "pad"):
        v = cfg.get(f"{key}_token_id")
        if key not in ids and isinstance(v, int):
            ids[key] = v
    return ids


def tokenizer_metadata(mf: ModelFile, vocab: int) -> dict[str, Any]:
    """GGUF tokenizer keys: from the model's own tokenizer when it has one, else a generated one."""
    if mf.format == "gguf":
        keys = {k: v for k, v in mf.metadata.items() if k.startswith("tokenizer.")}
        if keys:
            return keys
    folder = Path(mf.metadata.get("dir", ""))
    path = folder / "tokenizer.json"
    if mf.format != "safetensors" or not path.is_file():
        return gguf_tokenizer_metadata(build_tokenizer(vocab))
    tok_json = json.loads(path.read_text(encoding="utf-8"))
    pre = _pre_tokenizer_name(tok_json)
    vocab_map = dict(tok_json["model"]["vocab"]) | {a["content"]: a["id"] for a in tok_json.get("added_tokens", [])}
    tc_path = folder / "tokenizer_config.json"
    templates = hf_chat_templates(folder, json.loads(tc_path.read_text()) if tc_path.is_file() else {})
    meta = hf_tokenizer_to_gguf(tok_json, templates.pop("default", None), _special_ids(folder, vocab_map),
                                pre)
    meta |= {f"tokenizer.chat_template.{name}": t for name, t in templates.items()}
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    if len(tokens) > vocab:
        raise ValueError(f"tokenizer has {len(tokens)} tokens but the model's vocabulary is {vocab}")
    meta["tokenizer.ggml.tokens"] = tokens + [f"[PAD{i}]" for i in range(len(tokens), vocab)]
    meta["tokenizer.ggml.token_type"] = types + [5] * (vocab - len(types))  # 5: unused
    return meta


def _producer(mf: ModelFile, src: Source, qtype: QType, pool: ThreadPoolExecutor | None):
    """Bytes of one canonical tensor in `qtype`, one expert at a time for stacked expert tensors."""
    def convert(q: QTensor) -> torch.Tensor:
        if q.qtype == qtype:
            return q.data.reshape(-1)
        return quantize(q.dequantize(torch.float32), qtype).reshape(-1)

    def produce() -> Iterator[torch.Tensor]:
        if src.stacked:  # one record per expert: never stack them in memory
            def expert(rec: TensorRecord) -> torch.Tensor:
                return convert(materialize(mf, dataclasses.replace(src, records=(rec,), stacked=False)))

            return ordered_map(expert, src.records, pool)
        q = materialize(mf, src)
        parts = [q[e] for e in range(q.shape[0])] if len(q.shape) == 3 else [q]
        return ordered_map(convert, parts, pool)

    return produce


def gguf_tensor_plan(mf: ModelFile, arch: Arch, ftype: str, pool: ThreadPoolExecutor | None = None) \
        -> list[TensorOut]:
    """The tensors of the GGUF output, in expected_shapes order, with streaming producers."""
    spec = arch.spec
    out = []
    for cn, shape in expected_shapes(spec).items():
        qtype = qtype_for(cn, shape, ftype, n_layers=spec.n_layers, tied_embeddings=spec.tie_embeddings)
        name = gguf_name(cn.kind, cn.layer, dict(arch.family.gguf_aliases))
        out.append(TensorOut(name, qtype, gguf_shape(cn, shape), _producer(mf, arch.sources[cn], qtype, pool)))
    return out


def convert_hf_to_gguf(hf_dir: str | Path, out_path: str | Path, ftype: str = "F32", overwrite: bool = False,
                       progress: bool = True, name: str | None = None, threads: int | None = None) -> Path:
    """Convert the model at `hf_dir` (Hugging Face folder; a GGUF file works too) to a GGUF file.

    ftype: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K, Q4_K_M or MXFP4_MOE (see gguf_out.qtype_for for the mixes).
    overwrite: replace an existing `out_path` (otherwise FileExistsError; nothing is touched).
    name: general.name (default: the input's folder or file name).
    threads: experts converted at once (default: one per CPU); torch runs single-threaded meanwhile.
    Returns the path written. Reading errors are moerun.errors.ModelFormatError.
    """
    if ftype.upper() not in FTYPES:
        raise ValueError(f"unknown ftype '{ftype}' (known: {', '.join(FTYPES)})")
    hf_dir = Path(hf_dir)
    with open_model(hf_dir) as mf:
        arch = resolve(mf)
        meta = gguf_metadata(arch.family, arch.spec)
        meta |= {"general.name": name or hf_dir.name.removesuffix(".gguf"), "general.file_type": file_type(ftype),
                 "general.quantization_version": 2}
        meta |= tokenizer_metadata(mf, arch.spec.vocab)
        with worker_pool(threads) as pool:
            return write_gguf(out_path, meta, gguf_tensor_plan(mf, arch, ftype, pool), overwrite=overwrite,
                              progress=progress)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog or "python -m moerun.tools.convert",
                                description="Convert a Hugging Face MoE model folder to GGUF.")
    p.add_argument("model", help="Hugging Face model folder (or a GGUF file to re-quantize)")
    p.add_argument("out", help="output .gguf file")
    p.add_argument("--ftype", default="F32", help=", ".join(FTYPES))
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--name", help="general.name")
    p.add_argument("--threads", type=int, help="experts converted at once (default: one per CPU)")
    args = p.parse_args(argv)
    try:
        path = convert_hf_to_gguf(args.model, args.out, ftype=args.ftype, overwrite=args.overwrite,
                                  progress=not args.no_progress, name=args.name, threads=args.threads)
    except (MoerunError, ValueError, FileExistsError, IsADirectoryError) as e:
        print(error_line(e), file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
