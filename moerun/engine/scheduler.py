"""Continuous batching (nano-vllm's shape): one engine loop, requests joining between steps.

    sched = Scheduler(engine, parallel=4, max_queue=64)
    sched.submit(Request(prompt_ids, params, emit))   # any thread; QueueFullError past the bound
    while sched.has_work(): sched.step()              # the engine loop (EngineLoop runs it on a thread)

A step: drop cancelled requests (their KV blocks freed); admit waiting requests into idle slots; one decode
step for every slot with a token to feed, all through the model together (MoEModel.decode: the MoE
layers see the union of their experts); then prompt chunks (`ubatch` tokens each, oldest request first) until `ubatch` prompt
tokens were run. A long prompt advances a chunk per step while the other streams keep decoding.

Slots are llama-server's: there are `parallel` of them, each may hold a whole context, and each keeps its
KV cache after a request, so a request goes to the idle slot sharing the longest prefix with its prompt
and runs only the rest (a chat resending its history). Events reach the caller through `Request.emit`,
called on the engine thread; the last one has `finish_reason` set.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from moerun import device
from moerun.config import DraftParams, SamplingParams
from moerun.engine.engine import Engine, Sequence, common_prefix
from moerun.engine.kv_cache import ContextOverflowError, SeqKV
from moerun.engine.sampler import NAN_TOKEN, Sampler, StopChecker
from moerun.engine.timings import Timings
from moerun.errors import NAN_LOGITS, ModelFormatError, MoerunError, PeerLostError
from moerun.experts.stats import PHASES, CacheStats, Counters

log = logging.getLogger(__name__)


class QueueFullError(MoerunError):
    """Every slot is busy and the waiting queue is full."""


class ModelUnavailableError(MoerunError):
    """The model file could not be read during a step (truncated or changed while in use), or another process of
    a model split over processes is gone: no new requests."""


class SlotBusyError(MoerunError):
    """A slot that is running a request cannot be erased."""


@dataclass(frozen=True)
class Event:
    """New text of one request; the last event has finish_reason: stop | length | cancelled | error. logprobs:
    the entries (Request.logprobs) of the tokens sampled since the previous event, when the request asked; stop_word:
    on the last event, the stop string that ended the request (None when another reason did)."""

    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    logprobs: tuple = ()
    stop_word: str | None = None


def _no_events(event: Event) -> None:
    pass


@dataclass(eq=False)
class Request:
    """What a client asked for; after its last event, what it got (tokens, timings, cache lookups)."""

    prompt: list[int]
    params: SamplingParams
    emit: Callable[[Event], None] = _no_events
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    cache_prompt: bool = True
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    timings: Timings = field(default_factory=Timings)
    cache: dict[str, Counters] = field(default_factory=lambda: {ph: Counters() for ph in PHASES})
    seed: int | None = None
    slot: int | None = None
    t_first: float | None = None
    t_end: float | None = None
    # log probabilities: None, or how many alternatives per token (0: the chosen token's only); then one entry
    # per generated token, (id, log probability, ((id, log probability), ...)) from the logits before sampling
    top_logprobs: int | None = None
    logprobs: list[tuple] = field(default_factory=list)
    grammar: str | None = None  # llguidance's: the output must follow it (moerun.engine.grammar)
    on_prompt: Callable[[], None] | None = None  # called on the engine thread once the prompt is in the cache
    draft: DraftParams | None = None  # speculative decoding's settings for this request (None: the engine's)

    def cancel(self) -> None:
        """Drop the request at the next step (its client went away)."""
        self.cancelled = True

    @property
    def cache_hits(self) -> int:
        return sum(c.hits for c in self.cache.values())

    @property
    def cache_queries(self) -> int:
        return sum(c.queries for c in self.cache.values())


class Observer:
    """What the scheduler reports as it goes (metrics, logs): called on the engine thread."""

    def prompt_done(self, req: Request) -> None:
        pass

    def token(self, req: Request, gap: float | None) -> None:
        """A token was sampled; gap: seconds since the request's previous one (None for the first)."""

    def finished(self, req: Request) -> None:
        pass


