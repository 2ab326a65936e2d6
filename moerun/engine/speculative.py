"""Speculative decoding: cheap drafts of the next tokens, checked by the target model in one step.

A drafter proposes tokens that may follow the context: a draft model's most likely tokens (`ModelDrafter`,
llama.cpp's -md) or what followed an earlier occurrence of the context's last n-gram (`LookupDrafter`, prompt
lookup). The target runs the token it just sampled and the drafts as one small step (`Speculation.feed`; each
row attends to the rows before it), which reads the dense weights once for all of them and each expert once
for the rows that chose it. The engine then samples every row's token as it would have without drafts (the
sampler chain, penalties, grammar and seed unchanged) and keeps a drafted token when it equals what was
sampled (`match`); the first that differs is replaced by the sampled token and the rows after it are dropped
(`rollback`).

Drafts are deterministic here, so "sample the target's row, keep the draft if they agree" is speculative
sampling with a one-hot draft distribution: a draft d is kept with probability p(d), and otherwise the token
comes from p without d, renormalised, so every emitted token has the target's distribution (Leviathan et al.,
2023, with q = one-hot). Greedy output is the target's own, and a seed gives the tokens it gives without drafts.

Rollback cuts the KV cache back to the accepted tokens. A recurrent layer's state cannot be cut: a checkpoint is
taken before a verify step, and on a rejection the state goes back to it and the accepted tokens run again.

The draft length of each step (`DraftLength`) is chosen from the acceptance so far and the cost of a verify
step of each length: with MoE a row of its own routing adds the bytes of the experts only it chose, so the cost
grows with the draft's length, unlike a dense model's. The cost of n drafts starts from the bytes a step of n + 1
independently routed tokens reads (the cost model's expert_share) and is replaced by measured step times as
they come.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from moerun.config import DraftParams
from moerun.engine.blocks import ContextOverflowError
from moerun.errors import MoerunError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from moerun.engine.kv_cache import KVPool, SeqKV
    from moerun.model.model import MoEModel


class SequenceLike(Protocol):
    """What speculative decoding uses of a sequence (moerun.engine.engine.Sequence): its tokens and their KV."""

    kv: SeqKV
    tokens: list[int]

    def free(self) -> None: ...


class EngineLike(Protocol):
    """What speculative decoding uses of an engine (moerun.engine.engine.Engine, which imports this module, so
    this module takes it by this interface): the target's or the draft model's model, pool and sizes, and its
    sequences."""

    model: MoEModel
    pool: KVPool
    ctx_size: int
    ubatch: int

    def new_sequence(self) -> SequenceLike: ...

    def prefill(self, seq: SequenceLike, prompt: list[int]) -> tuple[torch.Tensor, int]: ...

    def resize_pool(self, n_tokens: int, seqs: int = 1) -> None: ...


class DraftSession(Protocol):
    """One sequence's drafter."""

    def prime(self, context: list[int]) -> None:
        """Take in the prompt while the target runs it (a draft model runs it too), so the first drafts do
        not wait for it."""

    def propose(self, context: list[int], n: int, p_min: float) -> list[int]:
        """Up to n tokens that may follow `context` (all of the sequence's tokens, the last one not yet run)."""

    def free(self) -> None:
        """Let go of what the session holds (a draft model's KV blocks)."""


class Drafter(Protocol):
    name: str

    def session(self) -> DraftSession: ...


class LookupDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the context's last m tokens, m
    from `ngram` down to 1 (the longest match that has a continuation). No model, so a rejected draft costs only
    its rows of the verify step; suits replies that repeat their context (code edits, quoting, agents)."""

    name = "lookup"

    def __init__(self, ngram: int):
        if ngram < 1:
            raise ValueError(f"lookup n-gram must be >= 1, got {ngram}")
        self.ngram = ngram

    def session(self) -> LookupDrafter:
        return self

    def prime(self, context: list[int]) -> None:
        pass

    def propose(self, context: list[int], n: int, p_min: float = 0.0) -> list[int]:
        if n < 1 or len(context) < 2:
            return []
        a = np.asarray(context, dtype=np.int64)
        for m in range(min(self.ngram, len(a) - 1), 0, -1):
            windows = sliding_window_view(a[:-1], m)  # [L - m, m]: every earlier n-gram with a token after it
            hits = np.flatnonzero((windows == a[-m:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + m
                return a[start:start + n].tolist()
        return []

    def free(self) -> None:
        pass


class ModelDrafter:
    """A draft model of the same vocabulary, run greedily on its own KV cache (one sequence per session);
    drafting stops where its most likely token is less likely than p_min (llama.cpp's --draft-p-min)."""

    name = "draft model"

    def __init__(self, engine: EngineLike):
        self.engine = engine

    def session(self) -> _ModelSession:
        return _ModelSession(self.engine)

    def resize(self, seqs: int) -> None:
        """Room for `seqs` sessions of a whole context each (the server's slots)."""
        bs = self.engine.pool.block_size
        self.engine.resize_pool(seqs * -(-self.engine.ctx_size // bs) * bs, seqs=seqs)


class _ModelSession:
    def __init__(self, engine: EngineLike):
        self.engine, self.seq = engine, engine.new_sequence()

    def prime(self, context: list[int]) -> None:
        if 1 < len(context) < self.engine.ctx_size:
            try:
                self.engine.prefill(self.seq, context[:-1])
            except ContextOverflowError:
                self.seq.free()

    def propose(self, context: list[int], n: int, p_min: float) -> list[int]:
        eng = self.engine
        n = min(n, eng.ctx_size - len(context))
        if n < 1:
            return []
        try:
            logits, _ = eng.prefill(self.seq, context)  # only what differs from what it drafted last time
        except ContextOverflowError:  # its pool is taken by other sessions: no drafts for this one
            log.warning("the draft model's KV cache is full: this sequence decodes without drafts")
            self.seq.free()
            return []
        out: list[int] = []
        while True:
            p = torch.softmax(logits.float(), dim=-1)
            top = int(p.argmax())
            if float(p[top]) < p_min:
                break
            out.append(top)
            if len(out) == n:
                break
            logits = eng.model.forward(torch.tensor([top]), self.seq.kv, last_only=True)[-1]
            self.seq.tokens.append(top)
        return out

    def free(self) -> None:
        self.seq.free()


def check_vocabularies(target, draft) -> None:
    """A draft model must share the target's token ids: same vocabulary size, same token texts."""
    tv, dv = target.model.spec.vocab, draft.model.spec.vocab
    if tv != dv:
        raise MoerunError(f"the draft model's vocabulary has {dv} tokens, the target's {tv}: a draft model must "
                          "share the target's vocabulary")
    step = max(1, tv // 512)
    for i in range(0, tv, step):
        a, b = target.tokenizer.id_to_token(i), draft.tokenizer.id_to_token(i)
        if a != b:
            raise MoerunError(f"the draft model's token {i} is {b!r}, the target's {a!r}: a draft model must "
                              "share the target's vocabulary")


def bytes_cost(models) -> Callable[[int], float]:
    """rows -> the bytes a verify step of that many independently routed rows reads, relative to one row's:
    every stage's dense weights once, each MoE layer's experts by the cost model's expert_share (k of E)."""
    from moerun.placement.costmodel import expert_share
    from moerun.quant.qtypes import QTensor

    dense = experts = 0.0
    frac = 1.0
    for m in models:
        st = m.store
        for i in st.layers:
            experts += st.expert_bytes(i) * st.n_experts(i)
            frac = m.spec.n_experts_used / st.n_experts(i)
        seen: set[int] = set()
        for lw in m.layers:
            for t in vars(lw).values():
                for x in t if isinstance(t, tuple) else (t,):
                    data = x.data if isinstance(x, QTensor) else x
                    if isinstance(data, torch.Tensor) and id(data) not in seen:
                        seen.add(id(data))
                        dense += data.nbytes
        if m.head is not None:
            dense += (m.head.data if isinstance(m.head, QTensor) else m.head).nbytes
    one = dense + experts * frac

    def cost(rows: int) -> float:
        return (dense + experts * expert_share(frac, rows)) / one if one else float(rows)

    return cost


class DraftLength:
    """Each step's draft length: the n in [0, most] with the most tokens per second, E(n) / t(n).

    A request for n drafts gets some with probability d (a draft model below --draft-p-min, or no n-gram
    match, gives none), and then the i-th draft is there and kept with probability S(i): the chains' survival
    by depth, estimated as Kaplan and Meier do from how deep each chain got (a chain ends at a rejection or
    where the drafter had no more; one that reached the request's end is censored there); each depth's hazard
    has one pseudo-chain at the hazard of the depth before (1/2 before the first), so depths no chain reached
    yet follow the deepest measured. Acceptance is bursty (a copied passage goes on or does not), which a survival curve
    follows and one acceptance rate per draft does not. d and the counts are smoothed, the last ~10 requests
    counting most. So a step emits E(n) = 1 + d (S(1) + ... + S(n)) tokens and takes
    t(n) = ask + v(0) + d (v(n) - v(0)): `ask` the drafter's
    smoothed seconds per request, v(n) the smoothed time of steps that verified n drafts where there are some,
    else the cost model's relative cost (`cost`, rows -> a step's cost relative to one row's) scaled by the
    measured steps of the nearest length. Where n = 0 wins, a step still asks for PROBE_DRAFTS now and then
    (after PROBE steps, twice as long after each request that kept nothing, up to PROBE_MAX), so d and a keep
    being measured. The prior starts with short drafts.
    """

    DECAY = 0.9  # per verify step
    PROBE, PROBE_MAX, PROBE_DRAFTS = 8, 128, 2
    PRIOR_HAZARD = 0.5

    def __init__(self, most: int, cost: Callable[[int], float] | None = None, adaptive: bool = True):
        self.most, self.adaptive = most, adaptive
        self.cost = cost or (lambda rows: 1.0)
        self.reached = [0.0] * (most + 2)  # by depth i (1..most): chains that got to the i-th draft, and ended
        self.ended = [0.0] * (most + 2)  # there
        self.got, self.asked = 0.5, 0.5  # requests that got drafts, of all requests (d), with a prior of half a one
        self.probe = self.PROBE  # steps between requests while n = 0 wins
        self.times: dict[int, float] = {}  # drafts verified -> smoothed seconds of the verify step
        self.ask_s: float | None = None  # smoothed seconds of asking the drafter for drafts
        self.since = 0
        self.chosen: Counter[int] = Counter()  # drafts asked for -> steps

    @property
    def acceptance(self) -> float:
        """The estimated chance that a first draft is kept."""
        return self.survival(1)[-1]

    def survival(self, n: int) -> list[float]:
        """S(1)..S(n): the chance that the chain keeps its i-th draft."""
        out, s, h = [], 1.0, self.PRIOR_HAZARD
        for i in range(1, n + 1):
            h = (self.ended[i] + h) / (self.reached[i] + 1.0)  # one pseudo-chain at the depth before's hazard
            s *= 1.0 - h
            out.append(s)
        return out

    def expected(self, n: int) -> float:
        """Tokens a step asking for n drafts emits."""
        return 1.0 + self.got / self.asked * sum(self.survival(n))

    def verify(self, n: int) -> float:
        if n in self.times:
            return self.times[n]
        if not self.times:
            return self.cost(n + 1)
        m = min(self.times, key=lambda k: (abs(k - n), k))
        return self.times[m] / self.cost(m + 1) * self.cost(n + 1)

    def seconds(self, n: int) -> float:
        """A step asking for n drafts: asking, and verifying what comes."""
        if n == 0:
            return self.verify(0)
        d = self.got / self.asked
        return (self.ask_s or 0.0) + self.verify(0) + d * (self.verify(n) - self.verify(0))

    def choose(self, limit: int) -> int:
        most = min(self.most, limit)
        if most <= 0:
            return 0
        if not self.adaptive:
            return most
        n = max(range(most + 1), key=lambda k: self.expected(k) / self.seconds(k))
        self.since = 0 if n else self.since + 1
        if n == 0 and self.since >= self.probe:
            self.since, n = 0, min(most, self.PROBE_DRAFTS)
        return n

    def record(self, asked: int, drafted: int, kept: int, seconds: float, drafting: float = 0.0) -> None:
        """A step asked for `asked` drafts and got `drafted`, `kept` of them accepted; drafting took `drafting`
        seconds and the verify step `seconds`."""
        if asked:
            self.chosen[asked] += 1
            self.ask_s = drafting if self.ask_s is None else 0.8 * self.ask_s + 0.2 * drafting
            self.got, self.asked = self.got * self.DECAY + (drafted > 0), self.asked * self.DECAY + 1
        if drafted:  # a chain ends short of what was asked by a rejection or by the drafter: both end it
            self.reached = [r * self.DECAY for r in self.reached]
            self.ended = [e * self.DECAY for e in self.ended]
            for i in range(1, min(kept + 1, asked) + 1):
                self.reached[i] += 1
            if kept < asked:
                self.ended[kept + 1] += 1
        if asked:
            self.probe = self.PROBE if kept else min(2 * self.probe, self.PROBE_MAX)
        old = self.times.get(drafted)
        self.times[drafted] = seconds if old is None else 0.8 * old + 0.2 * seconds


class Speculation:
    """One sequence's speculative decoding against the target `engine`: the verify step, matching and rollback,
    and llama-server's counts (draft_n: tokens drafted and verified, draft_n_accepted: those kept)."""

    def __init__(self, engine: EngineLike, seq: SequenceLike, session: DraftSession, params: DraftParams,
                 length: DraftLength):
        self.engine, self.seq, self.session, self.params, self.length = engine, seq, session, params, length
        self.drafts: list[int] = []  # drafted tokens in the cache that no sampled token has matched yet
        self.draft_n = self.accepted = 0
        self._step: tuple | None = None  # the last step: asked, drafted, kept so far, its seconds, drafting's

    def feed(self, token: int, limit: int) -> torch.Tensor:
        """Run `token` (sampled, not yet in the cache) and up to `limit` drafts after it -> logits [1 + n, V]:
        row i predicts the token after drafts[:i]. The drafts are in `self.drafts`."""
        self._settle()
        seq, n = self.seq, self.length.choose(limit)
        t0 = time.perf_counter()
        drafts = self.session.propose(seq.tokens + [token], n, self.params.draft_p_min) if n else []
        drafting = time.perf_counter() - t0
        drafts = drafts[:n] if len(drafts) >= max(1, self.params.draft_min) else []
        if drafts:
            seq.kv.checkpoint()  # recurrent layers: the state to come back to on a rejection (else nothing)
        t0 = time.perf_counter()
        logits = self.engine.model.forward(torch.tensor([token, *drafts]), seq.kv, phase="decode")
        seq.tokens += [token, *drafts]
        self.drafts, self.draft_n = list(drafts), self.draft_n + len(drafts)
        self._step = (n, len(drafts), 0, time.perf_counter() - t0, drafting)
        return logits

    def match(self, token: int) -> bool:
        """Whether the sampled `token` is the next draft (its row is already in the cache)."""
        if not self.drafts or token != self.drafts[0]:
            return False
        self.drafts.pop(0)
        self.accepted += 1
        asked, n, kept, *times = self._step
        self._step = (asked, n, kept + 1, *times)
        return True

    def rollback(self) -> None:
        """Drop the drafts no sampled token matched: the cache and the tokens end at the last accepted one."""
        self._settle()
        n, self.drafts = len(self.drafts), []
        if not n:
            return
        seq = self.seq
        keep = len(seq.tokens) - n
        tokens = seq.tokens[:keep]
        seq.kv.truncate(keep)  # may keep less: a recurrent state's checkpoint, a ring that lost the window
        seq.tokens = tokens[:seq.kv.length]
        if seq.kv.length < keep:
            for chunk in torch.tensor(tokens[seq.kv.length:], dtype=torch.long).split(self.engine.ubatch):
                self.engine.model.forward(chunk, seq.kv, last_only=True)  # the accepted tokens again
        seq.tokens = tokens

    def _settle(self) -> None:
        if self._step is not None:
            self.length.record(*self._step)
            self._step = None

    def lengths_line(self) -> str:
        """The draft lengths the steps chose (DraftLength), e.g. for the log."""
        chosen = self.length.chosen
        steps = sum(chosen.values())
        mean = sum(k * v for k, v in chosen.items()) / steps if steps else 0.0
        spread = ", ".join(f"{k}: {v}" for k, v in sorted(chosen.items()))
        d = self.length.got / self.length.asked
        return (f"draft lengths: {steps} requests, {mean:.1f} drafts asked per request ({spread}); estimates: "
                f"drafts given {d:.2f} of the time, the first kept {self.length.acceptance:.2f}, the first 8 "
                f"{self.length.survival(min(8, self.length.most))[-1]:.2f}")
