"""Text generation for one sequence at a time: chunked prefill, then token-by-token decode over the KV cache.

`Engine.generate()` returns a `Generation`: iterate it for text pieces as they are produced; afterwards it
holds the tokens, the finish reason and llama.cpp-style timings. A `Sequence` keeps its KV cache between
calls, so a chat re-prefills only what changed since the previous turn.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from moerun.config import DraftParams, SamplingParams
from moerun.engine.kv_cache import ContextOverflowError, KVPool, SeqKV
from moerun.engine.sampler import NAN_TOKEN, Sampler, StopChecker
from moerun.engine.speculative import Drafter, DraftLength, Speculation, bytes_cost
from moerun.engine.timings import Timings
from moerun.errors import NAN_LOGITS, ModelOutputError
from moerun.experts.cache import ExpertCache
from moerun.model.model import MoEModel
from moerun.text.tokenizer import Tokenizer


@dataclass
class Sequence:
    """Tokens whose keys and values are in `kv` (positions 0..len(tokens))."""

    kv: SeqKV
    tokens: list[int] = field(default_factory=list)
    draft: object | None = None  # its drafter's session (moerun.engine.speculative), kept between requests

    def free(self) -> None:
        self.kv.free()
        self.tokens = []
        if self.draft is not None:
            self.draft.free()

    def publish(self) -> None:
        """Offer the full blocks of what this sequence holds to other sequences (moerun.engine.blocks)."""
        self.kv.publish(self.tokens)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prompt_chunks(todo: torch.Tensor, ubatch: int, recurrent: bool) -> list[torch.Tensor]:
    """A prompt's remaining tokens in chunks of at most `ubatch`; with recurrent layers the last token alone, so
    the state before it can be kept (SeqKV.checkpoint): a request with the same prompt reuses all but it."""
    if not recurrent or len(todo) < 2:
        return list(todo.split(ubatch))
    return [*todo[:-1].split(ubatch), todo[-1:]]


DEFAULT_DRAFT = DraftParams()


class Engine:
    """drafter (moerun.engine.speculative): speculative decoding with these `draft` settings; draft_cost: rows ->
    a verify step's cost relative to one row's, for choosing draft lengths (default: speculative.bytes_cost).
    kv_types: the KV cache's key and value types (moerun.engine.kv_types; None: the compute dtype)."""

    def __init__(self, model: MoEModel, tokenizer: Tokenizer, ctx_size: int = 4096, ubatch: int = 512,
                 expert_cache: ExpertCache | None = None, drafter: Drafter | None = None,
                 draft: DraftParams = DEFAULT_DRAFT, draft_cost=None,
                 kv_types: tuple[str | None, str | None] = (None, None)):
        if ctx_size <= 0 or ubatch <= 0:
            raise ValueError("ctx_size and ubatch must be positive")
        self.model, self.tokenizer = model, tokenizer
        self.expert_cache = expert_cache  # the model's expert cache, when it has one (for its statistics)
        self.ctx_size, self.ubatch = ctx_size, ubatch
        self.drafter, self.draft, self.draft_cost = drafter, draft, draft_cost
        self.kv_types = kv_types
        self.pool = KVPool(model.spec, ctx_size, dtype=model.dtype, segments=model.kv_segments, kv_types=kv_types)
        self._prepare()

    @property
    def grammars(self):
        """The structured-output compiler over this model's vocabulary (moerun.engine.grammar), built on first
        use (~10 ms for the built-in model's vocabulary)."""
        if getattr(self, "_grammars", None) is None:
            from moerun.engine.grammar import Grammars

            self._grammars = Grammars(self.tokenizer, self.model.spec.vocab)
        return self._grammars

    @property
    def device_label(self) -> str:
        """The kind of device holding the KV cache (of the first layers): cpu, cuda."""
        return self.pool.segments[0][2].device.type

    def new_sequence(self) -> Sequence:
        return Sequence(SeqKV(self.pool, self.ctx_size))

    def resize_pool(self, n_tokens: int, seqs: int = 1) -> None:
        """A KV pool of n_tokens positions in all, for `seqs` sequences at once (e.g. room for several sequences
        of ctx_size each). Only before any sequence holds blocks of the current pool."""
        if self.pool.allocator.n_free != self.pool.allocator.n_blocks:
            raise RuntimeError("resize_pool with sequences still holding KV blocks")
        self.pool = None  # the old pool's memory goes before the new one is allocated
        self.pool = KVPool(self.model.spec, n_tokens, dtype=self.model.dtype, segments=self.model.kv_segments,
                           kv_types=self.kv_types,
                           seqs=seqs)
        self._prepare()

    def _prepare(self) -> None:
        """The model's decode steps over this pool made ready before the first request (a GPU's graphs)."""
        prepare = getattr(self.model, "prepare_decode", None)
        if prepare is not None:
            prepare(self.pool)

    def reuse_prefix(self, seq: Sequence, prompt: list[int], shared: bool = True) -> list[int]:
        """Cut `seq` back to its longest common prefix with `prompt`, or take other sequences' blocks of a
        longer one (`shared`) -> the prompt tokens still to run (at least one, for its logits)."""
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) >= self.ctx_size:
            raise ContextOverflowError(
                f"the prompt has {len(prompt)} tokens but the context size is {self.ctx_size}")
        keep = common_prefix(seq.tokens, prompt)
        keep = min(keep, len(prompt) - 1)
        seq.kv.truncate(keep)  # may keep less: a window's ring, a recurrent state's checkpoint, a shared block
        seq.tokens = seq.tokens[:seq.kv.length]
        if shared and seq.kv.adopt(prompt):  # another sequence's blocks hold a longer prefix of the prompt
            seq.tokens = prompt[:seq.kv.length]
        return prompt[seq.kv.length:]

    def prefill(self, seq: Sequence, prompt: list[int]) -> tuple[torch.Tensor, int]:
        """Bring `seq` to exactly `prompt`, reusing the cached common prefix.

        -> (logits of the last token [V], number of tokens run; the others came from the cache)
        """
        todo = torch.tensor(self.reuse_prefix(seq, prompt), dtype=torch.long)
        for chunk in prompt_chunks(todo, self.ubatch, seq.kv.pool.recurrent):
            logits = self.model.forward(chunk, seq.kv, last_only=True)
            seq.tokens += chunk.tolist()
            seq.publish()
            if len(seq.tokens) == len(prompt) - 1:
                seq.kv.checkpoint()  # a recurrent state to come back to (a prompt resent, a reply redone)
        return logits[-1], len(todo)

    def generate(self, prompt: list[int], params: SamplingParams, seq: Sequence | None = None,
                 draft: DraftParams | None = None) -> Generation:
        """draft: this request's draft settings (default: the engine's); drafts need the engine's drafter."""
        return Generation(self, prompt, params, seq or self.new_sequence(), draft or self.draft)

    def speculation(self, seq: Sequence, draft: DraftParams) -> Speculation | None:
        """Speculative decoding of `seq` with these settings, or None without a drafter or with no drafts."""
        if self.drafter is None or draft.rows == 0:
            return None
        if self.draft_cost is None:
            models = [st.model for st in self.model.stages] if hasattr(self.model, "stages") else [self.model]
            self.draft_cost = bytes_cost(models)
        if seq.draft is None:
            seq.draft = self.drafter.session()
        return Speculation(self, seq, seq.draft, draft, DraftLength(draft.rows, self.draft_cost, draft.adaptive))