class Slot:
    """One of the `parallel` places a request runs in: its KV cache outlives the request."""

    def __init__(self, index: int, seq: Sequence, ctx_size: int):
        self.index, self.seq = index, seq
        self.history = torch.empty(ctx_size, dtype=torch.long)  # prompt + sampled ids, for the penalties
        self.req: Request | None = None
        self.last_used = 0.0
        self.todo: list[int] = []  # prompt tokens still to run
        self.next_token: int | None = None  # sampled, to be fed to the model
        self.n_history = 0
        self.sampler: Sampler | None = None
        self.decoder = self.stops = None
        self.t_prefill = self.t_token = 0.0
        self.unsent = 0  # log-probability entries not yet sent with an event
        self.constraint = None  # the request's grammar state (moerun.engine.grammar.Constraint)
        self.spec = None  # the request's speculative decoding (moerun.engine.speculative.Speculation)

    @property
    def kv(self) -> SeqKV:
        return self.seq.kv


@dataclass(frozen=True)
class Snapshot:
    """The scheduler's state for metrics and logs (read from any thread)."""

    running: int
    waiting: int
    kv_usage: float
    kv_tokens: int
    prompt_tokens: int
    generated_tokens: int
    cache: CacheStats | None
    prefix_queries: int = 0  # prompt tokens of admitted requests, and those found in the KV cache
    prefix_hits: int = 0
    tokens_in_flight: int = 0  # the running requests' prompt and generated tokens, and the waiting ones' prompts
    kv_running_usage: float = 0.0  # positions the running requests' slots hold / the KV cache's (vLLM's usage)


def _diff(after: Counters, before: Counters) -> Counters:
    return Counters(**{f.name: getattr(after, f.name) - getattr(before, f.name) for f in fields(Counters)})


