"""Pipeline stages in separate processes, joined by torch.distributed (gloo on CPU, NCCL on GPUs).

Each rank loads only its layer range (rank 0 also the embeddings, the last rank the head). Rank 0 runs the
Engine: it embeds, runs its layers, tells every other rank what the step is (a control message), and sends
its hidden state to rank 1; rank r runs its layers on what rank r - 1 sent and passes it on; the last rank
applies the head and sends the logits back to rank 0, which samples. Between ranks go the hidden state
(float32: lossless for bfloat16 too), control messages and the logits, as tensors, point to point.

Workers keep no sequence state: a step names each sequence's KV blocks as rank 0's allocator handed them
out, and every rank's pool has rank 0's block geometry for its own layers. So truncating, reusing or
freeing a sequence on rank 0 needs no message. A control message is int64 words:

    header   [op, phase (0 prefill, 1 decode), last_only, batched, rows, pool_tokens, payload_len, 0]
    payload  [pool_seqs, copies, (src, dst) per copied KV block..., state copies, (src, dst) per copied state
              slot..., then per group of rows (one sequence): start, rows, state slot (-1: none), n_blocks (-1:
              no cache), block ids...]

The copies are what rank 0's pool copied since the last step (copy on write of a shared prefix block; a linear
layer's state into a checkpoint and back), which every rank repeats on its own layers before the step.

Every wait has a limit (`pipeline_timeout`) except a worker's wait for its next step, which may idle as
long as rank 0 does; a rank that exits or crashes closes its connections, which ends the others' waits
with a PipelineError naming it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from moerun import device
from moerun.arch import Arch, resolve
from moerun.config import RuntimeConfig
from moerun.engine.engine import Engine
from moerun.engine.kv_cache import KVPool, SeqKV
from moerun.engine.pipeline import Stage, StagedModel
from moerun.errors import MoerunError, PeerLostError
from moerun.experts.stats import CacheStats
from moerun.formats import open_model
from moerun.loading import Loaded, expert_reader, weights_home
from moerun.model.model import MoEModel
from moerun.weights.loader import interleave_for_kernels, interleave_on_read, load_weights

OP_STOP, OP_STEP, OP_STATS = 0, 1, 2
HEADER = 8
GATHER_TAG = 1  # Link.all_gather's messages between a pair of ranks (steps and statistics go with tag 0)
IDLE = timedelta(days=365)  # a worker waiting for rank 0's next step


class PipelineError(PeerLostError):
    """Another rank crashed, stopped or did not answer in time."""


@dataclass(frozen=True)
class Group:
    """Rows of one step that continue one sequence: positions start.., its KV blocks (None: no cache) and its
    linear layers' live state slot (-1: none)."""

    start: int
    rows: int
    blocks: tuple[int, ...] | None
    state: int = -1

    @classmethod
    def of(cls, kv: SeqKV | None, start: int, rows: int) -> Group:
        """The group of a sequence's cache (reserved for its rows)."""
        if kv is None:
            return cls(start, rows, None)
        return cls(start, rows, tuple(kv.blocks), kv.state_slot if kv.pool.recurrent else -1)


