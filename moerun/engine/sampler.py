"""Token sampling in llama.cpp's default order, without host synchronisation, and stop strings.

Sampler chain (llama.cpp's default): penalties -> top-k -> top-p -> min-p -> temperature -> draw.
The chosen token comes back as a 0-d tensor and the caller decides when to copy it to the host (DESIGN.md,
decision 8). The draw is llama.cpp's dist sampler: one uniform double U from the request's generator, the
candidates in token order (top-k's sorted by id, a head of the vocabulary put back in place), weights
exp(scaled - max) summed in double per block of 256 tokens and then within the block, the token the first whose
cumulative weight exceeds U times the total: one draw from softmax of the truncated scaled logits, up to rounding.

The arithmetic is moerun.kernels.sample's: an exp in float32 steps, sums in a fixed order, the chain's constants
(temperature, top_p, log min_p) rounded to float32. On the CPU its C passes (csrc/sample.c) do the full-vocabulary
work in one thread; elsewhere, and with MOERUN_KERNELS=off, a torch twin does the same operations in the same order,
so a CPU gets the same tokens either way (tests/test_sample_kernels.py). Top-k: torch.topk, then one C call does
top-p, min-p and the draw over the k. Top-p or min-p without top-k (`_fast_cut`): the C cut finds the smallest kept
logit without sorting (min-p a threshold; top-p's mass per bucket of value, then a sort of the two buckets around
the cut), and the draw reads the logits with that cut: the chain's tokens by construction, nothing random drawn
before the candidates are known. A step whose cut it cannot certify (a tie at the cut, a sum within rounding of
top_p) goes the plain way: a head of the logits sorted (`_sorted_head`), as on a GPU. With two torch threads on a
machine where another process is running, the chain took 150-230 ms (each parallel region waits for the thread
the other process holds up), so `sample` runs it on one torch thread. Greedy picks without penalties take one C
pass (argmax and the NaN check together).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable

import torch

from moerun.config import SamplingParams
from moerun.kernels import sample as samp

NO_HISTORY = torch.zeros(0, dtype=torch.long)
NAN_TOKEN = -1  # sample()'s id for logits that hold a NaN

# Vocabularies under _FAST_VOCAB tokens go the plain way without top-k: sorting them is cheap. The plain chain's
# first head holds _FIRST_HEAD tokens.
_FAST_VOCAB = 32768
_FIRST_HEAD = 256


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
        # the chain's constants in float32, as the logits (moerun.kernels.sample: both sides use these)
        self._top_p = samp.f32(p.top_p) if p.top_p < 1.0 else None
        self._log_min_p = samp.f32(math.log(p.min_p)) if p.min_p > 0.0 else None
        self._temp = samp.f32(p.temperature) if not p.is_greedy else None
        self._counts = torch.zeros(vocab_size, device=self.device) if self._penalise else None  # [V]
        self._one = torch.ones((), device=self.device)
        self._fast = fast and self.device.type == "cpu" and not p.is_greedy and not self._top_k and \
            (self._top_p is not None or self._log_min_p is not None) and vocab_size >= _FAST_VOCAB
        self._cut_bufs = samp.CutBuffers() if self._fast else None

    @property
    def uses_history(self) -> bool:
        """Whether `sample` reads the history it is given (a penalty applies)."""
        return self._penalise

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
        vals, ids = self._truncated(self.penalize(logits, history))
        return vals / self._temp, ids

    def _truncated(self, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Penalised logits [V] -> (top-k, top-p and min-p's candidates, before the temperature; ids or None)."""
        if self._top_k:
            vals, ids = torch.topk(vals, self._top_k)  # [k], sorted descending
            return samp.truncate_sorted(vals, self._top_p, self._log_min_p), ids
        if self._top_p is not None or self._log_min_p is not None:
            vals, ids, nrm = self._sorted_head(vals)  # [C], sorted descending
            return samp.truncate_sorted(vals, self._top_p, self._log_min_p, nrm), ids
        return vals, None

    def _sorted_head(self, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """vals [V] -> (the C most likely, sorted descending [C], their ids [C], (max, norm) of all V).

        On a GPU this is a full sort (fixed shapes, no host sync). On the CPU, where reading a value
        is free and sorting 150k logits costs ~40 ms, only a head is sorted: grown (256, 1024, 4096, ... tokens)
        until top-p or min-p is sure to drop its last token, so every token they keep is inside it.
        """
        mx = vals.max()
        nrm = (mx, samp.norm(vals, mx))
        if self.device.type != "cpu":
            head, ids = torch.sort(vals, descending=True)
            return head, ids, nrm
        k = min(_FIRST_HEAD, self.vocab_size)
        while True:
            head, ids = torch.topk(vals, k)  # [k]
            if self._head_ends(head, nrm):
                return head, ids, nrm
            k = min(4 * k, self.vocab_size)

    def _head_ends(self, head: torch.Tensor, nrm: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Whether a head of the sorted logits holds every token top-p and min-p can keep."""
        if head.numel() == self.vocab_size:
            return True
        if self._log_min_p is not None and head[-1] < head[0] + self._log_min_p:
            return True
        return self._top_p is not None and not bool(
            samp.top_p_keep(samp.exp32(head - nrm[0]) / nrm[1], self._top_p)[-1])

    # -- results -----------------------------------------------------------------------------------

    def sample(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """logits [V], history [n] (prompt + generated ids) -> next token id, 0-d long on logits' device; NAN_TOKEN
        where the logits hold a NaN (a broken model: every path would pick some token, none meaningful), which the
        caller reports (errors.NAN_LOGITS) when it reads the id back. On the CPU the chain runs on one torch thread: a
        vector of 250k is no work to split, and with more threads each parallel region waits for any thread another
        process holds up (150-230 ms a token seen on 2 busy cores)."""
        if self.params.is_greedy and not self._penalise and samp.available(logits):
            return torch.tensor(samp.argmax(logits))  # the pick and the NaN check in one C pass (NAN_TOKEN is -1)
        n = torch.get_num_threads() if logits.device.type == "cpu" else 1
        if n != 1:
            torch.set_num_threads(1)
        try:
            tok = self._sample(logits, history)
            return torch.where(logits.max().isnan(), NAN_TOKEN, tok)  # max keeps a NaN; no read back here (a sync)
        finally:
            if n != 1:
                torch.set_num_threads(n)

    def _uniform(self) -> torch.Tensor:
        """The draw's one uniform double, [1] on the sampler's device."""
        return torch.rand((1,), dtype=torch.float64, generator=self.generator, device=self.device)

    def _sample(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        if self.params.is_greedy:
            return torch.argmax(self.penalize(logits, history))
        vals = self.penalize(logits, history)
        if self._top_k:
            vals, ids = torch.topk(vals, self._top_k)  # [k], sorted descending
            return samp.topk_draw(vals, ids, self._temp, self._top_p, self._log_min_p, self._uniform())
        if self._fast and samp.available(vals):
            cut = self._fast_cut(vals)
            if cut is not None:
                return samp.draw(vals, self._temp, self._uniform(), cut)
        vals, ids = self._truncated(vals)
        if ids is not None:
            vals = torch.full((self.vocab_size,), -math.inf, device=self.device).scatter_(0, ids, vals)  # [V]
        return samp.draw(vals, self._temp, self._uniform())

    def _fast_cut(self, vals: torch.Tensor) -> float | None:
        """The smallest logit top-p and min-p keep (moerun.kernels.sample.cut), or None: the plain chain decides."""
        return samp.cut(vals, self._top_p, self._log_min_p, self._cut_bufs)

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
