"""Routing traces: record which experts each token used, replay them offline against a cache.

File format (JSON Lines, UTF-8). Line 1 is the header, every other line one record:

    {"moerun_trace": 1, "family": "qwen3moe", "n_layers": 48, "n_experts": 128, "k": 8}
    {"req": "r0", "pos": 17, "phase": "decode", "layer": 3, "experts": [5, 90], "weights": [0.7, 0.3]}

A record may carry ``"step": n`` (the forward-pass step counter), which lets a replay group a
batch step's records at one layer into one cache step (``group="batch"``). Weights are written
rounded to 6 decimals. Records are written in forward order; only the order of records within
one layer matters for a replay, since each layer has its own cache.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from moerun.errors import MoerunError
from moerun.experts.policy import POLICIES, Policy, SlotTable, make_policy
from moerun.experts.stats import PHASES, CacheStats

TRACE_VERSION = 1
GROUPS = ("token", "batch")


class TraceFormatError(MoerunError):
    """A routing trace file is malformed; the message names the file and line."""

    def __init__(self, path: str | Path, line: int, problem: str):
        self.path, self.line, self.problem = str(path), line, problem
        super().__init__(f"{self.path}:{line}: {problem}")


@dataclass(frozen=True)
class TraceHeader:
    family: str
    n_layers: int
    n_experts: int
    k: int
    extra: dict = field(default_factory=dict)  # anything else worth keeping (model path, qtype, ...)

    @classmethod
    def from_spec(cls, spec, **extra) -> TraceHeader:
        """From a ModelSpec (family, n_layers, n_experts, n_experts_used)."""
        return cls(spec.family, spec.n_layers, spec.n_experts, spec.n_experts_used, dict(extra))

    def to_json(self) -> dict:
        return {"moerun_trace": TRACE_VERSION, "family": self.family, "n_layers": self.n_layers,
                "n_experts": self.n_experts, "k": self.k, **self.extra}


@dataclass(frozen=True)
class TraceRecord:
    request_id: int | str
    position: int
    phase: str
    layer: int
    experts: tuple[int, ...]
    weights: tuple[float, ...]
    step: int | None = None

    def to_json(self) -> dict:
        d = {"req": self.request_id, "pos": self.position, "phase": self.phase, "layer": self.layer,
             "experts": list(self.experts), "weights": [round(w, 6) for w in self.weights]}
        if self.step is not None:
            d["step"] = self.step
        return d


@dataclass(frozen=True)
class Trace:
    header: TraceHeader
    records: list[TraceRecord]


def _list(x) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)  # tensors and arrays without importing torch


class RouteRecorder:
    """A model's `on_route` hook writing every routing decision to a new trace file; `request` numbers the
    requests (chat turns, benchmark runs)."""

    def __init__(self, path: str | Path, spec):
        path = Path(path)
        if path.exists():
            raise MoerunError(f"{path} already exists; choose another --trace-routing file")
        self.writer = TraceWriter(path, TraceHeader.from_spec(spec))
        self.request = 0

    def __call__(self, layer, phase, pos, ids, w):
        self.writer.write_step(layer=layer, phase=phase, request_ids=[self.request] * len(pos),
                               positions=pos.tolist(), experts=ids, weights=w)


class TraceWriter:
    """Write a trace as JSON Lines; flushed every ``flush_every`` records and on close.

    with TraceWriter(path, TraceHeader.from_spec(spec)) as w:
        w.write_step(layer=3, phase="decode", request_ids=["r0"], positions=[17],
                     experts=topk_ids, weights=topk_weights, step=n)   # tensors are fine
    """

    def __init__(self, path: str | Path, header: TraceHeader, *, flush_every: int = 256):
        self.path = Path(path)
        self.header = header
        self.flush_every = max(1, int(flush_every))
        self.records_written = 0
        self._f = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 (held open across writes)
        self._line(header.to_json())
        self._f.flush()

    def _line(self, obj: dict) -> None:
        self._f.write(json.dumps(obj, separators=(",", ":")) + "\n")

    def write(self, record: TraceRecord) -> None:
        if record.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {record.phase!r}")
        if len(record.experts) != len(record.weights):
            raise ValueError(f"{len(record.experts)} experts but {len(record.weights)} weights")
        self._line(record.to_json())
        self.records_written += 1
        if self.records_written % self.flush_every == 0:
            self._f.flush()

    def write_step(self, *, layer: int, phase: str, request_ids: Sequence, positions: Sequence,
                   experts, weights, step: int | None = None) -> None:
        """One record per token of a step at one layer; ``experts``/``weights`` are [tokens, k]."""
        rows_e, rows_w, rids, pos = _list(experts), _list(weights), _list(request_ids), _list(positions)
        if not len(rows_e) == len(rows_w) == len(rids) == len(pos):
            raise ValueError(f"write_step: {len(rids)} request ids, {len(pos)} positions, "
                             f"{len(rows_e)} expert rows, {len(rows_w)} weight rows")
        for rid, p, e, w in zip(rids, pos, rows_e, rows_w):
            self.write(TraceRecord(rid, int(p), phase, int(layer), tuple(int(x) for x in e),
                                   tuple(float(x) for x in w), step))

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _int(v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{what} must be an integer, got {v!r}")
    return v


def _parse_header(obj) -> TraceHeader:
    if not isinstance(obj, dict) or "moerun_trace" not in obj:
        raise ValueError("first line is not a moerun trace header (no 'moerun_trace' key)")
    if obj["moerun_trace"] != TRACE_VERSION:
        raise ValueError(f"trace version {obj['moerun_trace']!r} not supported (this moerun reads {TRACE_VERSION})")
    missing = [k for k in ("family", "n_layers", "n_experts", "k") if k not in obj]
    if missing:
        raise ValueError(f"header lacks {', '.join(missing)}")
    known = {"moerun_trace", "family", "n_layers", "n_experts", "k"}
    h = TraceHeader(str(obj["family"]), _int(obj["n_layers"], "n_layers"), _int(obj["n_experts"], "n_experts"),
                    _int(obj["k"], "k"), {k: v for k, v in obj.items() if k not in known})
    if min(h.n_layers, h.n_experts, h.k) < 1:
        raise ValueError("n_layers, n_experts and k must be positive")
    return h


def _parse_record(obj, h: TraceHeader) -> TraceRecord:
    if not isinstance(obj, dict):
        raise TypeError("record is not a JSON object")
    missing = [k for k in ("req", "pos", "phase", "layer", "experts", "weights") if k not in obj]
    if missing:
        raise ValueError(f"record lacks {', '.join(missing)}")
    req, phase = obj["req"], obj["phase"]
    if isinstance(req, bool) or not isinstance(req, (int, str)):
        raise TypeError(f"req must be a string or an integer, got {req!r}")
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    layer = _int(obj["layer"], "layer")
    if not 0 <= layer < h.n_layers:
        raise ValueError(f"layer {layer} out of range 0..{h.n_layers - 1}")
    experts, weights = obj["experts"], obj["weights"]
    if not isinstance(experts, list) or not isinstance(weights, list) or len(experts) != len(weights):
        raise ValueError("experts and weights must be lists of the same length")
    experts = tuple(_int(e, "expert id") for e in experts)
    if any(not 0 <= e < h.n_experts for e in experts):
        raise ValueError(f"expert id out of range 0..{h.n_experts - 1}: {list(experts)}")
    if len(set(experts)) != len(experts):
        raise ValueError(f"repeated expert id in {list(experts)}")
    if any(isinstance(w, bool) or not isinstance(w, (int, float)) for w in weights):
        raise ValueError(f"weights must be numbers, got {weights!r}")
    step = obj.get("step")
    return TraceRecord(req, _int(obj["pos"], "pos"), phase, layer, experts, tuple(float(w) for w in weights),
                       None if step is None else _int(step, "step"))


def read_trace(path: str | Path) -> Trace:
    """Read and validate a trace; raises TraceFormatError naming the first bad line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TraceFormatError(path, 0, f"cannot read trace: {e}") from e
    header, records = None, []
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
            if header is None:
                header = _parse_header(obj)
            else:
                records.append(_parse_record(obj, header))
        except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            msg = f"invalid JSON ({e.msg})" if isinstance(e, json.JSONDecodeError) else str(e)
            raise TraceFormatError(path, n, msg) from None
    if header is None:
        raise TraceFormatError(path, 1, "empty trace: no header line")
    return Trace(header, records)


