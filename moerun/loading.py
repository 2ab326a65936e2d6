"""One call from a path to a runnable model: formats -> arch -> weights -> model."""

from __future__ import annotations

import atexit
import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from moerun.arch import Arch, resolve
from moerun.experts.store import ExpertReader, FileSpan
from moerun.formats import open_model
from moerun.formats.names import CName
from moerun.formats.records import ModelFile
from moerun.hostmem import Arena, fits_in_ram, keep_freed_memory
from moerun.model.model import MoEModel
from moerun.progress import bar
from moerun.weights.loader import (
    interleavable,
    interleave_for_kernels,
    interleave_on_read,
    load_weights,
    source_bytes,
)
from moerun.weights.preload import Preload


@dataclass
class Loaded:
    file: ModelFile
    arch: Arch
    model: MoEModel


HOMES = ("auto", "ram", "mmap")

# load_model's gc.freeze() keeps everything alive at that moment out of the collector for good, even through
# the interpreter's last collection at exit: frozen objects in reference cycles are then never freed, and
# nanobind (triton's bindings) reports each of its own as leaked. At exit they go back to the collector.
atexit.register(gc.unfreeze)


def weights_home(mf: ModelFile, home: str = "auto") -> str:
    """Where the routed experts live: "ram" (copied into memory moerun owns) or "mmap" (the file's pages;
    dense weights are copied either way).

    auto: RAM when the file takes under 70% of the available memory, else the memory map (the page cache
    drops idle pages, so a model that fits is copied; DESIGN decision 10).
    """
    if home not in HOMES:
        raise ValueError(f"home must be one of {HOMES}, got {home!r}")
    if home != "auto":
        return home
    return "ram" if fits_in_ram(sum(r.nbytes for r in mf.records.values())) else "mmap"


def expert_reader(arch: Arch) -> ExpertReader | None:
    """Positioned reads of the routed experts straight from the file, when every stacked expert tensor is
    one stored record (GGUF); None otherwise (e.g. per-expert HF tensors, which are copied at load)."""
    spans = {}
    for layer, moe in enumerate(arch.spec.moe_layers):
        if not moe:
            continue
        parts = []
        for kind in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"):
            src = arch.sources[CName(kind, layer)]
            if not src.direct:
                return None
            rec = src.records[0]
            parts.append(FileSpan(str(rec.file), rec.offset, rec.nbytes // arch.spec.n_experts))
        spans[layer] = tuple(parts)
    return ExpertReader(spans) if spans else None


def load_model(path: str | Path | ModelFile, dtype: torch.dtype = torch.float32, kernels: bool = True,
               home: str = "auto", interleave: bool | Callable[[CName], bool] = True,
               progress: bool = False, arena: Arena | None = None, meanwhile: Callable[[], None] | None = None,
               preload: Preload | None = None) -> Loaded:
    """kernels=False runs quantized weights through the torch reference (dequantize per use).
    home: "auto", "ram" (llama.cpp's --no-mmap) or "mmap" (see weights_home).
    interleave: with the CPU kernels, rewrite the Q4_K matrices moerun owns into their faster interleaved
    layout (experts too when home is RAM; see interleave_for_kernels); a function of the canonical name
    chooses which. progress: bars on stderr for the bytes placed and repacked (moerun.progress). path may be a
    ModelFile already opened (its maps are then the loaded model's). arena: memory faulted in ahead for the copies
    (hostmem.Arena; closed once the weights are read, which returns what they did not take). meanwhile: work for
    this thread while the weights are read (load_weights), e.g. the tokenizer's build. preload: the reads started
    before the load (weights.preload.weights_ahead; its arena is the arena, and it is closed once the weights are
    read)."""
    mf = path if isinstance(path, ModelFile) else open_model(path)
    arch = resolve(mf)
    if kernels:
        keep_freed_memory()  # a prompt's temporaries reuse freed memory instead of faulting in fresh pages
    in_ram = weights_home(mf, home) == "ram"
    keep = None if interleave is True else interleave
    on_read = interleave_on_read(in_ram, keep) if kernels and interleave else None
    try:
        with bar(progress, "loading", sum(map(source_bytes, arch.sources.values()))) as placed:
            weights = load_weights(mf, arch, copy_experts=in_ram, progress=placed, interleave=on_read,
                                   arena=arena if preload is None else preload.arena, meanwhile=meanwhile,
                                   preload=preload)
    finally:
        if preload is not None:
            preload.close()
        if arena is not None:
            arena.close()
    if kernels and interleave:
        todo = sum(weights[cn].nbytes for cn in interleavable(weights, in_ram, keep))
        with bar(progress, "repacking", todo) as repacked:
            interleave_for_kernels(weights, experts=in_ram, keep=keep, progress=repacked)
    reader = None if in_ram else expert_reader(arch)
    loaded = Loaded(mf, arch, MoEModel(arch.spec, weights, dtype=dtype, kernels=kernels, expert_reader=reader))
    gc.freeze()  # the model's thousands of objects live as long as it: keep them out of every full collection
    return loaded
