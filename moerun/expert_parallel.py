"""Expert parallelism over processes, joined by torch.distributed (gloo on CPUs; with GPUs, NCCL for the
devices' tensors): every rank holds the dense weights and its share of each MoE layer's routed experts
(moerun.model.shards), and runs every layer on the same hidden states; per MoE layer one all-gather brings each
rank every rank's partial output, which each adds in rank order.

Rank 0 runs the Engine (scheduler, sampling, server). Before each step it tells every other rank what the step
is (a control message: the tokens, each sequence's start, KV blocks and state slot as rank 0's pool handed
them out, and what its pool copied since the last step); the others embed the same tokens, run the same layers
over KV caches and recurrent states of their own with rank 0's geometry (attention is replicated: every rank
holds every layer's KV and state) and skip the head. A control message is int64 words, distributed.py's with
the step's tokens after its payload:

    header   [op, phase (0 prefill, 1 decode), last_only, batched, rows, pool_tokens, payload_len, tokens]
    payload  [distributed.Step's payload..., the step's tokens...]

Every wait is bounded by `ep_timeout` except a worker's wait for its next step, which idles as long as rank 0
does; a rank that exits or crashes ends the others' waits with an ExpertParallelError naming it. Besides steps,
stop and statistics (distributed.py's), rank 0 may ask a rank for its all-gathers' count and seconds (OP_GATHERS,
header[1] = 1 to start them again; the answer: [gathers, nanoseconds]).

Rank 0's Engine sees every rank's expert cache through `RankCaches`: its own cache's statistics and the other
ranks' as last fetched (`refresh`, which the scheduler calls where it copies statistics for other threads),
one part per rank, so /metrics shows each rank as a series of its own.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import torch

from moerun import device
from moerun.arch import resolve
from moerun.config import RuntimeConfig
from moerun.distributed import (
    HEADER,
    OP_STOP,
    Group,
    Link,
    PipelineModel,
    RankEngine,
    Step,
    _borrowed,
    next_op,
)
from moerun.engine.kv_cache import KVPool, SeqKV
from moerun.engine.pipeline import Stage, StageStats, check_decode
from moerun.errors import PeerLostError
from moerun.experts.cache import ExpertCache
from moerun.experts.stats import CacheStats
from moerun.formats import open_model
from moerun.formats.names import CName
from moerun.loading import Loaded, expert_reader, weights_home
from moerun.model.model import MoEModel
from moerun.model.shards import shard_weights
from moerun.placement.expert_split import ExpertSplit, read_split
from moerun.weights.loader import interleave_for_kernels, interleave_on_read, load_weights

OP_GATHERS = 3


class ExpertParallelError(PeerLostError):
    """Another rank of the expert-parallel group crashed, stopped or did not answer in time."""


def expert_split(cfg: RuntimeConfig, spec) -> ExpertSplit:
    """Which rank owns which expert: cfg's split file, else contiguous ranges."""
    layers = [i for i, moe in enumerate(spec.moe_layers) if moe]
    if cfg.expert_split is not None:
        return read_split(cfg.expert_split, cfg.expert_parallel, spec.n_experts, layers)
    return ExpertSplit.ranges(cfg.expert_parallel, spec.n_experts, layers)


def join(cfg: RuntimeConfig) -> Link:
    """This process's place in the group (cfg.ep_rank of cfg.ep_world_size)."""
    backend = "cpu:gloo,cuda:nccl" if device.parse(cfg.device).is_cuda else "gloo"
    return Link(cfg.ep_rank, cfg.ep_world_size, cfg.ep_timeout, cfg.master_addr, cfg.master_port, backend,
                name="expert-parallel", error=ExpertParallelError)


def agree(link: Link, split: ExpertSplit) -> ExpertSplit:
    """Rank 0's split, on every rank (each may have read its own copy of a split file)."""
    layers = sorted(split.owner)
    flat = link.bounds([r for layer in layers for r in split.owner[layer]], "agreeing on the expert split")
    n = len(flat) // max(1, len(layers))
    return ExpertSplit(split.ranks, {layer: tuple(flat[k * n:(k + 1) * n]) for k, layer in enumerate(layers)})


def load_shard(path: str | Path, ids: dict[int, list[int]], dtype: torch.dtype, home: str,
               interleave: bool | Callable[[CName], bool] = True) -> Loaded:
    """load_model for one rank: the dense weights, and of each MoE layer's routed experts only those `ids` lists
    (layer -> ids), numbered 0.. in that order. Experts at home in RAM are copied from the file's map one shard's
    worth; at home in the file, read through the map or positioned reads of their own."""
    mf = open_model(path)
    arch = resolve(mf)
    in_ram = weights_home(mf, home) == "ram"
    keep = None if interleave is True else interleave
    weights = load_weights(mf, arch, copy_experts=False,
                           interleave=interleave_on_read(in_ram, keep) if interleave else None)
    shard_weights(weights, ids, own=in_ram)
    if interleave:
        interleave_for_kernels(weights, experts=in_ram, keep=keep)
    reader = None if in_ram else expert_reader(arch)
    model = MoEModel(arch.spec, weights, dtype=dtype, expert_reader=None if reader is None else reader.shard(ids))
    gc.freeze()  # as load_model: the model's objects live as long as the process
    return Loaded(mf, arch, model)


def rank_pool(model: MoEModel, n_tokens: int, seqs: int = 1, cls: type[KVPool] = KVPool) -> KVPool:
    """Every rank's KV pool: all layers, rank 0's geometry; sliding-window layers keep every position (the ranks
    share rank 0's block tables, which say nothing of windows' rings)."""
    return cls(model.spec, n_tokens, dtype=model.dtype, segments=model.kv_segments, windows=False, seqs=seqs)


