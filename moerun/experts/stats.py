"""Expert-cache statistics per (layer, phase), with the summary lines the CLI prints.

Definitions (one step = the experts one layer needs for one token or one batch step):

- queries: distinct experts requested, summed over steps; hits + misses == queries.
- misses_home: misses computed where the expert lives (on the CPU, from RAM or the file) instead of being
  paged in; misses_streamed: misses a device stage passed through its prefill stream buffer (paged in for
  one step without entering a slot). The other misses were paged into slots.
- evictions: experts dropped from a slot to make room; bytes_paged_in: bytes copied into slots
  (demand loads and prefetches); bytes_streamed: bytes through the stream buffer; seconds_copy: time the
  host-to-device copies took (device stages; their GB/s is the bytes over it); seconds_stalled: time compute
  waited on expert copies.
- prefetch_issued: experts guessed for a step before it ran (the guess, whether or not a copy
  was needed); prefetch_used: guessed experts the step then needed; prefetch_needed: experts
  needed by steps that had a guess. precision = used / issued, recall = used / needed.

Not thread-safe: record from the forward thread (a prefetch thread reports through it).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass, fields

PHASES = ("prefill", "decode")


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


@dataclass
class Counters:
    queries: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_paged_in: int = 0
    seconds_stalled: float = 0.0
    misses_home: int = 0
    misses_streamed: int = 0
    bytes_streamed: int = 0
    seconds_copy: float = 0.0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_needed: int = 0

    def add(self, other: Counters) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def hit_rate(self) -> float | None:
        """hits / queries, None when there were no queries."""
        return _ratio(self.hits, self.queries)

    @property
    def home_share(self) -> float | None:
        """Share of the misses computed at home (None without misses)."""
        return _ratio(self.misses_home, self.misses)

    @property
    def h2d_gbps(self) -> float | None:
        """GB/s of the host-to-device copies (slots and stream), None where none were timed."""
        return _ratio((self.bytes_paged_in + self.bytes_streamed) / 1e9, self.seconds_copy)

    @property
    def prefetch_precision(self) -> float | None:
        return _ratio(self.prefetch_used, self.prefetch_issued)

    @property
    def prefetch_recall(self) -> float | None:
        return _ratio(self.prefetch_used, self.prefetch_needed)

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "home_share": self.home_share, "h2d_gbps": self.h2d_gbps,
                "prefetch_precision": self.prefetch_precision, "prefetch_recall": self.prefetch_recall}


_COUNTER_NAMES = tuple(f.name for f in fields(Counters))


def _check_phase(phase: str) -> str:
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    return phase


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


class CacheStats:
    """Counters per (layer, phase). Layers are the model's layer indices."""

    def __init__(self):
        self._c: dict[tuple[int, str], Counters] = {}

    def _get(self, layer: int, phase: str) -> Counters:
        key = (int(layer), _check_phase(phase))
        if key not in self._c:
            self._c[key] = Counters()
        return self._c[key]

    # -- recording ---------------------------------------------------------------------------
    def add(self, layer: int, phase: str, **counts) -> None:
        """Add any of the counters by name, e.g. ``add(3, "decode", evictions=1)``."""
        unknown = set(counts) - set(_COUNTER_NAMES)
        if unknown:
            raise ValueError(f"unknown cache counter(s) {sorted(unknown)}; known: {_COUNTER_NAMES}")
        c = self._get(layer, phase)
        for name, value in counts.items():
            setattr(c, name, getattr(c, name) + value)

    def record_step(self, layer: int, phase: str, hits: int, misses: int, evictions: int = 0,
                    bytes_paged_in: int = 0, seconds_stalled: float = 0.0, misses_home: int = 0,
                    misses_streamed: int = 0, bytes_streamed: int = 0) -> None:
        """One step's outcome at one layer (queries = hits + misses)."""
        self.add(layer, phase, queries=hits + misses, hits=hits, misses=misses, evictions=evictions,
                 bytes_paged_in=bytes_paged_in, seconds_stalled=seconds_stalled, misses_home=misses_home,
                 misses_streamed=misses_streamed, bytes_streamed=bytes_streamed)

    def record_prefetch(self, layer: int, phase: str, guessed: Collection[int],
                        needed: Collection[int]) -> None:
        """Score one prefetch guess for ``layer`` against the experts the step then needed."""
        g, n = set(guessed), set(needed)
        self.add(layer, phase, prefetch_issued=len(g), prefetch_used=len(g & n), prefetch_needed=len(n))

    def reset(self) -> None:
        self._c.clear()

    # -- reading -----------------------------------------------------------------------------
    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self._c})

    def get(self, layer: int | None = None, phase: str | None = None) -> Counters:
        """Counters summed over what is left None (all layers and/or both phases); a copy."""
        if phase is not None:
            _check_phase(phase)
        out = Counters()
        for (lay, ph), c in self._c.items():
            if (layer is None or lay == layer) and (phase is None or ph == phase):
                out.add(c)
        return out

    def totals(self) -> dict[str, Counters]:
        """{"prefill": ..., "decode": ..., "all": ...} summed over layers."""
        return {**{ph: self.get(phase=ph) for ph in PHASES}, "all": self.get()}

    def hit_rate(self, layer: int | None = None, phase: str | None = None) -> float | None:
        return self.get(layer, phase).hit_rate

    # -- combining and export ----------------------------------------------------------------
    def merge(self, other: CacheStats) -> CacheStats:
        """A new object holding the sum of both (e.g. two pipeline stages' caches)."""
        out = CacheStats()
        for src in (self, other):
            for (layer, phase), c in src._c.items():
                out._get(layer, phase).add(c)
        return out

    __add__ = merge

    def __eq__(self, other) -> bool:
        if not isinstance(other, CacheStats):
            return NotImplemented
        zero = Counters()
        mine = {k: v for k, v in self._c.items() if v != zero}
        theirs = {k: v for k, v in other._c.items() if v != zero}
        return mine == theirs

    def to_dict(self) -> dict:
        """JSON-ready: per-layer counters (raw and derived) and totals per phase."""
        layers = {str(layer): {ph: self._c[(layer, ph)].to_dict() for ph in PHASES if (layer, ph) in self._c}
                  for layer in self.layers()}
        return {"layers": layers, "total": {k: c.to_dict() for k, c in self.totals().items()}}

    @classmethod
    def from_dict(cls, d: dict) -> CacheStats:
        """Inverse of ``to_dict`` (derived fields are ignored)."""
        out = cls()
        for layer, phases in d.get("layers", {}).items():
            for phase, c in phases.items():
                out.add(int(layer), phase, **{k: c[k] for k in _COUNTER_NAMES if k in c})
        return out

    # -- text --------------------------------------------------------------------------------
    def summary_line(self) -> str:
        """One line in the spirit of llama.cpp's timing lines, e.g.
        ``expert cache: prefill hit rate 41.2% (1234/2996), decode hit rate 78.5% (2345/2987),
        512.0 MiB paged in, 0.84 s stalled, prefetch precision 62.0% recall 55.1%``"""
        t = self.totals()
        parts = [f"{ph} hit rate {_pct(t[ph].hit_rate)} ({t[ph].hits}/{t[ph].queries})"
                 for ph in PHASES if t[ph].queries]
        if not parts:
            return "expert cache: no queries"
        a = t["all"]
        if a.misses_home or a.misses_streamed:
            ways = [(a.misses - a.misses_home - a.misses_streamed, "paged in"), (a.misses_streamed, "streamed"),
                    (a.misses_home, f"computed at home ({_pct(a.home_share)})")]
            parts.append("misses " + ", ".join(f"{n} {how}" for n, how in ways if n))
        parts.append(f"{_mib(a.bytes_paged_in + a.bytes_streamed)} paged in")
        if a.h2d_gbps is not None:
            parts.append(f"h2d {a.h2d_gbps:.1f} GB/s")
        parts.append(f"{a.seconds_stalled:.2f} s stalled")
        if a.prefetch_issued:
            parts.append(f"prefetch precision {_pct(a.prefetch_precision)} recall {_pct(a.prefetch_recall)}")
        return "expert cache: " + ", ".join(parts)

    def per_layer_lines(self) -> list[str]:
        """One line per layer (for --verbose), e.g.
        ``layer   3: prefill  41.2% (12/30), decode  78.5% (62/79), 4 evictions, 1.5 MiB in, 0.01 s stalled``"""
        lines = []
        for layer in self.layers():
            parts = []
            for ph in PHASES:
                c = self._c.get((layer, ph))
                if c is not None and c.queries:
                    parts.append(f"{ph} {_pct(c.hit_rate):>6} ({c.hits}/{c.queries})")
            a = self.get(layer)
            parts += [f"{a.evictions} evictions", f"{_mib(a.bytes_paged_in)} in", f"{a.seconds_stalled:.2f} s stalled"]
            if a.prefetch_issued:
                parts.append(f"prefetch p {_pct(a.prefetch_precision)} r {_pct(a.prefetch_recall)}")
            lines.append(f"layer {layer:>3}: " + ", ".join(parts))
        return lines
