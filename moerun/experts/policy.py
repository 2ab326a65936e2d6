"""Eviction policies for an expert cache of fixed slots per layer, and the slot bookkeeping.

One policy instance serves one layer; keys are expert ids within that layer. A policy only
ranks experts: the cache (or `SlotTable`) decides when to ask it. The protocol:

- ``on_hit(key)``: the key was requested and was resident (an access).
- ``on_insert(key, prefetched=False)``: the key was loaded into a slot. A demand load (a miss)
  is an access; a prefetched load is not (it leaves the key's history untouched, so a wrong
  guess is the first to go), the access is counted when a step then hits it.
- ``on_evict(key)``: the key left its slot. The policies here keep their history anyway
  (LFU is "perfect" LFU: counts survive eviction), so this is informational.
- ``victim(candidates) -> key``: which of ``candidates`` to evict. Candidates are the resident
  experts that may go, i.e. resident minus the experts pinned by the current step.
- ``reset()``: forget all history.

Time is a per-policy logical clock that advances by one on every access (hit or demand insert),
so the experts of one step are ordered as they were requested.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

POLICIES = ("lru", "lfu", "lfru", "arc")


@runtime_checkable
class Policy(Protocol):
    name: str

    def on_hit(self, key: int) -> None: ...

    def on_insert(self, key: int, prefetched: bool = False) -> None: ...

    def on_evict(self, key: int) -> None: ...

    def victim(self, candidates: Iterable[int]) -> int: ...

    def reset(self) -> None: ...


def _nonempty(candidates: Iterable[int]) -> list[int]:
    cands = list(candidates)
    if not cands:
        raise ValueError("no eviction candidate: every resident expert is pinned")
    return cands


class LRU:
    """Least recently used: evict the candidate whose last access is oldest.

    A key never accessed (only prefetched) counts as older than every accessed key; ties among
    such keys go to the smallest id.
    """

    name = "lru"

    def __init__(self):
        self._clock = 0
        self._last: dict[int, int] = {}

    def _touch(self, key: int) -> None:
        self._clock += 1
        self._last[key] = self._clock

    def on_hit(self, key: int) -> None:
        self._touch(key)

    def on_insert(self, key: int, prefetched: bool = False) -> None:
        if not prefetched:
            self._touch(key)

    def on_evict(self, key: int) -> None:
        pass

    def victim(self, candidates: Iterable[int]) -> int:
        return min(_nonempty(candidates), key=lambda k: (self._last.get(k, 0), k))

    def reset(self) -> None:
        self._clock = 0
        self._last.clear()


class LFU(LRU):
    """Least frequently used ("perfect" LFU: counts are kept across evictions).

    Evict the candidate with the fewest accesses so far; ties go to the least recently used
    (then the smallest id).
    """

    name = "lfu"

    def __init__(self):
        super().__init__()
        self._count: dict[int, int] = {}

    def _touch(self, key: int) -> None:
        super()._touch(key)
        self._count[key] = self._count.get(key, 0) + 1

    def victim(self, candidates: Iterable[int]) -> int:
        return min(_nonempty(candidates),
                   key=lambda k: (self._count.get(k, 0), self._last.get(k, 0), k))

    def reset(self) -> None:
        super().reset()
        self._count.clear()


class LFRU(LRU):
    """LRU/LFU hybrid by decayed frequency (LRFU, Lee et al. 1999).

    Every access adds 1 to the key's score and every tick of the clock multiplies all scores by
    ``decay`` (0 < decay < 1). At clock t the score of a key accessed at times t1, t2, ... is
    ``sum(decay ** (t - ti))``. Evict the candidate with the lowest score; ties (for example
    keys never accessed, score 0) go to the least recently used, then the smallest id.

    decay <= 0.5 behaves exactly like LRU, decay -> 1 approaches LFU. The default 0.99
    (half-life ~69 accesses, ~9 steps of top-8 routing) keeps frequency over a few steps.
    """

    name = "lfru"

    def __init__(self, decay: float = 0.99):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"LFRU decay must be in (0, 1), got {decay}")
        super().__init__()
        self.decay = decay
        self._score: dict[int, float] = {}  # score as of the key's last access time

    def _touch(self, key: int) -> None:
        self._clock += 1
        self._score[key] = self.score(key) + 1.0
        self._last[key] = self._clock

    def score(self, key: int) -> float:
        """The key's decayed score at the current clock."""
        if key not in self._score:
            return 0.0
        return self._score[key] * self.decay ** (self._clock - self._last[key])

    def victim(self, candidates: Iterable[int]) -> int:
        return min(_nonempty(candidates), key=lambda k: (self.score(k), self._last.get(k, 0), k))

    def reset(self) -> None:
        super().reset()
        self._score.clear()


