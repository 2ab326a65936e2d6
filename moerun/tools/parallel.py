"""Parallel part-by-part work for the writers: an order-keeping map over a thread pool.

Quantizing one expert is a long run of small torch ops; torch's own intra-op threads gain little on
them and collapse when the cores are shared (DESIGN.md, decision 9). So the writers run torch with
one intra-op thread and quantize several parts (experts) at once on a pool of Python threads
(torch releases the GIL inside its kernels), keeping a few parts in flight.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

__all__ = ["default_workers", "ordered_map", "worker_pool"]

T = TypeVar("T")
R = TypeVar("R")


def default_workers() -> int:
    """The CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def worker_pool(threads: int | None = None) -> Iterator[ThreadPoolExecutor | None]:
    """A pool of `threads` workers (None: one per CPU; 1: no pool), torch intra-op threads set to 1 meanwhile."""
    n = threads or default_workers()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if n <= 1:
            yield None
        else:
            with ThreadPoolExecutor(n, thread_name_prefix="moerun-tools") as pool:
                yield pool
    finally:
        torch.set_num_threads(before)


def ordered_map(fn: Callable[[T], R], items: Iterable[T], pool: ThreadPoolExecutor | None,
                window: int = 8) -> Iterator[R]:
    """fn over items, results in input order, at most `window` in flight; without a pool, plain map."""
    if pool is None:
        yield from map(fn, items)
        return
    pending: deque[Future[R]] = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()