class ExpertParallelEngine(RankEngine):
    """Rank 0's Engine: its KV pool is rank_pool's, its copies told to the other ranks."""

    pool_of = staticmethod(rank_pool)


class ExpertParallelModel(PipelineModel):
    """Rank 0's model: MoEModel's interface; each step is told to the other ranks, then run here (its MoE layers
    waiting on theirs). Statistics and stopping as a pipeline's."""

    @property
    def logits_device(self) -> torch.device:
        return self.model.logits_device

    @property
    def dev(self) -> device.Device:
        return self.model.dev

    def rank_label(self, r: int, plan) -> str:
        return f"rank {r}"

    def gathers(self, reset: bool = False) -> list[tuple[int, float]]:
        """Every rank's (all-gathers, seconds in them) in rank order (Link.gathers); reset: all start again."""
        out = [self.link.gathers_reset() if reset else (self.link.gathers, self.link.gather_s)]
        for r in range(1, self.link.world):
            self.link.send(torch.tensor([OP_GATHERS, int(reset), *[0] * (HEADER - 2)], dtype=torch.int64), r,
                           "asking for all-gather times")
            n, ns = self.link.recv(torch.zeros(2, dtype=torch.int64), r, "waiting for all-gather times").tolist()
            out.append((n, ns / 1e9))
        return out

    def forward(self, tokens: torch.Tensor, kv: SeqKV | None = None, last_only: bool = False,
                phase: str | None = None) -> torch.Tensor:
        """As MoEModel.forward."""
        phase = phase or ("prefill" if len(tokens) > 1 else "decode")
        if kv is not None:
            kv.reserve(len(tokens))
        group = Group.of(kv, 0 if kv is None else kv.length, len(tokens))
        self._tell(tokens, (group,), phase, last_only, False, None if kv is None else kv.pool)
        return self.model.forward(tokens, kv, last_only, phase)

    def decode(self, tokens: torch.Tensor, kvs: list[SeqKV], phase: str = "decode") -> torch.Tensor:
        """As MoEModel.decode."""
        check_decode(tokens, kvs)
        for kv in kvs:
            kv.reserve(1)
        self._tell(tokens, tuple(Group.of(kv, kv.length, 1) for kv in kvs), phase, False, True, kvs[0].pool)
        return self.model.decode(tokens, kvs, phase)

    def _tell(self, tokens: torch.Tensor, groups: tuple[Group, ...], phase: str, last_only: bool, batched: bool,
              pool: KVPool | None) -> None:
        header, payload = Step.told(phase, last_only, batched, groups, pool).encode()
        payload = torch.cat([payload, tokens.to(torch.int64).cpu()])
        header[6], header[7] = len(payload), len(tokens)
        for r in range(1, self.link.world):
            self.link.send(header, r, "sending a step")
            self.link.send(payload, r, "sending a step")


class RankStats(StageStats):
    """Every rank's expert-cache statistics, rank 0's own first, then the other ranks' as `RankCaches.refresh`
    last fetched them; ranks 0.. in order. `reset` starts every rank counting afresh (a round trip to each: on
    the thread that runs the model's steps only, as everything that uses the link)."""

    def __init__(self, own: CacheStats, model: ExpertParallelModel):
        super().__init__([own, *(CacheStats() for _ in range(1, model.link.world))], range(model.link.world))
        self.model = model

    def reset(self) -> None:
        self.parts[0].reset()
        self.model.remote_stats(reset=True)
        self.parts[1:] = [CacheStats() for _ in self.parts[1:]]


class RankCaches:
    """Rank 0's expert cache where the Engine expects one, its `.stats` every rank's (RankStats). The other
    ranks' figures are copies: `refresh` fetches them (a round trip to each rank; call it on the thread that
    runs the model's steps, never from another: the link is not thread-safe). The rest is rank 0's cache."""

    def __init__(self, cache: ExpertCache, model: ExpertParallelModel):
        self.cache, self.model = cache, model
        self.stats = RankStats(cache.stats, model)

    def refresh(self) -> None:
        """The other ranks' statistics as they are now (a rank without a cache counts nothing)."""
        fetched = self.model.remote_stats()
        self.stats.parts[1:] = [CacheStats() if s is None else s for s in fetched]

    @property
    def prefetching(self) -> bool:
        return self.cache.prefetching

    @property
    def nbytes(self) -> int:
        """Rank 0's cache's bytes (the other ranks' are theirs)."""
        return self.cache.nbytes

    def settle(self, wait: bool = True) -> None:
        self.cache.settle(wait)

    def close(self) -> None:
        self.cache.close()


def serve_rank(link: Link, model: MoEModel, stage: Stage) -> None:
    """A rank other than 0: run each step rank 0 sends, until it says stop (or goes away)."""
    header = torch.zeros(HEADER, dtype=torch.int64)
    pool: KVPool | None = None
    while (op := next_op(link, header, stage)) != OP_STOP:
        if op == OP_GATHERS:
            n, s = link.gathers_reset() if header[1] else (link.gathers, link.gather_s)
            link.send(torch.tensor([n, round(s * 1e9)], dtype=torch.int64), 0, "sending all-gather times")
            continue
        payload = link.recv(torch.zeros(int(header[6]), dtype=torch.int64), 0, "receiving a step")
        n_tokens = int(header[7])
        tokens, step = payload[len(payload) - n_tokens:], Step.decode(header, payload[:len(payload) - n_tokens])
        pool = step.worker_pool(pool, lambda n, seqs: rank_pool(model, n, seqs))
        kvs = [None if g.blocks is None else _borrowed(pool, g) for g in step.groups]
        with torch.inference_mode(), model.ops.step(step.rows), device.use(model.dev):
            model.run_layers(model.embed(tokens), step.positions(), kvs if step.batched else kvs[0], step.phase)