class Generation:
    """One request's output: iterate for text pieces; then `.text`, `.tokens`, `.finish_reason`, `.timings`."""

    def __init__(self, engine: Engine, prompt: list[int], params: SamplingParams, seq: Sequence,
                 draft: DraftParams = DEFAULT_DRAFT):
        self.engine, self.prompt, self.params, self.seq = engine, prompt, params, seq
        self.spec = engine.speculation(seq, draft)
        self.sampler = Sampler(params, engine.model.spec.vocab, device=engine.model.logits_device)
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.timings = Timings()
        self.cancelled = False

    def cancel(self) -> None:
        """Stop after the current token (e.g. Ctrl-C in a chat, or a client that went away)."""
        self.cancelled = True

    def __iter__(self) -> Iterator[str]:
        eng, p, t = self.engine, self.params, self.timings
        tok = eng.tokenizer
        t0 = time.perf_counter()
        logits, n_run = eng.prefill(self.seq, self.prompt)
        if self.spec is not None:
            self.spec.session.prime(self.prompt)  # a draft model's prompt is prompt time too
        t1 = time.perf_counter()
        t.prompt_n, t.prompt_ms, t.cache_n = n_run, (t1 - t0) * 1e3, len(self.prompt) - n_run
        decoder, stops = tok.incremental_decoder(), StopChecker(p.stop)
        history = torch.tensor(self.seq.tokens, dtype=torch.long)
        spec, rows = self.spec, [logits]  # rows: logits still to sample from (a verify step's, in order)
        try:
            while True:
                if self.cancelled:
                    self.finish_reason = "cancelled"
                    break
                nxt = int(self.sampler.sample(rows.pop(0), history))
                if nxt == NAN_TOKEN:
                    raise ModelOutputError(NAN_LOGITS)
                if nxt in tok.eos_ids and not p.ignore_eos:
                    self.finish_reason = "stop"
                    break
                self.tokens.append(nxt)
                piece, stopped = stops.feed(decoder.step(nxt))
                if piece:
                    self.text += piece
                    yield piece
                if stopped:
                    self.finish_reason = "stop"
                    break
                if len(self.tokens) >= p.max_tokens:
                    self.finish_reason = "length"
                    break
                fed = len(self.seq.tokens) - (len(spec.drafts) if spec else 0)  # positions accepted so far
                if fed + 1 > eng.ctx_size:
                    self.finish_reason = "length"  # context full
                    break
                if self.sampler.uses_history:  # the penalties' window; two tensors a token otherwise for nothing
                    history = torch.cat((history, torch.tensor([nxt])))
                if spec is None:
                    rows = [eng.model.forward(torch.tensor([nxt]), self.seq.kv, last_only=True)[-1]]
                    self.seq.tokens.append(nxt)
                elif not spec.match(nxt):  # a drafted row holds nxt already when it matches
                    spec.rollback()
                    limit = min(p.max_tokens - len(self.tokens), eng.ctx_size - len(self.seq.tokens)) - 1
                    rows = list(spec.feed(nxt, limit))
                if not (spec and spec.drafts) and self.seq.kv.length % self.seq.kv.pool.block_size == 0:
                    self.seq.publish()
            if not stops.stopped:  # text held back (partial characters, a possible stop-string start)
                rest, _ = stops.feed(decoder.flush())
                rest += "" if stops.stopped else stops.flush()
                if rest:
                    self.text += rest
                    yield rest
        finally:
            if spec is not None:  # the drafts after the last token go; the cache ends where the text does
                spec.rollback()
                self.seq.publish()
                t.draft_n, t.draft_n_accepted = spec.draft_n, spec.accepted
            t.predicted_n = len(self.tokens)
            t.predicted_ms = (time.perf_counter() - t1) * 1e3

    def run(self) -> Generation:
        """Generate to the end without streaming."""
        for _ in self:
            pass
        return self
