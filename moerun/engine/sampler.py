"""Token sampling in llama.cpp's default order, without host synchronisation, and stop strings.

Sampler chain (llama.cpp's default): penalties -> top-k -> top-p -> min-p -> temperature -> draw.
Everything is vectorised torch on the logits' device: the chosen token comes back as a 0-d tensor and
the caller decides when to copy it to the host (DESIGN.md, decision 8). The draw uses the exponential
race (argmax of log p - log E, E ~ Exp(1)), which samples exactly from softmax and, unlike
torch.multinomial, needs no normalisation and no validity check. It costs one random number per
candidate: negligible after top-k, ~6 ms per token on a 2-core CPU for a 150k vocabulary with every
truncation off.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable

import torch

from moerun.config import SamplingParams

_TINY = torch.finfo(torch.float32).tiny  # keeps -log(E) finite if E rounds to 0


class Sampler:
    """Picks the next token of one sequence. One Sampler per request: it owns the seeded generator."""

    def __init__(self, params: SamplingParams, vocab_size: int, device: str | torch.device = "cpu"):
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
        if self._top_p is not None:
            # probabilities over what top-k kept (llama.cpp renormalises here); lse covers a truncated head
            probs = torch.softmax(vals, dim=0) if lse is None else torch.exp(vals - lse)  # [C]
            keep = self._top_p_keep(probs)
            vals = vals.masked_fill(~keep, -math.inf)
        if self._log_min_p is not None:
            # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); vals[0] is the max
            vals = vals.masked_fill(vals < vals[0] + self._log_min_p, -math.inf)
        return vals / self.params.temperature, ids

    def _top_p_keep(self, probs: torch.Tensor) -> torch.Tensor:
        """probs [C] sorted descending -> keep [C] bool: the smallest prefix whose mass reaches top_p."""
        before = torch.cumsum(probs, dim=0) - probs  # [C] probability mass ranked above each token
        keep = before < self._top_p
        keep[0] = True  # always at least one token
        return keep

    def _sorted_head(self, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """vals [V] -> (the C most likely, sorted descending [C], their ids [C], logsumexp of all V).

        On a GPU this is a full sort (fixed shapes, no host sync). On the CPU, where reading a value
        is free and sorting 150k logits costs ~40 ms, only a head is sorted: grown until top-p or min-p
        is sure to drop its last token, so every token they keep is inside it.
        """
        lse = torch.logsumexp(vals, dim=0)  # []
        if self.device.type != "cpu":
            head, ids = torch.sort(vals, descending=True)
            return head, ids, lse
        k = min(256, self.vocab_size)
        while True:
            head, ids = torch.topk(vals, k)  # [k]
            if k == self.vocab_size:
                return head, ids, lse
            if self._log_min_p is not None and head[-1] < head[0] + self._log_min_p:
                return head, ids, lse
            if self._top_p is not None and not self._top_p_keep(torch.exp(head - lse))[-1]:
                return head, ids, lse
            k = min(4 * k, self.vocab_size)

    # -- results -----------------------------------------------------------------------------------

    def sample(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """logits [V], history [n] (prompt + generated ids) -> next token id, 0-d long on logits' device."""
        if self.params.is_greedy:
            return torch.argmax(self.penalize(logits, history))
        vals, ids = self.candidates(logits, history)  # [C]
        noise = self._noise[: vals.numel()]  # [C]
        noise.exponential_(generator=self.generator).clamp_min_(_TINY).log_()
        choice = torch.argmax(vals - noise)  # exponential race == one draw from softmax(vals)
        if ids is None:
            return choice
        return ids.gather(0, choice.view(1)).view(())  # tensor indexing, no .item()

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
    are dropped, as in llama.cpp and OpenAI. At the end of generation without a stop, flush() returns
    the text still held back.
    """

    def __init__(self, stop: Iterable[str]):
        self.stop = tuple(stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        self._held = ""
        self.stopped = False

    def feed(self, chunk: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        text = self._held + chunk
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self._held, self.stopped = "", True
            return text[: min(hits)], True
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