@dataclass(frozen=True)
class Step:
    phase: str
    last_only: bool
    batched: bool  # decode of several sequences (a cache per row) rather than one sequence's chunk
    groups: tuple[Group, ...]
    pool_tokens: int
    pool_seqs: int = 1  # sequences the pool holds at once (its linear layers' state slots)
    copies: tuple[tuple[int, int], ...] = ()  # KV blocks rank 0's pool copied since the last step, in order
    state_copies: tuple[tuple[int, int], ...] = ()  # state slots it copied since the last step, in order

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)

    def encode(self) -> tuple[torch.Tensor, torch.Tensor]:
        payload = [self.pool_seqs]
        for pairs in (self.copies, self.state_copies):
            payload += [len(pairs), *(i for pair in pairs for i in pair)]
        for g in self.groups:
            payload += [g.start, g.rows, g.state, -1] if g.blocks is None else \
                [g.start, g.rows, g.state, len(g.blocks), *g.blocks]
        header = [OP_STEP, int(self.phase == "decode"), int(self.last_only), int(self.batched), self.rows,
                  self.pool_tokens, len(payload), 0]
        return torch.tensor(header, dtype=torch.int64), torch.tensor(payload, dtype=torch.int64)

    @classmethod
    def decode(cls, header: torch.Tensor, payload: torch.Tensor) -> Step:
        h, p, groups = header.tolist(), payload.tolist(), []
        seqs, k, pairs = p[0], 1, []
        for _ in range(2):
            n = p[k]
            pairs.append(tuple(zip(p[k + 1:k + 1 + 2 * n:2], p[k + 2:k + 2 + 2 * n:2])))
            k += 1 + 2 * n
        while k < len(p):
            start, rows, state, n = p[k:k + 4]
            groups.append(Group(start, rows, None if n < 0 else tuple(p[k + 4:k + 4 + n]), state))
            k += 4 + max(n, 0)
        return cls("decode" if h[1] else "prefill", bool(h[2]), bool(h[3]), tuple(groups), h[5], seqs, *pairs)

    def positions(self) -> torch.Tensor:
        return torch.cat([torch.arange(g.start, g.start + g.rows) for g in self.groups])

    @classmethod
    def told(cls, phase: str, last_only: bool, batched: bool, groups: tuple[Group, ...],
             pool: KVPool | None) -> Step:
        """The step rank 0 tells the others: with its pool's geometry and the copies it made since the last
        (a MirroredPool's, taken)."""
        if pool is None:
            return cls(phase, last_only, batched, groups, 0)
        copies, states = pool.take_copies() if isinstance(pool, MirroredPool) else ((), ())
        return cls(phase, last_only, batched, groups, pool.n_slots, pool.seqs, copies, states)

    def worker_pool(self, pool: KVPool | None, make) -> KVPool | None:
        """A worker's pool for this step: `pool` while it has the step's geometry, else a new one of `make`
        (n_tokens, seqs); rank 0's copies repeated in it."""
        if self.pool_tokens and (pool is None or pool.n_slots != self.pool_tokens or pool.seqs != self.pool_seqs):
            pool = None
            pool = make(self.pool_tokens, self.pool_seqs)
            pool.allocator = _HandedBlocks(pool.allocator.n_blocks)
        for src, dst in self.copies:
            pool.copy_block(src, dst)
        for src, dst in self.state_copies:
            pool.copy_state(src, dst)
        return pool


