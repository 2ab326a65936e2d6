"""Expert prefetch (DESIGN decision 6): guess the next MoE layer's experts, page them in on a side thread.

The guess: after layer i routes, the forward pass applies the next MoE layer j's router to the hidden state
it has now (the residual after layer i's attention, rms-normed with layer j's ffn_norm weight: layer i's
expert output, which j will also see, is not known yet) and takes its top-k (`guess_ids`). The cache hands
the guess to one background worker (`Prefetcher`, a ThreadPoolExecutor with one thread) that, for each
guessed expert not resident at j, reserves a slot with `SlotTable.prefetch` (the guess pinned, so one guess
never evicts another) and reads the expert into it, while the main thread computes layer i's experts (the
CPU kernel releases the GIL; file reads do too).

Correctness: the worker touches only layer j's table and slots, and the main thread is at layer i, so no
slot being computed with is written. `ExpertCache.fetch(j)` first waits for j's prefetch (`wait`), so no
slot being written is computed with; a wait covers only j's own prefetch, which was issued a layer ahead,
so a demand load never queues behind another layer's prefetch. Statistics are recorded by the main thread
at fetch time (CacheStats is not thread-safe): the guess is scored against what j then needed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch


def guess_ids(probs: torch.Tensor, ids: torch.Tensor) -> list[int]:
    """Distinct expert ids of a [T, k] top-k, most probable first (the order the worker loads them in)."""
    order = torch.argsort(probs.flatten(), descending=True, stable=True)
    return list(dict.fromkeys(ids.flatten()[order].tolist()))


@dataclass
class PrefetchResult:
    """One settled prefetch for one layer: the guess, what it cost, how long fetch waited for it."""

    guessed: tuple[int, ...]
    bytes_paged_in: int
    evictions: int
    seconds_waited: float


class Prefetcher:
    """One background worker and at most one prefetch in flight per layer.

    ``work(layer, guessed) -> (bytes_paged_in, evictions)`` runs on the worker (the cache's slot reservation
    and reads); ``submit`` queues it, ``wait`` settles it (re-raising what the worker raised)."""

    def __init__(self, work: Callable[[int, Sequence[int]], tuple[int, int]]):
        self._work = work
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moerun-prefetch")
        self._pending: dict[int, tuple[Future, tuple[int, ...]]] = {}
        self._settled: dict[int, PrefetchResult] = {}  # a prefetch settled early (resubmitted before fetch)

    def submit(self, layer: int, guessed: Sequence[int]) -> None:
        if layer in self._pending:  # the layer was guessed again before it ran: keep the first, fold its cost in
            self._settled[layer] = self._merge(self._settled.pop(layer, None), self._settle(layer))
        guessed = tuple(guessed)
        self._pending[layer] = (self._pool.submit(self._work, layer, guessed), guessed)

    def _settle(self, layer: int) -> PrefetchResult:
        fut, guessed = self._pending.pop(layer)
        t0 = time.perf_counter()
        paged, evictions = fut.result()
        return PrefetchResult(guessed, paged, evictions, time.perf_counter() - t0)

    @staticmethod
    def _merge(a: PrefetchResult | None, b: PrefetchResult) -> PrefetchResult:
        if a is None:
            return b
        return PrefetchResult(tuple(dict.fromkeys(a.guessed + b.guessed)), a.bytes_paged_in + b.bytes_paged_in,
                              a.evictions + b.evictions, a.seconds_waited + b.seconds_waited)

    def wait(self, layer: int) -> PrefetchResult | None:
        """Block until the layer's prefetch (if any) is done; its result, or None when none was issued."""
        early = self._settled.pop(layer, None)
        if layer not in self._pending:
            return early
        return self._merge(early, self._settle(layer))

    def close(self) -> None:
        """Finish what is in flight and stop the worker."""
        self._pool.shutdown(wait=True)
        self._pending.clear()
        self._settled.clear()
