"""Token sampling in llama.cpp's default order, without host synchronisation, and stop strings.

Sampler chain (llama.cpp's default): penalties -> top-k -> top-p -> min-p -> temperature -> draw.
Everything is vectorised torch on the logits' device: the chosen token comes back as a 0-d tensor and
the caller decides when to copy it to the host (DESIGN.md, decision 8). The draw is llama.cpp's dist sampler:
one uniform double U from the request's generator, the candidates in token order (top-k's sorted by id, a head
of the vocabulary put back in place), weights exp(scaled - max) summed in double per block of 256 tokens and then
within the block, the token the first whose cumulative weight exceeds U times the total: one draw from softmax
of the truncated scaled logits, up to rounding. (The draw was an exponential race before, one Exp(1) per
candidate: a seed now gives other tokens than it gave then, still the same ones every time.)

On the CPU, top-p or min-p without top-k would sort a head of most of a 250k vocabulary (tens of ms). There
`sample` takes a shortcut to the same candidates (`_fast`): min-p is a threshold on the logits; top-p's cut comes
from the logits in buckets of value (probability mass per bucket, the bucket the cut falls in sorted), or from
the plain chain's first head of 256 tokens where it holds the cut. The draw is then the same `_draw` over the
same weights, so the token is the chain's by construction; nothing random is drawn before the candidates are
known. A step whose cut the shortcut cannot certify (a tie at the cut, top-p's sum within rounding of the
threshold) goes the plain way. Every truncation off needs no shortcut: the draw sorts nothing. On a 2-core
Zen 5 (one torch thread) at vocabulary 248,320, per token (bench figures in the commit messages): top-p 0.95
without top-k 0.7-1.4 ms on flat logits where the exponential race took 1.9-4.0 ms (min-p 0.05 or 0), every
truncation off 0.3 ms for 0.95 ms, top-k 40 0.28 ms (0.24 before) and greedy 0.13 ms. With two torch threads
on a machine where another process is running, the chain took 150-230 ms (each parallel region waits for the
thread the other process holds up), so `sample` runs the chain on one torch thread.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable

import numpy as np
import torch

from moerun.config import SamplingParams

NO_HISTORY = torch.zeros(0, dtype=torch.long)

# The CPU's shortcut (module docstring): logits in _BUCKETS buckets of value over _SPAN nats below the largest
# (the rest in one more); heads up to _FIRST_HEAD tokens sorted as the plain chain does. Vocabularies under
# _FAST_VOCAB tokens go the plain way: sorting them is cheap, the shortcut's fixed costs are not. The draw sums
# its weights per block of _BLOCK tokens.
_FAST_VOCAB = 32768
_BUCKETS = 4096
_SPAN = 32.0
_BLOCK = 256
_FIRST_HEAD = 256


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
        n_blocks = -(-(self._top_k or vocab_size) // _BLOCK)
        self._weights = None if p.is_greedy else torch.zeros(n_blocks * _BLOCK, device=self.device)  # [nb * B]
        self._fast = fast and self.device.type == "cpu" and not p.is_greedy and not self._top_k and \
            (self._top_p is not None or self._log_min_p is not None) and vocab_size >= _FAST_VOCAB
        if self._fast:  # the shortcut's buffers: probabilities, the kept set, buckets of value
            self._probs, self._scratch = torch.empty(vocab_size), torch.empty(vocab_size)  # [V] float32
            self._probs64 = torch.empty(vocab_size, dtype=torch.float64)  # [V]
            self._keep, self._kept = torch.empty(vocab_size, dtype=torch.bool), torch.empty(vocab_size)  # [V]
            self._bucket = torch.empty(vocab_size, dtype=torch.int32)  # [V]

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
        ids, norm = None, None
        if self._top_k:
            vals, ids = torch.topk(vals, self._top_k)  # [k], sorted descending
        elif self._top_p is not None or self._log_min_p is not None:
            vals, ids, norm = self._sorted_head(vals)  # [C], sorted descending
        return self._truncate(vals, norm), ids

    def _truncate(self, vals: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Top-p, min-p and temperature over candidates sorted descending (or the whole vocabulary in order when
        neither applies); norm: `_norm` of the whole vocabulary when `vals` is a head of it."""
        if self._top_p is not None:
            # probabilities over what top-k kept (llama.cpp renormalises here); norm covers a truncated head
            probs = torch.softmax(vals, dim=0) if norm is None else torch.exp(vals - norm[0]) / norm[1]  # [C]
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

    @staticmethod
    def _norm(vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """vals [V] -> (max, sum of exp(vals - max)), both [] float32: token i's probability is
        exp(vals[i] - max) / sum, as the chain and the shortcut compute it."""
        mx = vals.max()
        return mx, torch.exp(vals - mx).sum()

    def _sorted_head(self, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """vals [V] -> (the C most likely, sorted descending [C], their ids [C], `_norm` of all V).

        On a GPU this is a full sort (fixed shapes, no host sync). On the CPU, where reading a value
        is free and sorting 150k logits costs ~40 ms, only a head is sorted: grown (256, 1024, 4096, ... tokens)
        until top-p or min-p is sure to drop its last token, so every token they keep is inside it.
        """
        norm = self._norm(vals)
        if self.device.type != "cpu":
            head, ids = torch.sort(vals, descending=True)
            return head, ids, norm
        k = min(_FIRST_HEAD, self.vocab_size)
        while True:
            head, ids = torch.topk(vals, k)  # [k]
            if self._head_ends(head, norm):
                return head, ids, norm
            k = min(4 * k, self.vocab_size)

    def _head_ends(self, head: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Whether a head of the sorted logits holds every token top-p and min-p can keep."""
        if head.numel() == self.vocab_size:
            return True
        if self._log_min_p is not None and head[-1] < head[0] + self._log_min_p:
            return True
        return self._top_p is not None and not bool(self._top_p_keep(torch.exp(head - norm[0]) / norm[1])[-1])

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
            got = self._fast_candidates(vals)
            if got is not None:
                return self._draw(*got)
            return self._draw_candidates(*self.candidates(vals, NO_HISTORY))
        return self._draw_candidates(*self.candidates(logits, history))

    def _draw_candidates(self, vals: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        """One draw from softmax(vals) over candidates vals [C] (scaled logits, -inf where dropped), ids [C] or
        None, in token order: top-k's candidates sorted by id, a head of the vocabulary put back in place."""
        if ids is None:
            return self._draw(vals)
        if not self._top_k:
            full = torch.full((self.vocab_size,), -math.inf, device=self.device)  # [V]
            return self._draw(full.scatter_(0, ids, vals))
        ids, order = torch.sort(ids)  # [k] token order
        return ids.gather(0, self._draw(vals.gather(0, order)).view(1)).view(())

    def _draw(self, scaled: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Inverse CDF over scaled [C] (token order, -inf where dropped) with one uniform double U: the first
        index whose cumulative weight exp(scaled - max) exceeds U times the total -> 0-d long. Weights are summed
        in double, per block of _BLOCK, then within the block the target falls in. keep [C] float32, 1 or 0: drops
        more (the same weights as -inf there, if the largest is kept)."""
        c = scaled.numel()
        w = self._weights  # [nb * B] float32, zero past c
        m = scaled.max()
        torch.sub(scaled, m, out=w[:c]).exp_()
        if keep is not None:
            w[:c].mul_(keep)
        if self.device.type != "cpu" or math.isinf(m.item()):
            w.nan_to_num_(nan=1.0)  # +inf logits share the draw; exp(inf - inf) is NaN
        rows = w.view(-1, _BLOCK)  # [nb, B]
        cum = torch.zeros(rows.shape[0] + 1, dtype=torch.float64, device=self.device)  # [nb+1] weight before each block
        torch.cumsum(rows.sum(1, dtype=torch.float64), 0, out=cum[1:])
        u = torch.rand((1,), dtype=torch.float64, generator=self.generator, device=self.device)  # [1]
        target = u * cum[-1]  # [1]
        last = (cum[1:] < cum[-1]).sum().view(1)  # [1] the last block holding weight
        b = torch.minimum(torch.searchsorted(cum[1:], target, right=True), last)  # [1]
        within = rows.index_select(0, b).view(-1).double().cumsum_(0).add_(cum.index_select(0, b))  # [B]
        j = torch.minimum(torch.searchsorted(within, target, right=True), (within < within[-1]).sum().view(1))
        return (b * _BLOCK + j).view(())

    # -- the CPU's shortcut (module docstring) -----------------------------------------------------

    def _fast_candidates(self, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """What `candidates` gives for penalised logits vals [V] when top-k is off, put back in token order, as
        `_draw`'s arguments: (scaled [V], keep [V] or None); None where the shortcut cannot tell."""
        mx = vals.max()
        if not bool(torch.isfinite(mx)):
            return None  # NaN or +inf: the plain chain's rules
        tau = None  # [] the smallest logit kept
        if self._log_min_p is not None:
            tau = mx + self._log_min_p  # as _truncate computes it
        if self._top_p is not None:
            probs = torch.sub(vals, mx, out=self._probs).exp_()  # [V] as `_norm`
            total = probs.sum()
            probs.div_(total)  # [V] float32, as the chain computes them
            if tau is not None and self._top_p_passes(vals, probs, tau):
                return vals / self.params.temperature, self._kept
            # the plain chain's first head of 256 tokens, unless top-p cannot end there (its first 255 tokens,
            # none more likely than the first, hold too little mass)
            if (_FIRST_HEAD - 1) / float(total) * (1 + 1e-5) >= self._top_p:
                head, ids = torch.topk(vals, _FIRST_HEAD)
                if self._head_ends(head, (mx, total)):
                    full = torch.full((self.vocab_size,), -math.inf)  # [V]
                    return full.scatter_(0, ids, self._truncate(head, (mx, total))), None
            cut = self._top_p_cut(vals, mx, probs)
            if cut is None:
                return None
            tau = cut if tau is None else torch.maximum(tau, cut)
        keep = self._kept.copy_(torch.ge(vals, tau, out=self._keep))  # [V] 1.0 where kept
        return vals / self.params.temperature, keep

    def _top_p_passes(self, vals: torch.Tensor, probs: torch.Tensor, tau: torch.Tensor) -> bool:
        """Whether top-p keeps every logit >= tau (min-p's cut comes first): their mass under top_p by more than
        a float32 sum of V terms in any order can be off (V 2^-24)."""
        kept = torch.ge(vals, tau, out=self._keep)  # [V] bool
        return float(torch.dot(probs, self._kept.copy_(kept))) < self._top_p - self.vocab_size * 2.0**-24

    def _top_p_cut(self, vals: torch.Tensor, mx: torch.Tensor, probs: torch.Tensor) -> torch.Tensor | None:
        """The smallest logit top-p keeps, as `_top_p_keep` counts over the sorted vocabulary (float32 probabilities
        summed in double in rank order), from the mass per bucket of value and a sort of the bucket the cut falls
        in and the next; None where rounding or a tie could make it differ. -> [] float32. Top-p keeps 256 tokens
        or more here (the first head would have held fewer)."""
        scale = _BUCKETS / _SPAN
        bucket = torch.sub(mx, vals, out=self._scratch).mul_(scale).clamp_(max=_BUCKETS)  # [V] larger logits first
        bucket = self._bucket.copy_(bucket)  # [V] int32
        mass = torch.bincount(bucket, weights=self._probs64.copy_(probs), minlength=_BUCKETS + 1).numpy()  # [B+1]
        cum = np.cumsum(mass)  # [B+1]
        threshold = torch.tensor(self._top_p, dtype=torch.float32).item()  # the comparison is in float32
        b = int(np.searchsorted(cum, threshold))
        if b >= _BUCKETS - 1:
            return None  # the cut among the smallest logits: left to the sort
        above = float(cum[b - 1]) if b > 0 else 0.0
        if above > threshold - 1e-7:
            return None  # every rank above bucket b kept only if clearly below the threshold
        bn = bucket.numpy()
        tok = torch.from_numpy(np.flatnonzero((bn == b) | (bn == b + 1)))  # [m] buckets b and b + 1
        sv, order = torch.sort(vals[tok], descending=True)
        p = probs[tok[order]]  # [m] sorted descending
        total = above + torch.cumsum(p.double(), 0)  # [m] the mass up to each rank, inclusive
        before = total.float() - p  # float32, as _top_p_keep
        keep = before < self._top_p
        t = int(keep.sum())
        if t == 0 or t == keep.numel() or bool(keep[:t].logical_not().any()):
            return None
        # the chain sums the same float32 numbers in double, in rank order: each of at most V additions of numbers
        # under 1 rounds by at most 2^-53, so the two sums differ by less than 2 V 2^-53
        if bool(sv[t - 1] == sv[t]) or _near_rounding(total[t - 1:t + 1], 2.0 * (self.vocab_size + 64) * 2.0**-53):
            return None  # a tie or a rounding at the cut
        return sv[t - 1]

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