class Scheduler:
    def __init__(self, engine: Engine, parallel: int = 4, max_queue: int = 64, observer: Observer | None = None):
        if parallel < 1 or max_queue < 0:
            raise ValueError("parallel must be >= 1 and max_queue >= 0")
        self.engine, self.max_queue = engine, max_queue
        self.observer = observer or Observer()
        bs = engine.pool.block_size
        engine.resize_pool(parallel * -(-engine.ctx_size // bs) * bs, seqs=parallel)  # every slot can fill the context
        if hasattr(engine.drafter, "resize"):  # a draft model's KV: a context for every slot too
            engine.drafter.resize(parallel)
        self.slots = [Slot(i, engine.new_sequence(), engine.ctx_size) for i in range(parallel)]
        self._waiting: deque[Request] = deque()
        self._active = 0  # admitted, not finished
        self._cond = threading.Condition()
        self.prompt_tokens = self.generated_tokens = 0
        self.prefix_queries = self.prefix_hits = 0
        self._cache_copy: CacheStats | None = None
        self._copied_at = 0.0
        self._erase: deque[tuple[int, Callable[[Slot], Any], Future]] = deque()  # slot operations
        self.fault: str | None = None  # why the model cannot be used any more; set once, by the engine thread
        self.peer_lost = False  # the fault is a process the model runs across gone (PeerLostError)
        # the requests of the forward pass running (engine thread): one per row of a decode step, or the one
        # request of a prompt chunk; for hooks that watch the model, such as serve's routing trace
        self.step_requests: tuple[Request, ...] = ()

    # -- any thread ----------------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        if not req.prompt:
            raise ValueError("empty prompt")
        if len(req.prompt) >= self.engine.ctx_size:
            raise ContextOverflowError(f"the prompt has {len(req.prompt)} tokens but the context size is "
                                       f"{self.engine.ctx_size}")
        if self.fault is not None:
            raise ModelUnavailableError(f"the model cannot be used any more: {self.fault}; restart the server")
        with self._cond:
            if len(self._waiting) + self._active >= len(self.slots) + self.max_queue:
                raise QueueFullError(f"server busy: {self._active} requests running and {len(self._waiting)} "
                                     f"waiting (--parallel {len(self.slots)}, --max-queue {self.max_queue}); "
                                     "retry later")
            self._waiting.append(req)
            self._cond.notify()

    def has_work(self) -> bool:
        return bool(self._waiting) or bool(self._erase) or any(s.req is not None for s in self.slots)

    def erase(self, index: int) -> Future:
        """Free an idle slot's KV cache at the next step (llama-server's `action=erase`) -> a Future of the
        number of positions it held; SlotBusyError if the slot is running a request."""
        def erase(slot: Slot) -> int:
            held = slot.kv.length
            slot.seq.free()
            return held

        return self.slot_op(index, erase)

    def slot_op(self, index: int, fn: Callable[[Slot], Any]) -> Future:
        """fn(slot) on the engine thread at the next step, when the slot is idle (erase, save, restore) -> a
        Future of its result; SlotBusyError if the slot is running a request, fn's own error if it fails."""
        if not 0 <= index < len(self.slots):
            raise IndexError(f"no slot {index} (there are {len(self.slots)})")
        done: Future = Future()
        with self._cond:
            self._erase.append((index, fn, done))
            self._cond.notify()
        return done

    def wait_for_work(self, timeout: float, or_until: Callable[[], bool] = lambda: False) -> bool:
        """Sleep until there is work (-> True), `or_until()` holds after a wake(), or timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self.has_work() or or_until(), timeout) and self.has_work()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def snapshot(self) -> Snapshot:
        alloc = self.engine.pool.allocator
        # each slot's request read once: the engine thread sets and clears them meanwhile
        busy = [(s, r) for s, r in ((s, s.req) for s in self.slots) if r is not None]
        with self._cond:
            waiting = list(self._waiting)
        in_flight = sum(len(r.prompt) + len(r.tokens) for _, r in busy) + sum(len(r.prompt) for r in waiting)
        positions = alloc.n_blocks * self.engine.pool.block_size
        return Snapshot(running=len(busy), waiting=len(waiting),
                        kv_usage=1.0 - alloc.n_free / alloc.n_blocks, kv_tokens=sum(s.kv.length for s in self.slots),
                        prompt_tokens=self.prompt_tokens, generated_tokens=self.generated_tokens,
                        cache=self._cache_copy, prefix_queries=self.prefix_queries, prefix_hits=self.prefix_hits,
                        tokens_in_flight=in_flight,
                        kv_running_usage=min(1.0, sum(s.kv.length for s, _ in busy) / positions) if positions else 0.0)

    # -- the engine thread ---------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> None:
        for slot in self.slots:
            if slot.req is not None and slot.req.cancelled:
                self._finish(slot, "cancelled")
        self._erase_slots()
        if self.peer_lost:  # no step can run any more: each would wait on the lost process again
            self.abort_all(f"the model cannot be used any more: {self.fault}")
            return
        self._admit()
        self._decode()
        self._prefill()
        self._copy_cache_stats()

    def abort_all(self, message: str) -> None:
        """Fail every request, running or waiting (shutting down)."""
        for slot in self.slots:
            if slot.req is not None:
                self._finish(slot, "error", message)
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
            erasing, self._erase = list(self._erase), deque()
        for req in waiting:
            self._drop(req, "error", message)
        for _, _, done in erasing:
            done.set_exception(ModelUnavailableError(message))

    def _erase_slots(self) -> None:
        while True:
            with self._cond:
                if not self._erase:
                    return
                index, fn, done = self._erase.popleft()
            slot = self.slots[index]
            if slot.req is not None:
                done.set_exception(SlotBusyError(f"slot {index} is processing request {slot.req.id}"))
                continue
            try:
                done.set_result(fn(slot))
            except Exception as e:  # noqa: BLE001 - reported to the caller; the loop goes on
                done.set_exception(e)

    def _drop(self, req: Request, reason: str, error: str | None = None) -> None:
        """End a request that never reached a slot."""
        req.finish_reason, req.t_end = reason, time.perf_counter()
        self.observer.finished(req)
        req.emit(Event(finish_reason=reason, error=error))

    def _admit(self) -> None:
        while True:
            with self._cond:
                idle = [s for s in self.slots if s.req is None]
                if not self._waiting or not idle:
                    return
                req = self._waiting.popleft()
                if not req.cancelled:
                    self._active += 1
            if req.cancelled:
                self._drop(req, "cancelled")
                continue
            self._start(max(idle, key=lambda s: (
                common_prefix(s.seq.tokens, req.prompt) if req.cache_prompt else -s.kv.length, -s.last_used)), req)

    def _start(self, slot: Slot, req: Request) -> None:
        if not req.cache_prompt:
            slot.seq.free()
        slot.req, slot.todo = req, self.engine.reuse_prefix(slot.seq, req.prompt, shared=req.cache_prompt)
        req.slot, req.timings.cache_n = slot.index, len(req.prompt) - len(slot.todo)
        self.prefix_queries += len(req.prompt)
        self.prefix_hits += req.timings.cache_n
        slot.sampler = Sampler(req.params, self.engine.model.spec.vocab, device=self.engine.model.logits_device)
        req.seed = slot.sampler.seed
        slot.decoder = self.engine.tokenizer.incremental_decoder(prefix_ids=req.prompt[-1:])
        slot.stops = StopChecker(req.params.stop)
        slot.history[:len(req.prompt)] = torch.tensor(req.prompt)
        slot.n_history, slot.next_token, slot.t_prefill, slot.unsent = len(req.prompt), None, 0.0, 0
        slot.spec = self.engine.speculation(slot.seq, req.draft or self.engine.draft)
        try:
            slot.constraint = None if req.grammar is None else self.engine.grammars.constraint(req.grammar)
        except MoerunError as e:  # compiled when the request came in, so this is not expected: fail it alone
            slot.todo = []
            self._finish(slot, "error", str(e))

    def _run(self, slots: list[Slot], phase: str, forward: Callable[..., torch.Tensor], *args) -> torch.Tensor | None:
        """forward(*args) with the cache lookups it made credited to each of `slots`; on an error those requests
        fail (their KV freed) and the loop goes on."""
        if self.peer_lost:  # every step would wait on the lost process again
            for slot in slots:
                self._finish(slot, "error", f"the model cannot be used any more: {self.fault}")
            return None
        stats = self.engine.expert_cache.stats if self.engine.expert_cache is not None else None
        before = stats.get(phase=phase) if stats is not None else None
        self.step_requests = tuple(s.req for s in slots)
        try:
            logits = forward(*args)
        except Exception as e:  # one request's failure must not stop the others
            message = f"{type(e).__name__}: {e}"
            if isinstance(e, (ModelFormatError, PeerLostError)):  # every later step would fail too
                self.fault = self.fault or str(e)
                self.peer_lost = self.peer_lost or isinstance(e, PeerLostError)
                log.error("%s failed (%s) for requests %s: %s", "the model's step" if self.peer_lost else
                          "reading the model", phase, [s.req.id for s in slots], e)
            elif device.is_oom(e):  # this step's activations did not fit: fail its requests, keep serving
                device.release_memory()
                message = (f"out of device memory during {phase} of {len(slots)} request(s): {str(e).splitlines()[0]} "
                           "(try a shorter prompt, or start the server with a smaller -ub, -c or -np)")
                log.error("%s; requests %s", message, [s.req.id for s in slots])
            else:
                log.exception("engine step failed (%s) for requests %s", phase, [s.req.id for s in slots])
            for slot in slots:
                self._finish(slot, "error", message)
            return None
        if stats is not None:
            step = _diff(stats.get(phase=phase), before)
            for slot in slots:
                slot.req.cache[phase].add(step)
        return logits

    def _decode(self) -> None:
        batch = [s for s in self.slots if s.req is not None and s.next_token is not None]
        plain = [s for s in batch if s.spec is None]
        if plain:
            tokens = torch.tensor([s.next_token for s in plain], dtype=torch.long)
            logits = self._run(plain, "decode", self.engine.model.decode, tokens, [s.kv for s in plain])
            drawn = []
            for slot, row in zip(plain, () if logits is None else logits):
                slot.seq.tokens.append(slot.next_token)
                slot.next_token = None
                if slot.kv.length % slot.kv.pool.block_size == 0:  # a block just filled
                    slot.seq.publish()
                drawn.append((slot, self._draw(slot, row)))
            drawn = [(slot, d) for slot, d in drawn if d is not None]
            if drawn:  # the step's one read back: every row's sampled id together
                (ids,) = device.to_host([torch.stack([tok for _, (tok, _) in drawn])], dev=getattr(self.engine.model, "dev", None))
                for (slot, (_, lp)), tok in zip(drawn, ids.tolist()):
                    self._accept(slot, tok, lp)
        for slot in batch:
            if slot.spec is not None:
                self._verify(slot)

    def _verify(self, slot: Slot) -> None:
        """A speculative slot's step: its token and drafts in one pass (moerun.engine.speculative), then each
        row sampled in turn while the sampled token is the next draft."""
        spec, req = slot.spec, slot.req
        limit = min(req.params.max_tokens - len(req.tokens), self.engine.ctx_size - slot.kv.length) - 1
        logits = self._run([slot], "decode", spec.feed, slot.next_token, limit)
        if logits is None:
            return
        slot.next_token = None
        for row in logits:
            self._sample(slot, row)
            if slot.req is None or not spec.match(slot.next_token):
                break  # finished, or the token is not the draft: it is fed next step
            slot.next_token = None  # its row is in the cache already
        if slot.req is not None:
            spec.rollback()
            slot.seq.publish()

    def _prefill(self) -> None:
        spent, ub = 0, self.engine.ubatch
        for slot in sorted((s for s in self.slots if s.req is not None and s.todo), key=lambda s: s.req.arrival):
            while slot.todo and (spent == 0 or spent + min(ub, len(slot.todo)) <= ub):
                n = ub if not slot.kv.pool.recurrent or len(slot.todo) == 1 else min(ub, len(slot.todo) - 1)
                chunk, rest = slot.todo[:n], slot.todo[n:]  # recurrent layers: the last token alone (a checkpoint)
                if not slot.t_prefill:
                    slot.t_prefill = time.perf_counter()
                logits = self._run([slot], "prefill", self.engine.model.forward, torch.tensor(chunk, dtype=torch.long),
                                   slot.kv, True, "prefill")
                if logits is None:
                    break
                slot.seq.tokens += chunk
                slot.seq.publish()
                slot.todo, spent = rest, spent + len(chunk)
                if len(rest) == 1:
                    slot.kv.checkpoint()
                if not rest:
                    if slot.spec is not None:
                        slot.spec.session.prime(slot.req.prompt)  # a draft model's prompt is prompt time too
                    req, now = slot.req, time.perf_counter()
                    req.timings.prompt_n = len(req.prompt) - req.timings.cache_n
                    req.timings.prompt_ms = (now - slot.t_prefill) * 1e3
                    self.prompt_tokens += req.timings.prompt_n
                    self.observer.prompt_done(req)
                    if req.on_prompt is not None:
                        req.on_prompt()
                    slot.t_token = now
                    self._sample(slot, logits[-1])

    def _sample(self, slot: Slot, logits: torch.Tensor) -> None:
        drawn = self._draw(slot, logits)
        if drawn is not None:
            self._accept(slot, int(drawn[0]), drawn[1])

    def _draw(self, slot: Slot, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The sampled id as a 0-d tensor on the logits' device (not read back yet), and the log-probabilities before
        sampling when the request asked for them; None when the request failed here."""
        req = slot.req
        lp = None if req.top_logprobs is None else torch.log_softmax(logits.float(), dim=-1).cpu()  # before sampling
        if slot.constraint is not None:  # the grammar's mask is the first step of the sampler chain
            try:
                logits = slot.constraint.mask(logits)
            except MoerunError as e:  # the grammar cannot go on (llguidance's error state)
                self._finish(slot, "error", str(e))
                return None
        return slot.sampler.sample(logits, slot.history[:slot.n_history]), lp

    def _accept(self, slot: Slot, tok: int, lp: torch.Tensor | None) -> None:
        if tok == NAN_TOKEN:  # a broken model's logits: this request fails with the reason, the server goes on
            self._finish(slot, "error", NAN_LOGITS)
            return
        req, p = slot.req, slot.req.params
        now = time.perf_counter()
        first = req.t_first is None
        if first:
            req.t_first = now
        self.observer.token(req, None if first else now - slot.t_token)
        slot.t_token = now
        if tok in self.engine.tokenizer.eos_ids and not p.ignore_eos:
            self._finish(slot, "stop")
            return
        req.tokens.append(tok)
        self.generated_tokens += 1
        if lp is not None:
            top = lp.topk(req.top_logprobs) if req.top_logprobs else None
            alts = () if top is None else tuple(zip(top.indices.tolist(), top.values.tolist()))
            req.logprobs.append((tok, float(lp[tok]), alts))
            slot.unsent += 1
        if slot.constraint is not None:
            try:
                slot.constraint.accept(tok)
            except MoerunError as e:
                self._finish(slot, "error", str(e))
                return
        piece, stopped = slot.stops.feed(slot.decoder.step(tok))
        if piece:
            req.emit(Event(text=piece, logprobs=self._unsent(slot, req)))
        if stopped or (slot.constraint is not None and slot.constraint.done):
            self._finish(slot, "stop")
        elif len(req.tokens) >= p.max_tokens or slot.kv.length + 1 > self.engine.ctx_size:
            self._finish(slot, "length")
        else:
            slot.history[slot.n_history] = tok
            slot.n_history += 1
            slot.next_token = tok

    def _finish(self, slot: Slot, reason: str, error: str | None = None) -> None:
        req, rest = slot.req, ""
        if reason in ("stop", "length") and not slot.stops.stopped:  # text held back: partial characters, stop prefixes
            rest, _ = slot.stops.feed(slot.decoder.flush())
            rest += "" if slot.stops.stopped else slot.stops.flush()
        if slot.spec is not None:
            if reason in ("stop", "length") and req.cache_prompt:  # the cache, kept, ends where the text does
                slot.spec.rollback()
            req.timings.draft_n, req.timings.draft_n_accepted = slot.spec.draft_n, slot.spec.accepted
            slot.spec = None
        req.t_end = time.perf_counter()
        req.finish_reason = reason
        if slot.t_prefill and not slot.todo:
            t = req.timings
            t.predicted_n = len(req.tokens)
            t.predicted_ms = (req.t_end - slot.t_prefill) * 1e3 - t.prompt_ms
        if reason in ("cancelled", "error") or not req.cache_prompt:
            slot.seq.free()
        unsent = self._unsent(slot, req)
        slot.req, slot.todo, slot.next_token, slot.sampler, slot.constraint = None, [], None, None, None
        slot.last_used = req.t_end
        with self._cond:
            self._active -= 1
        self._copy_cache_stats(force=True)  # a client reading /metrics after its answer sees its lookups
        self.observer.finished(req)
        req.emit(Event(text=rest, finish_reason=reason, error=error, logprobs=unsent, stop_word=slot.stops and slot.stops.word))

    @staticmethod
    def _unsent(slot: Slot, req: Request) -> tuple:
        """The request's log-probability entries no event has carried yet."""
        n, slot.unsent = slot.unsent, 0
        return tuple(req.logprobs[len(req.logprobs) - n:]) if n else ()

    def _copy_cache_stats(self, force: bool = False) -> None:
        """A copy of the expert-cache statistics for readers on other threads: every 0.25 s, when a request
        ends, and when idle. A cache with `refresh` (other processes' caches:
        moerun.expert_parallel.RankCaches) fetches their figures first, here on the engine thread."""
        cache = self.engine.expert_cache
        now = time.perf_counter()
        if cache is not None and (force or now - self._copied_at > 0.25 or not self.has_work()):
            if hasattr(cache, "refresh") and not self.peer_lost:
                try:
                    cache.refresh()
                except PeerLostError as e:  # as a step's: the next step ends every request
                    self.fault, self.peer_lost = self.fault or str(e), True
                    log.error("reading the other processes' expert-cache statistics failed: %s", e)
            self._cache_copy, self._copied_at = cache.stats + CacheStats(), now


class EngineLoop:
    """Runs `scheduler.step()` on one thread while there is work; sleeps otherwise."""

    def __init__(self, scheduler: Scheduler, after_step: Callable[[], None] | None = None):
        self.scheduler, self.after_step = scheduler, after_step
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="moerun-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def request_stop(self) -> None:
        """End every request (their clients get an error event) and leave the loop, without waiting."""
        self._stop = True
        self.scheduler.wake()

    def stop(self, timeout: float = 10.0) -> None:
        self.request_stop()
        self._thread.join(timeout)

    def _run(self) -> None:
        sched = self.scheduler
        while not self._stop:
            if sched.wait_for_work(timeout=1.0, or_until=lambda: self._stop):
                sched.step()
            if self.after_step is not None:
                self.after_step()
        sched.abort_all("the server is shutting down")