# -- replay ------------------------------------------------------------------------------------
Step = tuple[str, tuple[int, ...]]  # (phase, distinct experts requested together)


def steps_by_layer(records: Iterable[TraceRecord], group: str = "token") -> dict[int, list[Step]]:
    """Cut each layer's records into cache steps: one per record ("token"), or consecutive
    records of one layer with the same non-None ``step`` merged into one ("batch")."""
    if group not in GROUPS:
        raise ValueError(f"group must be one of {GROUPS}, got {group!r}")
    out: dict[int, list[Step]] = {}
    last_step: dict[int, int | None] = {}
    for r in records:
        steps = out.setdefault(r.layer, [])
        if group == "batch" and r.step is not None and steps and last_step.get(r.layer) == r.step:
            phase, experts = steps[-1]
            steps[-1] = (phase, tuple(dict.fromkeys(experts + r.experts)))
        else:
            steps.append((r.phase, tuple(dict.fromkeys(r.experts))))
        last_step[r.layer] = r.step
    return out


class Belady:
    """Belady's optimal (MIN) for one layer: evict the candidate whose next use is farthest in
    the future (never used again = infinitely far; ties to the smallest id). Needs the whole
    step sequence; the replay sets ``now`` to the current step index before each step.

    It is the optimum (most hits) of any policy that loads every miss, as long as every step's
    distinct experts fit in the slots; with bypassed misses it is a heuristic."""

    name = "belady"

    def __init__(self, steps: Sequence[Sequence[int]]):
        self.now = 0
        self._uses: dict[int, list[int]] = {}
        for i, experts in enumerate(steps):
            for e in experts:
                self._uses.setdefault(e, []).append(i)

    def _next_use(self, key: int) -> float:
        uses = self._uses.get(key, [])
        j = bisect_right(uses, self.now)
        return uses[j] if j < len(uses) else float("inf")

    def on_hit(self, key: int) -> None:
        pass

    def on_insert(self, key: int, prefetched: bool = False) -> None:
        pass

    def on_evict(self, key: int) -> None:
        pass

    def victim(self, candidates: Iterable[int]) -> int:
        return max(candidates, key=lambda k: (self._next_use(k), -k))

    def reset(self) -> None:
        self.now = 0


