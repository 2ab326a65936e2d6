"""Token sampling in llama.cpp's default order, without host synchronisation, and stop strings.

Sampler chain (llama.cpp's default): penalties -> top-k -> top-p -> min-p -> temperature -> draw.
Everything is vectorised torch on the logits' device: the chosen token comes back as a 0-d tensor and
the caller decides when to copy it to the host (DESIGN.md, decision 8). The draw uses the exponential
race (argmax of log p - log E, E ~ Exp(1), one E per candidate in the candidates' order), which samples
exactly from softmax and, unlike torch.multinomial, needs no normalisation and no validity check.

On the CPU, two cases would cost tens of milliseconds at a 250k vocabulary (a sort of most of it, and
exponential_'s serial draw of one number per token): top-p or min-p without top-k, once the head they keep
outgrows 256 tokens, and every truncation off. There `sample` takes a shortcut with the same result
(`_fast`): the logits in buckets of value (counts and probability mass per bucket give the head's length
and top-p's cut without sorting), the same random numbers drawn (torch's CPU exponential_ is
-log1p(-U), U its uniform double: U is drawn, E computed only where needed), and the race run only in the
buckets (or blocks of tokens) whose best possible score, from their largest logit and smallest U, can still
win. A step whose outcome the shortcut cannot certify (a near-tie, the winner's logit shared by another
token, top-p's cut within rounding of the threshold) goes the plain way with the generator as it was (about
1 step in 100 on random logits, mostly shared float32 values). On a 2-core Zen 4 (one torch thread) at vocabulary
248,320, per token: top-p 0.95 without top-k 6.0 ms where the plain chain takes 43 ms on flat logits (3.5 ms for
14.5 ms with a few favourites over a long tail), a third of it drawing the chain's 248,320 random numbers; every
truncation off 1.6 ms for 5.3 ms; top-k 40 (the default) 0.46 ms and greedy 0.21 ms, as before. With two torch
threads on a machine where another process is running, either way took 150-230 ms (each parallel region waits
for the thread the other process holds up), so `sample` runs the chain on one torch thread.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterable

import numpy as np
import torch

from moerun.config import SamplingParams

_TINY = torch.finfo(torch.float32).tiny  # keeps -log(E) finite if E rounds to 0
NO_HISTORY = torch.zeros(0, dtype=torch.long)

# The CPU's shortcut (module docstring): logits in _BUCKETS buckets of value over _SPAN nats below the largest
# (the rest in one more); the untruncated race in blocks of _BLOCK tokens; heads up to _FIRST_HEAD tokens sorted
# as the plain chain does; a winner within _TOL (relative) of another score left undecided. Vocabularies under
# _FAST_VOCAB tokens go the plain way: sorting them is cheap, the shortcut's fixed costs are not.
_FAST_VOCAB = 32768
_BUCKETS = 4096
_SPAN = 32.0
_BLOCK = 256
_FIRST_HEAD = 256
_TOL = 1e-5


def _noise(u: torch.Tensor) -> torch.Tensor:
    """The chain's noise log(max(E, tiny)) from the uniform doubles U that torch's CPU exponential_ draws:
    E = float32(-log1p(-U)), as it computes them."""
    return (-torch.log1p(-u)).float().clamp_min_(_TINY).log_()


def _near_rounding(d: torch.Tensor, slack: float) -> bool:
    """Whether any double in `d` lies within `slack` of a point where rounding to float32 changes."""
    f = d.float()
    up = torch.nextafter(f, torch.full_like(f, math.inf)).double()
    down = torch.nextafter(f, torch.full_like(f, -math.inf)).double()
    fd = f.double()
    return bool(((fd + up) / 2 - d < slack).any() or (d - (fd + down) / 2 < slack).any())


class Sampler:
    """Picks the next token of one sequence. One Sampler per request: it owns the seeded generator."""

    def __init__(self, params: SamplingParams, vocab_size: int, device: str | torch.device = "cpu", *,
                 fast: bool = True):
        """fast: the CPU's shortcut (module docstring) where it applies; False: always the plain chain (the
        reference the shortcut is tested against)."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.params = params
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # A random seed is drawn once, here, so that it can be reported and the run repeated.
        self.seed = params.seed if params.seed is not None else secrets.randbits(32)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.seed)
        p = params
        self._penalise = p.repeat_last_n != 0 and (
            p.repeat_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)
        self._top_k = p.top_k if 0 < p.top_k < vocab_size else 0
        self._top_p = p.top_p if p.top_p < 1.0 else None
        self._log_min_p = math.log(p.min_p) if p.min_p > 0.0 else None
        # Buffers reused by every call (allocated only when the options need them).
        self._counts = torch.zeros(vocab_size, device=self.device) if self._penalise else None  # [V]
        self._one = torch.ones((), device=self.device)
        n_cand = self._top_k or vocab_size
        self._noise = None if p.is_greedy else torch.empty(n_cand, device=self.device)  # [C]
        self._fast = fast and self.device.type == "cpu" and not p.is_greedy and not self._top_k and \
            vocab_size >= _FAST_VOCAB
        self._state: torch.Tensor | None = None  # the generator before the shortcut's draw

    # -- stages ------------------------------------------------------------------------------------

    def penalize(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """Repeat, frequency and presence penalties over the last repeat_last_n tokens. [V] -> [V] float32.

        The caller's logits are never modified (returned as they are when no penalty applies).
        """
        logits = logits.float()
        if not self._penalise or history.numel() == 0:
            return logits
        p = self.params
        window = history if p.repeat_last_n < 0 else history[-p.repeat_last_n:]  # [n]
        window = window.to(self.device, torch.long, non_blocking=True)
        # counts = bincount(window, minlength=V); index_add_ because CUDA's bincount reads max() on the host
        counts = self._counts.zero_().index_add_(0, window, self._one.expand(window.numel()))  # [V]
        # Only the window's tokens change, so work on those: gather, penalise, scatter back.
        seen = logits.gather(0, window)  # [n], a token repeated in the window appears more than once
        if p.repeat_penalty != 1.0:
            rp = p.repeat_penalty
            seen = torch.where(seen > 0, seen / rp, seen * rp)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            seen = seen - counts.gather(0, window) * p.frequency_penalty - p.presence_penalty
        # duplicates write the same value, so the scatter's order does not matter
        logits = logits.clone().scatter_(0, window, seen)  # [V]
        return logits

    def candidates(self, logits: torch.Tensor, history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Penalties, top-k, top-p, min-p, temperature. -> (scaled logits [C], token ids [C] or None).

        Dropped candidates hold -inf; tokens not among the C candidates are dropped too. ids None means
        the candidates are the whole vocabulary in order; otherwise they are sorted, most likely first.
        Not for greedy params.
        """
        vals = self.penalize(logits, history)  # [V]
        ids, lse = None, None
        if self._top_k:
            vals, ids = torch.topk(vals, self._top_k)  # [k], sorted descending
        elif self._top_p is not None or self._log_min_p is not None:
            vals, ids, lse = self._sorted_head(vals)  # [C], sorted descending
        return self._truncate(vals, lse), ids

    def _truncate(self, vals: torch.Tensor, lse: torch.Tensor | None) -> torch.Tensor:
        """Top-p, min-p and temperature over candidates sorted descending (or the whole vocabulary in order when
        neither applies); lse: the logsumexp of the whole vocabulary when `vals` is a head of it."""
        if self._top_p is not None:
            # probabilities over what top-k kept (llama.cpp renormalises here); lse covers a truncated head
            probs = torch.softmax(vals, dim=0) if lse is None else torch.exp(vals - lse)  # [C]
            keep = self._top_p_keep(probs)
            vals = vals.masked_fill(~keep, -math.inf)
        if self._log_min_p is not None:
            # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); vals[0] is the max
            vals = vals.masked_fill(vals < vals[0] + self._log_min_p, -math.inf)
        return vals / self.params.temperature

    def _top_p_keep(self, probs: torch.Tensor) -> torch.Tensor:
        """probs [C] sorted descending -> keep [C] bool: the smallest prefix whose mass reaches top_p."""
        before = torch.cumsum(probs, dim=0) - probs  # [C] probability mass ranked above each token
        keep = before < self._top_p
        keep[0] = True  # always at least one token
        return keep

    def _sorted_head(self, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """vals [V] -> (the C most likely, sorted descending [C], their ids [C], logsumexp of all V).

        On a GPU this is a full sort (fixed shapes, no host sync). On the CPU, where reading a value
        is free and sorting 150k logits costs ~40 ms, only a head is sorted: grown (256, 1024, 4096, ... tokens)
        until top-p or min-p is sure to drop its last token, so every token they keep is inside it.
        """
        lse = torch.logsumexp(vals, dim=0)  # []
        if self.device.type != "cpu":
            head, ids = torch.sort(vals, descending=True)
            return head, ids, lse
        k = min(_FIRST_HEAD, self.vocab_size)
        while True:
            head, ids = torch.topk(vals, k)  # [k]
            if self._head_ends(head, lse):
                return head, ids, lse
            k = min(4 * k, self.vocab_size)

    def _head_ends(self, head: torch.Tensor, lse: torch.Tensor) -> bool:
        """Whether a head of the sorted logits holds every token top-p and min-p can keep."""
        if head.numel() == self.vocab_size:
            return True
        if self._log_min_p is not None and head[-1] < head[0] + self._log_min_p:
            return True
        return self._top_p is not None and not bool(self._top_p_keep(torch.exp(head - lse))[-1])

    # -- results -----------------------------------------------------------------------------------

    def sample(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """logits [V], history [n] (prompt + generated ids) -> next token id, 0-d long on logits' device. On the CPU
        the chain runs on one torch thread: a vector of 250k is no work to split, and with more threads each parallel
        region waits for any thread another process holds up (150-230 ms a token seen on 2 busy cores)."""
        n = torch.get_num_threads() if logits.device.type == "cpu" else 1
        if n == 1:
            return self._sample(logits, history)
        torch.set_num_threads(1)
        try:
            return self._sample(logits, history)
        finally:
            torch.set_num_threads(n)

    def _sample(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        if self.params.is_greedy:
            return torch.argmax(self.penalize(logits, history))
        if self._fast:
            vals = self.penalize(logits, history)
            token = self._fast_sample(vals)
            if token is not None:
                return token
            return self._race(*self.candidates(vals, NO_HISTORY))
        return self._race(*self.candidates(logits, history))

    def _race(self, vals: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        """The exponential race over candidates `vals` [C] (scaled logits, -inf where dropped), ids [C] or None."""
        noise = self._noise[: vals.numel()]  # [C]
        noise.exponential_(generator=self.generator).clamp_min_(_TINY).log_()
        choice = torch.argmax(vals - noise)  # exponential race == one draw from softmax(vals)
        if ids is None:
            return choice
        return ids.gather(0, choice.view(1)).view(())  # tensor indexing, no .item()

    # -- the CPU's shortcut (module docstring) -----------------------------------------------------

    def _fast_sample(self, vals: torch.Tensor) -> torch.Tensor | None:
        """What `_race(*candidates)` gives for penalised logits `vals` [V], or None, the generator untouched,
        where the shortcut cannot tell."""
        mx = vals.max()
        if not bool(torch.isfinite(mx)):
            return None  # NaN or +inf: the plain chain's rules
        if self._top_p is None and self._log_min_p is None:
            return self._fast_untruncated(vals)
        lse = torch.logsumexp(vals, dim=0)
        n_min_p = self.vocab_size
        if self._log_min_p is not None:
            n_min_p = int((vals >= mx + self._log_min_p).sum())  # min-p keeps the first n_min_p ranks
        # the plain chain's first head of 256 tokens, unless top-p cannot end there (its first 255 tokens, none
        # more likely than the first, hold too little mass) and min-p does not
        p_max = float(torch.exp(mx - lse))
        if n_min_p < _FIRST_HEAD or (self._top_p is not None and (_FIRST_HEAD - 1) * p_max * (1 + 1e-5)
                                     >= self._top_p):
            head, ids = torch.topk(vals, _FIRST_HEAD)
            if self._head_ends(head, lse):
                return self._race(self._truncate(head, lse), ids)
        if n_min_p < 4 * _FIRST_HEAD:  # min-p ends the chain's next head: sorting it is cheap
            head, ids = torch.topk(vals, min(4 * _FIRST_HEAD, self.vocab_size))
            return self._race(self._truncate(head, lse), ids)
        return self._fast_head(vals, mx, lse, n_min_p)

    def _fast_untruncated(self, vals: torch.Tensor) -> torch.Tensor | None:
        """Every truncation off: the race over the vocabulary in token order, in blocks of _BLOCK tokens."""
        vocab = self.vocab_size
        starts = np.arange(0, vocab, _BLOCK)
        vmax = np.maximum.reduceat(vals.contiguous().numpy(), starts).astype(np.float64)

        def members(blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
            ranks = torch.cat([torch.arange(int(starts[b]), min(int(starts[b]) + _BLOCK, vocab)) for b in blocks])
            return vals[ranks], ranks, ranks, None

        got = self._bounded_race(vocab, vocab, starts, vmax, members)
        return None if got is None else torch.tensor(got[1])

    def _fast_head(self, vals: torch.Tensor, mx: torch.Tensor, lse: torch.Tensor, n_min_p: int) \
            -> torch.Tensor | None:
        """Top-p and/or min-p (no top-k) whose head outgrows _FIRST_HEAD: the head's length C, what top-p and
        min-p keep (the first n ranks; min-p's n_min_p given) and the race, from buckets of value instead of a
        sort."""
        vocab, scale = self.vocab_size, _BUCKETS / _SPAN
        bucket = torch.sub(mx, vals).mul_(scale).clamp_(max=_BUCKETS).to(torch.int32)  # [V], larger logits first
        counts = torch.bincount(bucket, minlength=_BUCKETS + 1)  # [B+1]
        first = torch.cumsum(counts, 0) - counts  # [B+1] the rank of each bucket's largest logit
        n = vocab
        if self._top_p is not None:
            n = self._top_p_count(vals, lse, bucket, counts, first)
            if n is None:
                return None
        if n_min_p < _FIRST_HEAD or n < _FIRST_HEAD:
            return None  # the first head would have held them: disagrees with _head_ends
        size = min(4 * _FIRST_HEAD, vocab)
        while size < vocab and not (n_min_p < size or n <= size - 1):  # the plain chain's head growth
            size = min(4 * size, vocab)
        kept = max(1, min(n, n_min_p, size))
        nonempty = torch.nonzero((counts > 0) & (first < kept)).squeeze(1)  # buckets holding kept ranks
        starts = first[nonempty].numpy()
        vmax = mx.item() - np.maximum(nonempty.numpy().astype(np.float64) - 1.0, 0.0) / scale  # + a bucket's slack

        def members(which: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            want = torch.zeros(_BUCKETS + 1, dtype=torch.bool)
            want[nonempty[which].long()] = True
            tok = torch.nonzero(want.index_select(0, bucket)).squeeze(1)
            v, order = torch.sort(vals[tok], descending=True, stable=True)
            tok, b = tok[order], bucket[tok[order]].long()
            rank = first[b] + torch.arange(tok.numel()) - torch.searchsorted(b, b)
            # equal logits share a bucket: which of them takes which rank is topk's choice
            same = v[1:] == v[:-1]
            tied = torch.zeros_like(v, dtype=torch.bool)
            tied[1:] |= same
            tied[:-1] |= same
            keep = rank < kept
            return v[keep], tok[keep], rank[keep], tied[keep]

        got = self._bounded_race(size, kept, starts, vmax, members)
        return None if got is None else torch.tensor(got[1])

    def _top_p_count(self, vals: torch.Tensor, lse: torch.Tensor, bucket: torch.Tensor, counts: torch.Tensor,
                     first: torch.Tensor) -> int | None:
        """How many ranks top-p keeps, as `_top_p_keep` counts them over the sorted head (float32 sums of the
        probabilities, accumulated in double), from each bucket's mass and a sort of the bucket it ends in
        and the next; None where rounding or ties could make it differ."""
        probs = torch.exp(vals - lse)  # [V] float32, as the chain computes them
        mass = torch.zeros(_BUCKETS + 1, dtype=torch.float64).index_add_(0, bucket, probs.double())
        cum = torch.cumsum(mass, 0)  # [B+1]
        threshold = torch.tensor(self._top_p, dtype=torch.float32).item()  # the comparison is in float32
        b = int(torch.searchsorted(cum, torch.tensor([threshold], dtype=torch.float64)))
        if b >= _BUCKETS - 1:
            return None  # the cut among the smallest logits: left to the sort
        above = float(cum[b - 1]) if b > 0 else 0.0
        if above > threshold - 1e-7:
            return None  # every rank above bucket b kept only if clearly below the threshold
        want = torch.zeros(_BUCKETS + 1, dtype=torch.bool)
        want[b:b + 2] = True
        tok = torch.nonzero(want.index_select(0, bucket)).squeeze(1)
        v, order = torch.sort(vals[tok], descending=True)
        p = probs[tok[order]]  # [m] sorted descending
        total = above + torch.cumsum(p.double(), 0)  # [m] the mass up to each rank, inclusive
        before = total.float() - p  # float32, as _top_p_keep
        keep = before < self._top_p
        t = int(keep.sum())
        if t == 0 or t == keep.numel() or bool(keep[:t].logical_not().any()):
            return None
        n = int(first[b]) + t
        # the chain sums the same float32 numbers in double, in rank order: each of n additions of numbers under 1
        # rounds by at most 2^-53, so the two sums differ by less than 2 n 2^-53
        if bool(v[t - 1] == v[t]) or _near_rounding(total[t - 1:t + 1], 2.0 * (n + 64) * 2.0**-53):
            return None  # a tie or a rounding at the cut
        return n

    def _bounded_race(self, size: int, kept: int, starts: np.ndarray, vmax: np.ndarray,
                      members: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                           torch.Tensor | None]]) -> tuple[float, int] | None:
        """The exponential race over `size` candidates of which ranks below `kept` can win, the generator drawn
        as the chain draws `size` exponentials. Ranks come in segments starting at `starts` (increasing, from 0,
        partitioning [0, kept)), each with an upper bound `vmax` on its logits; members(segments) -> (logits,
        token ids, ranks, tied or None) of the kept ranks in those segments, tied: the rank might be another
        token's. Segments whose best possible score cannot reach the best found are never looked at. Returns
        (score, token), or None (generator restored) on a near-tie or a tied winner."""
        self._state = self.generator.get_state()
        u = torch.empty(size, dtype=torch.float64).uniform_(generator=self.generator)  # exponential_'s draws
        umin = np.minimum.reduceat(u[:kept].numpy(), starts)
        temp = self.params.temperature
        with np.errstate(divide="ignore"):
            bound = vmax / temp - np.log(np.maximum(-np.log1p(-umin), _TINY))
        order = np.argsort(-bound, kind="stable")
        best, token, second, tied = -math.inf, -1, -math.inf, False
        i = 0
        while i < len(order) and bound[order[i]] >= best - _TOL * max(1.0, abs(best)):
            batch = order[i:i + 8].tolist()
            i += len(batch)
            v, tok, rank, ties = members(batch)
            scores = v / temp - _noise(u[rank])  # as the chain: float32 logit / T - noise
            top = torch.topk(scores, min(2, scores.numel()))
            for s, j in zip(top.values.tolist(), top.indices.tolist()):
                if s > best:
                    best, second, token, tied = s, best, int(tok[j]), ties is not None and bool(ties[j])
                elif s > second:
                    second = s
        if tied or not best - second > _TOL * max(1.0, abs(best)):
            self.generator.set_state(self._state)
            return None
        return best, token

    def probs(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """The distribution `sample` draws from, over the whole vocabulary: [V] float32, zeros where dropped."""
        if self.params.is_greedy:
            best = torch.argmax(self.penalize(logits, history))
            return torch.zeros(self.vocab_size, device=self.device).index_fill_(0, best.view(1), 1.0)
        vals, ids = self.candidates(logits, history)
        p = torch.softmax(vals, dim=0)  # [C]
        if ids is None:
            return p
        return torch.zeros(self.vocab_size, device=self.device).scatter_(0, ids, p)


class StopChecker:
    """Cuts generated text at the first stop string, holding back text that may be the start of one.

    feed(chunk) -> (text safe to emit, stopped). Once stopped, the stop string and everything after it
    are dropped, as in llama.cpp and OpenAI, and `word` is the stop string found (llama-server's stopping_word).
    At the end of generation without a stop, flush() returns the text still held back.
    """

    def __init__(self, stop: Iterable[str]):
        self.stop = tuple(stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        self._held = ""
        self.stopped = False
        self.word: str | None = None

    def feed(self, chunk: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        text = self._held + chunk
        hits = [(i, s) for s in self.stop if (i := text.find(s)) >= 0]
        if hits:
            at, self.word = min(hits, key=lambda h: h[0])
            self._held, self.stopped = "", True
            return text[:at], True
        hold = self._partial_suffix(text)
        self._held = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """Text held back at the end of generation (empty once stopped)."""
        text, self._held = self._held, ""
        return text

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest end of `text` that is a proper prefix of some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