class ARC(LRU):
    """Adaptive replacement (Megiddo and Modha, 2003) over one layer's slots: residents seen once since they came in
    (T1) and seen again (T2), and ghosts of the evicted of each (B1, B2). A demand load of a B1 ghost says T1 was
    too small and raises its target size p, one of a B2 ghost lowers it; the victim is T1's least recently used
    while T1 is over p, else T2's. It adapts between recency (LRU) and repetition without a parameter; the
    capacity is the number of residents, which the slot table keeps full."""

    name = "arc"

    def __init__(self):
        super().__init__()
        self.p = 0.0
        self._t2: set[int] = set()
        self._resident: set[int] = set()
        self._b1: dict[int, None] = {}  # insertion-ordered: the oldest ghost first
        self._b2: dict[int, None] = {}

    def on_hit(self, key: int) -> None:
        super().on_hit(key)
        self._t2.add(key)

    def on_insert(self, key: int, prefetched: bool = False) -> None:
        c = len(self._resident) + 1
        if key in self._b1:
            self.p = min(float(c), self.p + max(1.0, len(self._b2) / max(1, len(self._b1))))
            del self._b1[key]
            self._t2.add(key)
        elif key in self._b2:
            self.p = max(0.0, self.p - max(1.0, len(self._b1) / max(1, len(self._b2))))
            del self._b2[key]
            self._t2.add(key)
        else:
            self._t2.discard(key)
        self._resident.add(key)
        super().on_insert(key, prefetched)

    def on_evict(self, key: int) -> None:
        self._resident.discard(key)
        ghosts = self._b2 if key in self._t2 else self._b1
        self._t2.discard(key)
        ghosts[key] = None
        for g in (self._b1, self._b2):
            while len(g) > max(1, len(self._resident) + 1):
                del g[next(iter(g))]

    def victim(self, candidates: Iterable[int]) -> int:
        cands = _nonempty(candidates)
        once = [k for k in cands if k not in self._t2]
        again = [k for k in cands if k in self._t2]
        t1_size = sum(k not in self._t2 for k in self._resident)
        pool = once if once and (t1_size > self.p or not again) else again
        return min(pool, key=lambda k: (self._last.get(k, 0), k))

    def reset(self) -> None:
        super().reset()
        self.p = 0.0
        for x in (self._t2, self._resident, self._b1, self._b2):
            x.clear()


def make_policy(name: str, **kwargs) -> Policy:
    """A new policy by name: "lru", "lfu", "lfru" or "arc" (kwargs go to the class, e.g. decay=0.9)."""
    classes = {"lru": LRU, "lfu": LFU, "lfru": LFRU, "arc": ARC}
    cls = classes.get(name.strip().lower()) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown expert cache policy {name!r}; choose one of {', '.join(POLICIES)}")
    return cls(**kwargs)


class Load(NamedTuple):
    """One copy to make: ``expert`` goes into ``slot``, replacing ``evicted`` (None: slot was free)."""

    expert: int
    slot: int
    evicted: int | None


@dataclass(frozen=True)
class StepPlan:
    """What one step at one layer needs: hits (already resident), loads in order, and bypassed
    misses (more distinct experts than slots: no unpinned slot left, serve them from home)."""

    hits: tuple[int, ...]
    loads: tuple[Load, ...]
    bypassed: tuple[int, ...]

    @property
    def misses(self) -> int:
        return len(self.loads) + len(self.bypassed)

    @property
    def evictions(self) -> int:
        return sum(load.evicted is not None for load in self.loads)


class SlotTable:
    """Which expert sits in which of one layer's ``slots`` slots, driven by a policy. No tensors.

    ``request(experts)`` handles one step: duplicates are merged (queries count distinct
    experts), every expert of the step is pinned until the step ends, misses take a free slot
    or evict the policy's victim among the unpinned residents. The cache copies the returned
    loads and reads hits from ``slot_of(expert)``.
    """

    def __init__(self, slots: int, policy: Policy | str = "lru"):
        if slots < 1:
            raise ValueError(f"an expert cache needs at least one slot, got {slots}")
        self.slots = slots
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self._slot_of: dict[int, int] = {}
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first

    def slot_of(self, expert: int) -> int | None:
        return self._slot_of.get(expert)

    @property
    def resident(self) -> dict[int, int]:
        """expert -> slot, a copy."""
        return dict(self._slot_of)

    def _place(self, expert: int, pinned: Collection[int], prefetched: bool) -> Load | None:
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            cands = [e for e in self._slot_of if e not in pinned]
            if not cands:
                return None
            evicted = self.policy.victim(cands)
            slot = self._slot_of.pop(evicted)
            self.policy.on_evict(evicted)
        self._slot_of[expert] = slot
        self.policy.on_insert(expert, prefetched=prefetched)
        return Load(expert, slot, evicted)

    def request(self, experts: Sequence[int], bypass_misses: bool = False,
                admit: Callable[[int], bool] | None = None) -> StepPlan:
        """One step's experts. With ``bypass_misses`` (e.g. a prefill that must not evict the decode
        working set) residents still hit, but misses are served from the home tier without a load; ``admit``
        (expert -> bool) bypasses the misses it refuses in the same way (a miss the cost model computes at
        home)."""
        step = tuple(dict.fromkeys(int(e) for e in experts))
        pinned = set(step)
        hits, loads, bypassed = [], [], []
        for e in step:
            if e in self._slot_of:
                self.policy.on_hit(e)
                hits.append(e)
            else:
                refused = bypass_misses or (admit is not None and not admit(e))
                load = None if refused else self._place(e, pinned, prefetched=False)
                if load is None:
                    bypassed.append(e)
                else:
                    loads.append(load)
        return StepPlan(tuple(hits), tuple(loads), tuple(bypassed))

    def prefetch(self, expert: int, pinned: Collection[int] = ()) -> Load | None:
        """Load ``expert`` ahead of need (not an access). None if already resident or no slot is
        free of ``pinned`` (experts a copy or compute is still using)."""
        if expert in self._slot_of:
            return None
        return self._place(int(expert), pinned, prefetched=True)

    def reset(self) -> None:
        self.policy.reset()
        self._slot_of.clear()
        self._free = list(range(self.slots - 1, -1, -1))