def _replay(steps: list[Step], slots: int, policy: Policy, layer: int, stats: CacheStats) -> None:
    table = SlotTable(slots, policy)
    for i, (phase, experts) in enumerate(steps):
        if isinstance(policy, Belady):
            policy.now = i
        plan = table.request(experts)
        stats.record_step(layer, phase, hits=len(plan.hits), misses=plan.misses, evictions=plan.evictions)


def simulate(trace: Trace | Iterable[TraceRecord], slots: int, policy: str | Callable[[], Policy] = "lru",
             *, group: str = "token") -> CacheStats:
    """Replay ``trace`` against a cache of ``slots`` experts per layer, starting empty.

    ``policy``: "lru", "lfu", "lfru", "belady", or a factory returning a fresh Policy (one per
    layer). Returns CacheStats with queries, hits, misses and evictions per (layer, phase);
    ``.get()`` gives the totals, ``.hit_rate()`` the overall hit rate.
    """
    records = trace.records if isinstance(trace, Trace) else trace
    by_layer = steps_by_layer(records, group)
    if isinstance(policy, str) and policy.strip().lower() not in (*POLICIES, "belady"):
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join((*POLICIES, 'belady'))}")
    stats = CacheStats()
    for layer, steps in sorted(by_layer.items()):
        if isinstance(policy, str) and policy.strip().lower() == "belady":
            pol: Policy = Belady([experts for _, experts in steps])
        else:
            pol = make_policy(policy) if isinstance(policy, str) else policy()
        _replay(steps, slots, pol, layer, stats)
    return stats


def belady(trace: Trace | Iterable[TraceRecord], slots: int, *, group: str = "token") -> CacheStats:
    """The upper bound on hits: ``simulate`` with Belady's optimal policy."""
    return simulate(trace, slots, "belady", group=group)

