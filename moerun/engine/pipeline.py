"""Stages in one process: contiguous layer ranges, each a MoEModel of its own (`MoEModel.slice`) on its device,
with its own expert source and cache.

A `StagedModel` has MoEModel's interface (forward, decode, spec, dtype, on_route, kv_segments,
logits_device) for the Engine and the scheduler. The embeddings run on the first stage, the head on the
last; between stages only the hidden state moves (`device.move`, a peer copy), each stage inside its device's
context (`device.use`, where its kernels launch). Stage k's KV cache is its
layers' segment of the sequence's pool, on its device. Expert statistics are kept per stage (each stage's
ExpertCache has its own CacheStats); `StageCaches` reads them as one, so totals are the sum of the stages'
figures by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from moerun import device
from moerun.engine.kv_cache import SeqKV
from moerun.experts.cache import ExpertCache
from moerun.experts.stats import CacheStats, Counters
from moerun.model.model import MoEModel
from moerun.model.moe import Experts


@dataclass
class Stage:
    model: MoEModel  # the stage's layers only (MoEModel.slice), on its device, with its expert source
    cache: ExpertCache | None = None
    name: str = ""  # how statistics name it ("" : by its index and label); under expert parallelism, its rank

    @property
    def layers(self) -> tuple[int, int]:  # [start, stop)
        return self.model.first, self.model.stop

    @property
    def device(self):
        return self.model.dev

    @property
    def experts(self) -> Experts:
        return self.model.experts

    @property
    def label(self) -> str:
        a, b = self.layers
        return f"{self.device}, layers " + (f"{a}-{b - 1}" if b > a else "none")


class StageStats(CacheStats):
    """Several stages' statistics read as one CacheStats (a layer present in two, as under expert parallelism,
    is summed). Read-only: each stage's cache records into its own; `reset` resets them all. ranks: the
    expert-parallel rank of each part (None: the parts are layer stages). `stats + CacheStats()` (how the scheduler
    copies statistics for other threads) is a StageStats of copies, so each part still shows."""

    def __init__(self, parts: Sequence[CacheStats], ranks: Sequence[int] | None = None):
        self.parts = list(parts)
        self.ranks = None if ranks is None else tuple(ranks)

    @property
    def _c(self) -> dict[tuple[int, str], Counters]:
        out: dict[tuple[int, str], Counters] = {}
        for part in self.parts:
            for key, c in part._c.items():
                out.setdefault(key, Counters()).add(c)
        return out

    def add(self, layer: int, phase: str, **counts) -> None:
        raise TypeError("StageStats is read-only: record into a stage's own statistics")

    def reset(self) -> None:
        for part in self.parts:
            part.reset()

    def merge(self, other: CacheStats) -> StageStats:
        """A StageStats of the parts' copies, `other` counted with the first part."""
        parts = [part + CacheStats() for part in self.parts] or [CacheStats()]
        parts[0] = parts[0] + other
        return StageStats(parts, self.ranks if self.parts else None)

    __add__ = merge


class StageCaches:
    """The stages' expert caches where the Engine expects one: `.stats` sums them, `.stages` lists them. ranks:
    each stage's expert-parallel rank (None: layer stages)."""

    def __init__(self, stages: Sequence[Stage], ranks: Sequence[int] | None = None):
        keep = [k for k, st in enumerate(stages) if st.cache is not None]
        self.stages = [stages[k] for k in keep]
        self.stats = StageStats([st.cache.stats for st in self.stages],
                                None if ranks is None else [ranks[k] for k in keep])

    @property
    def prefetching(self) -> bool:
        return any(st.cache.prefetching for st in self.stages)

    @property
    def nbytes(self) -> int:
        return sum(st.cache.nbytes for st in self.stages)

    def close(self) -> None:
        for st in self.stages:
            st.cache.close()


class StagedModel:
    """One model's layers run stage by stage in this process; see the module docstring."""

    def __init__(self, stages: Sequence[Stage]):
        bounds = [st.layers for st in stages]
        if not stages or any(a[1] != b[0] for a, b in pairwise(bounds)):
            raise ValueError(f"stages {bounds} do not cover consecutive layers in order")
        self.stages = list(stages)

    @property
    def model(self) -> MoEModel:
        """The first stage's model (the one that embeds)."""
        return self.stages[0].model

    @property
    def spec(self):
        return self.model.spec

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def on_route(self):
        return self.model.on_route

    @on_route.setter
    def on_route(self, fn) -> None:
        for st in self.stages:
            st.model.on_route = fn

    @property
    def kv_segments(self) -> list:
        return [seg for st in self.stages for seg in st.model.kv_segments if seg[0] < seg[1]]

    @property
    def logits_device(self) -> torch.device:
        return self.stages[-1].model.logits_device

    @property
    def dev(self) -> device.Device:
        """Where the logits are computed (the last stage's device)."""
        return self.stages[-1].model.dev

    @torch.inference_mode()
    def _run(self, tokens: torch.Tensor, pos: torch.Tensor, kv: SeqKV | list[SeqKV] | None, phase: str,
             last_only: bool) -> torch.Tensor:
        m = self.model
        with m.ops.step(len(tokens)):
            with device.use(m.dev):
                x = m.embed(tokens)
            for st in self.stages:  # each stage's kernels launch on its own device
                with device.use(st.model.dev):
                    x = st.model.run_layers(device.move(x, st.model.dev), pos, kv, phase)
            with device.use(self.stages[-1].model.dev):
                return self.stages[-1].model._head(x[-1:] if last_only else x)

    def forward(self, tokens: torch.Tensor, kv: SeqKV | None = None, last_only: bool = False,
                phase: str | None = None) -> torch.Tensor:
        """As MoEModel.forward."""
        phase = phase or ("prefill" if len(tokens) > 1 else "decode")
        start = 0 if kv is None else kv.length
        if kv is not None:
            kv.reserve(len(tokens))
        logits = self._run(tokens, torch.arange(start, start + len(tokens)), kv, phase, last_only)
        if kv is not None:
            kv.length = start + len(tokens)
        return logits

    def decode(self, tokens: torch.Tensor, kvs: list[SeqKV], phase: str = "decode") -> torch.Tensor:
        """As MoEModel.decode."""
        check_decode(tokens, kvs)
        for kv in kvs:
            kv.reserve(1)
        logits = self._run(tokens, torch.tensor([kv.length for kv in kvs], dtype=torch.int64), list(kvs), phase,
                           False)
        for kv in kvs:
            kv.length += 1
        return logits

def check_decode(tokens: torch.Tensor, kvs: list[SeqKV]) -> None:
    B = len(tokens)
    if B != len(kvs) or B == 0 or len({id(kv) for kv in kvs}) != B:
        raise ValueError(f"decode takes one token for each of distinct sequences: {B} tokens, {len(kvs)} caches")