class MirroredPool(KVPool):
    """Rank 0's KV pool when other ranks hold pools of the same geometry: the KV blocks and state slots it copies
    (copy on write, checkpoints) are listed for them to repeat (Step.told)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.copied: list[tuple[int, int]] = []
        self.states_copied: list[tuple[int, int]] = []

    def copy_block(self, src: int, dst: int) -> None:
        super().copy_block(src, dst)
        self.copied.append((src, dst))

    def copy_state(self, src: int, dst: int) -> None:
        super().copy_state(src, dst)
        self.states_copied.append((src, dst))

    def take_copies(self) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        out = tuple(self.copied), tuple(self.states_copied)
        self.copied.clear()
        self.states_copied.clear()
        return out


class Link:
    """Tensors between this rank and the others, point to point or all-gathered, every wait bounded and its
    failure named. name: the group's kind in messages ("pipeline", "expert-parallel"); error: what they raise.
    backend: gloo on CPUs; with GPUs "cpu:gloo,cuda:nccl" (each tensor goes by its device). gathers / gather_s:
    the all-gathers this rank took part in and the seconds it spent in them (waiting for the slowest rank's part
    included), since it joined or `gathers_reset`."""

    def __init__(self, rank: int, world: int, timeout: float, addr: str, port: int, backend: str = "gloo",
                 name: str = "pipeline", error: type[MoerunError] = PipelineError):
        self.rank, self.world, self.name, self.error = rank, world, name, error
        self.gathers, self.gather_s = 0, 0.0
        self.timeout = timedelta(seconds=timeout)
        try:
            dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                                    timeout=self.timeout)
        except Exception as e:  # noqa: BLE001 - DistStoreError, RuntimeError, socket errors: one line
            group = "the pipeline" if name == "pipeline" else f"the {name} group"
            raise error(f"rank {rank} of {world} could not join {group} at {addr}:{port} within {timeout:g} s: "
                        f"{_first_line(e)}") from None

    @classmethod
    def pipeline(cls, cfg: RuntimeConfig) -> Link:
        return cls(cfg.pipeline_rank, cfg.pipeline_world_size, cfg.pipeline_timeout, cfg.master_addr, cfg.master_port,
                   "gloo" if cfg.device == "cpu" else "nccl")

    def _fail(self, e: Exception, peer: int | None, what: str, timeout: timedelta) -> MoerunError:
        msg, who = str(e), "another rank" if peer is None else f"rank {peer}"
        if "Timed out" in msg or "timed out" in msg:
            why = f"{who} did not answer within {timeout.total_seconds():g} s"
        elif "closed by peer" in msg or "Connection reset" in msg or "Broken pipe" in msg:
            why = f"{who} is gone (it stopped or crashed; see its output)"
        else:
            why = _first_line(e)
        return self.error(f"{self.name} rank {self.rank}, {what}: {why}")

    def send(self, t: torch.Tensor, dst: int, what: str) -> None:
        try:
            dist.isend(t.contiguous(), dst).wait(self.timeout)
        except RuntimeError as e:
            raise self._fail(e, dst, what, self.timeout) from None

    def recv(self, t: torch.Tensor, src: int, what: str, timeout: timedelta | None = None) -> torch.Tensor:
        timeout = timeout or self.timeout
        try:
            dist.irecv(t, src).wait(timeout)
        except RuntimeError as e:
            raise self._fail(e, src, what, timeout) from None
        return t

    def all_gather(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Every rank's `t` (one shape on all), in rank order. A CPU tensor goes to every other rank by a pair
        exchange, the pairs in rank order, the lower rank sending first (GATHER_TAG): gloo runs a collective on
        its worker thread, and on a busy or virtual 2-core host that hand-off costs more than a pair's send and
        reply (bench/journal/issue-40.md: 0.9 ms against 0.2-0.35 ms between decode steps' layers); a device's
        tensor goes by the backend's all-gather (NCCL)."""
        parts = [torch.empty_like(t) for _ in range(self.world)]
        t0 = time.perf_counter()
        if t.device.type == "cpu":
            parts[self.rank] = t = t.contiguous()
            for q in (q for q in range(self.world) if q != self.rank):
                ops = [(dist.isend, t), (dist.irecv, parts[q])]
                try:
                    for op, buf in ops if self.rank < q else ops[::-1]:
                        op(buf, q, tag=GATHER_TAG).wait(self.timeout)
                except RuntimeError as e:
                    raise self._fail(e, q, what, self.timeout) from None
        else:
            try:
                dist.all_gather(parts, t.contiguous(), async_op=True).wait(self.timeout)
            except RuntimeError as e:
                raise self._fail(e, 1 - self.rank if self.world == 2 else None, what, self.timeout) from None
        self.gathers, self.gather_s = self.gathers + 1, self.gather_s + time.perf_counter() - t0
        return parts

    def gathers_reset(self) -> tuple[int, float]:
        """(gathers, gather_s) so far; both start again from zero."""
        out = self.gathers, self.gather_s
        self.gathers, self.gather_s = 0, 0.0
        return out

    def bounds(self, mine: list[int], what: str = "agreeing on the layer split") -> list[int]:
        """Rank 0's `mine` (the same length on every rank), e.g. its layer boundaries (world + 1 of them), so
        every rank loads the range rank 0 planned."""
        t = torch.tensor(mine, dtype=torch.int64)
        try:
            dist.broadcast(t, 0)
        except RuntimeError as e:
            raise self._fail(e, 0, what, self.timeout) from None
        return t.tolist()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def stage_weights(path: str | Path, layers: tuple[int, int], dtype: torch.dtype, home: str,
                  kernels: bool = True, interleave: bool = True) -> Loaded:
    """load_model for one stage: only layers [a, b), the embeddings on the first and the head on the last."""
    mf = open_model(path)
    arch = resolve(mf)
    (a, b), spec = layers, arch.spec

    def keep(cn) -> bool:
        if cn.layer is not None:
            return a <= cn.layer < b
        if cn.kind == "token_embd.weight":
            return a == 0 or (b == spec.n_layers and spec.tie_embeddings)
        return b == spec.n_layers

    mine = Arch(arch.family, spec, {cn: src for cn, src in arch.sources.items() if keep(cn)})
    in_ram = weights_home(mf, home) == "ram"
    weights = load_weights(mf, mine, copy_experts=in_ram,
                           interleave=interleave_on_read(in_ram) if kernels and interleave else None)
    if kernels and interleave:
        interleave_for_kernels(weights, experts=in_ram)
    reader = None if in_ram else expert_reader(arch)
    return Loaded(mf, arch, MoEModel(spec, weights, dtype=dtype, kernels=kernels, expert_reader=reader,
                                     layers=layers))


