"""Prometheus metrics (llama.cpp's `llamacpp:*` names where they fit, vLLM's `vllm:*` for the load gauges that
routers read, `moerun:*` for the rest) and the server's log lines: per request llama.cpp's timing lines and the
request's expert-cache figures; while busy, one vLLM-style throughput line every few seconds.

Counters are updated from the engine thread through the scheduler's Observer calls; gauges and the expert
cache's counters are read from the scheduler's snapshot when /metrics is scraped. One registry per server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

if TYPE_CHECKING:
    from moerun.engine.scheduler import Request, Snapshot

log = logging.getLogger("moerun.server")

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 240.0,
                480.0, 960.0)

# moerun:expert_cache_* counter -> the CacheStats Counters field it reports
_CACHE_COUNTERS = {"expert_cache_queries": "queries", "expert_cache_hits": "hits",
                   "expert_cache_evictions": "evictions", "expert_paged_bytes": "bytes_paged_in",
                   "expert_prefetch_hits": "prefetch_used", "expert_cache_stall_seconds": "seconds_stalled"}


class _CacheCollector:
    """moerun:expert_cache_* from the last snapshot of the cache's statistics, labelled layer, device, phase and
    rank: under expert parallelism each rank's cache is a series of its own, in this process or across
    processes (where the snapshot holds the other ranks' counters as the engine thread last fetched them:
    moerun.expert_parallel.RankCaches); otherwise rank is "0". device is this process's engine's."""

    def __init__(self, snapshot: Callable[[], Snapshot | None], device: Callable[[], str]):
        self.snapshot, self.device = snapshot, device

    def collect(self):
        snap = self.snapshot()
        stats = snap.cache if snap is not None else None
        families = {name: CounterMetricFamily(f"moerun:{name}", f"expert cache: {field.replace('_', ' ')}",
                                              labels=["layer", "device", "phase", "rank"])
                    for name, field in _CACHE_COUNTERS.items()}
        ranks = getattr(stats, "ranks", None)
        for rank, part in (() if stats is None else zip(ranks, stats.parts) if ranks else [(0, stats)]):
            for layer in part.layers():
                for phase in ("prefill", "decode"):
                    c = part.get(layer, phase)
                    for name, field in _CACHE_COUNTERS.items():
                        families[name].add_metric([str(layer), self.device(), phase, str(rank)], getattr(c, field))
        yield from families.values()

    def describe(self):
        return []


class Telemetry:
    """The server's registry, and the scheduler's Observer: metrics and the per-request log lines."""

    def __init__(self, snapshot: Callable[[], Snapshot | None], device: Callable[[], str] = lambda: "cpu"):
        self.registry = r = CollectorRegistry()
        self.prompt_tokens = Counter("llamacpp:prompt_tokens", "Prompt tokens evaluated", registry=r)
        self.prompt_seconds = Counter("llamacpp:prompt_seconds", "Prompt evaluation time", registry=r)
        self.tokens_predicted = Counter("llamacpp:tokens_predicted", "Tokens generated", registry=r)
        self.predicted_seconds = Counter("llamacpp:tokens_predicted_seconds", "Generation time", registry=r)
        self.requests_finished = Counter("moerun:requests_finished", "Requests finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.prefix_queries = Counter("moerun:prefix_cache_queries", "Prompt tokens looked up in the KV cache",
                                      registry=r)
        self.prefix_hits = Counter("moerun:prefix_cache_hits", "Prompt tokens found in the KV cache (the slot's own "
                                   "or other sequences' shared blocks): not computed again", registry=r)
        self.ttft = Histogram("moerun:time_to_first_token_seconds", "Arrival to first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("moerun:inter_token_latency_seconds", "Time between a request's tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("moerun:e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_E2E_BUCKETS, registry=r)

        def gauge(name: str, doc: str, read: Callable[[Snapshot], float]) -> None:
            Gauge(name, doc, registry=r).set_function(lambda: 0.0 if (s := snapshot()) is None else read(s))

        gauge("llamacpp:requests_processing", "Requests running", lambda s: s.running)
        gauge("llamacpp:requests_deferred", "Requests waiting for a slot", lambda s: s.waiting)
        gauge("llamacpp:kv_cache_usage_ratio", "KV cache blocks in use / all blocks", lambda s: s.kv_usage)
        gauge("llamacpp:kv_cache_tokens", "Positions held in the KV cache (slots keep theirs)", lambda s: s.kv_tokens)
        gauge("moerun:prefix_cache_hit_ratio", "Prompt tokens found in the KV cache / prompt tokens, since start",
              lambda s: s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0)
        gauge("moerun:tokens_in_flight", "Tokens of the requests running (prompt and generated) and waiting "
              "(prompt): /get_load's figure", lambda s: s.tokens_in_flight)
        gauge("vllm:num_requests_running", "Requests running", lambda s: s.running)
        gauge("vllm:num_requests_waiting", "Requests waiting for a slot", lambda s: s.waiting)
        gauge("vllm:kv_cache_usage_perc", "KV cache positions the running requests hold / all (slots' kept "
              "prefixes left out, as vLLM leaves out its prefix cache), 1 = full", lambda s: s.kv_running_usage)
        gauge("vllm:gpu_prefix_cache_hit_rate", "Prompt tokens found in the KV cache / prompt tokens, since start",
              lambda s: s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0)
        r.register(_CacheCollector(snapshot, device))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- Observer ---------------------------------------------------------------------------------------

    def prompt_done(self, req: Request) -> None:
        self.prompt_tokens.inc(req.timings.prompt_n)
        self.prompt_seconds.inc(req.timings.prompt_ms / 1e3)
        self.prefix_queries.inc(len(req.prompt))
        self.prefix_hits.inc(req.timings.cache_n)

    def token(self, req: Request, gap: float | None) -> None:
        if gap is None:
            self.ttft.observe(req.t_first - req.arrival)
        else:
            self.itl.observe(gap)

    def finished(self, req: Request) -> None:
        self.tokens_predicted.inc(req.timings.predicted_n)
        self.predicted_seconds.inc(req.timings.predicted_ms / 1e3)
        self.requests_finished.labels(req.finish_reason).inc()
        if req.t_first is not None:
            self.e2e.observe(req.t_end - req.arrival)
        for line in request_log_lines(req):
            log.info(line)


def _pct(num: int, den: int) -> str:
    return f"{100 * num / den:.1f}%" if den else "n/a"


def request_log_lines(req: Request) -> list[str]:
    """llama.cpp's timing lines and the request's expert-cache line, e.g.
    ``expert cache: prefill hit rate 0.0% (0/12), decode hit rate 81.2% (130/160), 1.2 MiB paged in``"""
    head = (f"request {req.id} (slot {req.slot}): {req.finish_reason}, {len(req.prompt)} prompt tokens "
            f"({req.timings.cache_n} cached), {len(req.tokens)} generated, seed {req.seed}")
    lines = [head, *req.timings.log_lines()]
    parts = [f"{ph} hit rate {_pct(c.hits, c.queries)} ({c.hits}/{c.queries})" for ph, c in req.cache.items()
             if c.queries]
    if parts:
        paged = sum(c.bytes_paged_in for c in req.cache.values()) / 2**20
        lines.append("expert cache: " + ", ".join(parts) + f", {paged:.1f} MiB paged in")
    return lines


def _by_rank(now, before) -> str:
    """Each expert-parallel rank's hit rate between two snapshots' statistics (StageStats with ranks), e.g.
    `` (rank 0 75.1%, rank 1 78.9%)``; nothing without ranks."""
    ranks = getattr(now, "ranks", None)
    if not ranks:
        return ""
    olds = before.parts if getattr(before, "ranks", None) == ranks else [None] * len(ranks)
    rates = []
    for r, part, old in zip(ranks, now.parts, olds):
        a, b = part.get(), old.get() if old is not None else None
        rates.append(f"rank {r} {_pct(a.hits - (b.hits if b else 0), a.queries - (b.queries if b else 0))}")
    return f" ({', '.join(rates)})"


class ThroughputLog:
    """vLLM's periodic line, e.g. ``Avg prompt throughput: 120.0 tokens/s, Avg generation throughput: 41.3
    tokens/s, Running: 3 reqs, Waiting: 0 reqs, KV cache usage: 4.2%, Expert cache hit rate: 77.0%,
    paged in: 12.5 MB/s`` (under expert parallelism each rank's rate after the total's, in parentheses). `tick()` after each engine step; it writes when `interval` seconds have passed
    and there was work since the last line."""

    def __init__(self, snapshot: Callable[[], Snapshot | None], interval: float):
        self.snapshot, self.interval = snapshot, interval
        self._last: Snapshot | None = None
        self._at = time.perf_counter()

    def tick(self) -> None:
        now = time.perf_counter()
        if self.interval <= 0 or now - self._at < self.interval:
            return
        snap = self.snapshot()
        if snap is None:
            return
        last, dt = self._last, now - self._at
        self._last, self._at = snap, now
        if last is None:
            return
        prompt, gen = snap.prompt_tokens - last.prompt_tokens, snap.generated_tokens - last.generated_tokens
        if not (prompt or gen or snap.running or snap.waiting):
            return
        line = (f"Avg prompt throughput: {prompt / dt:.1f} tokens/s, Avg generation throughput: {gen / dt:.1f} "
                f"tokens/s, Running: {snap.running} reqs, Waiting: {snap.waiting} reqs, "
                f"KV cache usage: {100 * snap.kv_usage:.1f}%")
        if snap.cache is not None:
            a = snap.cache.get()
            b = last.cache.get() if last.cache is not None else None
            hits, queries = a.hits - (b.hits if b else 0), a.queries - (b.queries if b else 0)
            paged = a.bytes_paged_in - (b.bytes_paged_in if b else 0)
            line += f", Expert cache hit rate: {_pct(hits, queries)}{_by_rank(snap.cache, last.cache)}, " \
                    f"paged in: {paged / dt / 1e6:.1f} MB/s"
        log.info(line)
        if snap.cache is not None and log.isEnabledFor(logging.DEBUG):  # -v: per layer, since the start
            for layer_line in snap.cache.per_layer_lines():
                log.debug(layer_line)