def stage_pool(model: MoEModel, n_tokens: int, seqs: int = 1, cls: type[KVPool] = KVPool) -> KVPool:
    """A KV pool for the model's own layers only. Sliding-window layers keep every position here: the ranks
    share rank 0's block tables, which say nothing of windows' rings."""
    return cls(model.spec, n_tokens, dtype=model.dtype, segments=[(model.first, model.stop, "cpu")],
               windows=False, seqs=seqs)


class RankEngine(Engine):
    """Rank 0's Engine when other ranks follow its steps: its KV pool is `pool(model.model, n_tokens, seqs,
    MirroredPool)`, whose copies the steps carry."""

    pool_of = staticmethod(stage_pool)

    def __init__(self, model: PipelineModel, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        self.pool = None  # the pool Engine made goes before this one is allocated
        self.pool = self.pool_of(model.model, self.ctx_size, 1, MirroredPool)

    def resize_pool(self, n_tokens: int, seqs: int = 1) -> None:
        if self.pool.allocator.n_free != self.pool.allocator.n_blocks:
            raise RuntimeError("resize_pool with sequences still holding KV blocks")
        self.pool = None
        self.pool = self.pool_of(self.model.model, n_tokens, seqs, MirroredPool)
        self._prepare()


class StageEngine(RankEngine):
    """Rank 0's Engine of a pipeline: its KV pool holds rank 0's layers only."""


class PipelineModel(StagedModel):
    """Rank 0's model: its own stage here, the others' on ranks 1.. (see the module docstring)."""

    def __init__(self, stage: Stage, link: Link):
        super().__init__([stage])
        self.link, self.stopped = link, False

    @property
    def logits_device(self) -> torch.device:
        return torch.device("cpu")  # the last rank sends them here

    @property
    def dev(self) -> device.Device:
        return device.CPU

    @torch.inference_mode()
    def _run(self, tokens, pos, kv, phase, last_only):
        m, link = self.model, self.link
        kvs = kv if isinstance(kv, list) else [kv]
        if isinstance(kv, list):
            groups = tuple(Group.of(k, int(p), 1) for p, k in zip(pos, kv))
        else:
            groups = (Group.of(kv, int(pos[0]), len(pos)),)
        step = Step.told(phase, last_only and not isinstance(kv, list), isinstance(kv, list), groups,
                         None if kv is None else kvs[0].pool)
        header, payload = step.encode()
        for r in range(1, link.world):
            link.send(header, r, "sending a step")
            if payload.numel():
                link.send(payload, r, "sending a step")
        with m.ops.step(len(tokens)):
            x = m.run_layers(m.embed(tokens), pos, kv, phase)
        link.send(x.float(), 1, "sending the hidden state")
        rows_out = len(groups) if step.last_only else step.rows
        logits = torch.empty((rows_out, m.spec.vocab), dtype=torch.float32)
        return link.recv(logits, link.world - 1, "waiting for the logits")

    def rank_label(self, r: int, plan) -> str:
        """How statistics name rank r (plan: rank 0's placement plan, one device per rank)."""
        a, b = plan.devices[r].layers
        return f"rank {r} (layers {a}-{b - 1})"

    def remote_stats(self, reset: bool = False) -> list[CacheStats | None]:
        """Each other rank's expert-cache statistics (None where it has no cache), in rank order; with
        `reset` the ranks start counting afresh."""
        out = []
        for r in range(1, self.link.world):
            self.link.send(torch.tensor([OP_STATS, int(reset), *[0] * (HEADER - 2)], dtype=torch.int64), r,
                           "asking for stats")
            n = int(self.link.recv(torch.zeros(1, dtype=torch.int64), r, "waiting for stats")[0])
            raw = self.link.recv(torch.zeros(n, dtype=torch.uint8), r, "waiting for stats") if n else None
            out.append(None if raw is None else CacheStats.from_dict(json.loads(bytes(raw.tolist()).decode())))
        return out

    def close(self) -> None:
        """Stop the other ranks (they exit) and leave the group; safe to call twice, and after a failure."""
        if self.stopped:
            return
        self.stopped = True
        try:
            for r in range(1, self.link.world):
                self.link.send(torch.tensor([OP_STOP, *[0] * (HEADER - 1)], dtype=torch.int64), r, "stopping")
        except self.link.error:
            pass  # a rank already gone has nothing to stop
        finally:
            self.link.close()


class _HandedBlocks:
    """A worker pool's allocator: rank 0's allocator chose the blocks; the worker is handed them per step."""

    def __init__(self, n_blocks: int):
        self.n_blocks, self.given = n_blocks, []

    @property
    def n_free(self) -> int:
        return self.n_blocks

    def allocate(self, n: int) -> list[int]:
        out, self.given = self.given[:n], self.given[n:]
        return out

    def free(self, blocks: list[int]) -> None:
        pass


def _borrowed(pool: KVPool, g: Group) -> SeqKV:
    """The sequence's cache on this worker: rank 0's blocks and state slot, filled up to g.start, room for
    g.rows more."""
    kv = SeqKV(pool, len(g.blocks) * pool.block_size)
    if g.state >= 0:
        kv.hold_state(g.state)
    pool.allocator.given = list(g.blocks)
    kv.reserve(len(g.blocks) * pool.block_size)
    kv.length = g.start
    return kv


def send_stats(link: Link, cache, reset: bool) -> None:
    """A worker's answer to OP_STATS: its expert cache's statistics (nothing without a cache); reset: it starts
    counting afresh."""
    raw = b"" if cache is None else json.dumps(cache.stats.to_dict()).encode()
    link.send(torch.tensor([len(raw)], dtype=torch.int64), 0, "sending stats")
    if raw:
        link.send(torch.frombuffer(bytearray(raw), dtype=torch.uint8), 0, "sending stats")
    if reset and cache is not None:
        cache.stats.reset()


def next_op(link: Link, header: torch.Tensor, stage: Stage) -> int:
    """A worker's next message from rank 0 into `header` -> its op (OP_STOP included); OP_STATS are answered here
    meanwhile. A worker may idle as long as rank 0 does."""
    while True:
        link.recv(header, 0, "waiting for the next step", timeout=IDLE)
        op = int(header[0])
        if op != OP_STATS:
            return op
        send_stats(link, stage.cache, bool(header[1]))


def serve_stage(cfg: RuntimeConfig, link: Link, model: MoEModel, stage: Stage) -> None:
    """A worker rank's loop: run each step rank 0 sends, until it says stop (or goes away)."""
    rank, last = link.rank, link.rank == link.world - 1
    header = torch.zeros(HEADER, dtype=torch.int64)
    pool: KVPool | None = None
    while next_op(link, header, stage) != OP_STOP:
        payload = torch.zeros(int(header[6]), dtype=torch.int64)
        if payload.numel():
            link.recv(payload, 0, "receiving a step")
        step = Step.decode(header, payload)
        pool = step.worker_pool(pool, lambda n, seqs: stage_pool(model, n, seqs))
        kvs = [None if g.blocks is None else _borrowed(pool, g) for g in step.groups]
        kv = kvs if step.batched else kvs[0]
        x = link.recv(torch.empty((step.rows, model.spec.hidden)), rank - 1, "waiting for the hidden state")
        with torch.inference_mode(), model.ops.step(step.rows):
            x = model.run_layers(x.to(model.dtype), step.positions(), kv, step.phase)
            if last:
                link.send(model._head(x[-1:] if step.last_only else x), 0, "sending the logits")
        if not last:
            link.send(x.float(), rank + 1, "sending the hidden state")
