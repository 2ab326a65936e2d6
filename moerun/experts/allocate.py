"""Expert-cache slots per layer from a routing trace: layers differ in how much a slot is worth, so the same
total spread evenly wastes slots (issue 19).

    curves = hit_curves(trace, max_slots=64)             # per layer: hits with 0..64 slots (replayed, any policy)
    plan = allocate(curves, total=256)                  # the most hits for 256 slots in all (exact)
    uniform(curves.keys(), 256)                         # the same total, evenly

`allocate` maximises the sum of the layers' hits exactly (a max-plus dynamic programme over the layers), so it
holds for curves that are not concave (LRU's need not be), where a greedy pick of marginal gains can miss.
A plan is a JSON object {"slots": {layer: slots}, ...} (`write_plan` / `read_plan`): `moerun trace simulate
--write-plan FILE` writes one, `--expert-cache-plan FILE` runs with it. `--expert-cache-trace FILE` computes
one at start (`plan_from_trace`): the slots a cache size gives, re-shared over the layers by the trace's curves.
Both go through `guarded_allocate`: an exact fit to one trace is kept only where it generalises across the
trace's two halves, since on layers that are alike it fits noise and loses to the even spread on other text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from moerun.errors import MoerunError
from moerun.experts.trace import Trace, TraceRecord, read_trace, simulate


class PlanError(MoerunError):
    """A cache plan file that cannot be read or does not fit the model."""


def hit_curves(trace: Trace | Iterable[TraceRecord], max_slots: int, policy: str = "lru",
               group: str = "token") -> dict[int, list[int]]:
    """Per layer, the hits a cache of s slots (s = 0..max_slots) gets replaying the trace with `policy`."""
    records = list(trace.records if isinstance(trace, Trace) else trace)
    layers = sorted({r.layer for r in records})
    curves = {layer: [0] for layer in layers}
    for s in range(1, max_slots + 1):
        stats = simulate(records, s, policy, group=group)
        for layer in layers:
            curves[layer].append(stats.get(layer=layer).hits)
    return curves


def allocate(curves: dict[int, list[int]], total: int, min_slots: int = 0) -> dict[int, int]:
    """Slots per layer summing to at most `total` (each layer min_slots..len(curve) - 1) with the most hits."""
    layers = sorted(curves)
    if total < min_slots * len(layers):
        raise ValueError(f"{total} slots cannot give {len(layers)} layers {min_slots} each")
    neg = -(1 << 62)
    best = np.full(total + 1, neg, dtype=np.int64)
    best[0] = 0
    choice = []
    for layer in layers:
        h = np.asarray(curves[layer], dtype=np.int64)
        s = np.arange(len(h))
        h = np.where(s >= min_slots, h, neg)
        t = np.arange(total + 1)
        # new[t] = max over s <= t of best[t - s] + h[s]
        prev = np.where(t[:, None] - s[None, :] >= 0, best[np.clip(t[:, None] - s[None, :], 0, total)], neg)
        cand = prev + h[None, :]
        pick = cand.argmax(axis=1)
        best = cand[t, pick]
        choice.append(pick)
    t = int(best.argmax())
    out = {}
    for layer, pick in zip(reversed(layers), reversed(choice)):
        out[layer] = int(pick[t])
        t -= out[layer]
    return dict(sorted(out.items()))


def floor_slots(total: int, n_layers: int, k: int) -> int:
    """The fewest slots a layer is given: the k experts one token picks while the total affords them. Below k
    the live cache pins a step's experts and computes the rest at home, so a replay there is optimistic."""
    return min(k, total // max(1, n_layers))


def uniform(layers: Iterable[int], total: int) -> dict[int, int]:
    """`total` slots spread evenly (the first layers take the remainder)."""
    layers = sorted(layers)
    each, extra = divmod(total, len(layers))
    return {layer: each + (i < extra) for i, layer in enumerate(layers)}


def hits_of(curves: dict[int, list[int]], plan: dict[int, int]) -> int:
    return sum(curves[layer][min(s, len(curves[layer]) - 1)] for layer, s in plan.items())


def write_plan(path: Path, plan: dict[int, int], **about) -> None:
    path.write_text(json.dumps({"slots": {str(k): v for k, v in plan.items()}, **about}, indent=2) + "\n")


def read_plan(path: Path) -> dict[int, int]:
    try:
        obj = json.loads(Path(path).read_text())
        slots = obj["slots"]
        plan = {int(k): int(v) for k, v in slots.items()}
    except FileNotFoundError:
        raise PlanError(f"{path}: no such cache plan file") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise PlanError(f"{path}: not a cache plan ({{\"slots\": {{layer: slots}}}}): {e}") from None
    if any(v < 0 for v in plan.values()):
        raise PlanError(f"{path}: slot counts must be >= 0")
    return plan


def guarded_allocate(records: list[TraceRecord], total: int, max_slots: int, min_slots: int = 0,
                     policy: str = "lru", group: str = "token") -> tuple[dict[int, int], int]:
    """The exact allocation for the records' curves, kept only where it generalises: the requests are split in
    two halves (by id parity; a single request by time), each half's allocation is scored on the other half
    against the even spread, and unless both halves gain the even spread is returned instead. -> (plan, the
    cross-validated gain in hits when kept, else the worse half's; 0 when it cannot be measured)."""
    ids = sorted({r.request_id for r in records})
    if len(ids) > 1:
        halves = [[r for r in records if ids.index(r.request_id) % 2 == h] for h in (0, 1)]
    else:
        cut = len(records) // 2
        halves = [records[:cut], records[cut:]]
    top = min(total, max_slots)
    curves = hit_curves(records, top, policy, group)
    even = uniform(curves, total)
    if not all(halves):
        return even, 0
    half = [hit_curves(h, top, policy, group) for h in halves]
    gains = []
    for h in (0, 1):
        if set(half[h]) != set(curves):
            return even, 0  # a layer one half never routes: no honest score
        fit = allocate(half[1 - h], total, min_slots)
        gains.append(hits_of(half[h], fit) - hits_of(half[h], uniform(half[h], total)))
    keep = min(gains) > 0  # both halves gain: a fit to the other half's noise rarely helps both
    return (allocate(curves, total, min_slots) if keep else even), sum(gains) if keep else min(gains)


def plan_from_trace(trace: Trace | str | Path, slots: dict[int, int], n_experts: int, policy: str = "lru",
                    groups: Iterable[Iterable[int]] | None = None, prefill: bool = False) -> dict[int, int]:
    """`slots` re-shared for the most hits on a trace's decode steps (and its prompts', with `prefill`: a cache
    that pages prefill misses in). Each group of layers (a stage's, so every device keeps its budget) shares
    its own total; layers without slots or without steps in the trace keep theirs."""
    name = "the trace" if isinstance(trace, Trace) else str(trace)
    if not isinstance(trace, Trace):
        trace = read_trace(trace)
    if trace.header.n_experts != n_experts:
        raise PlanError(f"{name}: a trace of a model with {trace.header.n_experts} experts per layer, "
                        f"this one has {n_experts}")
    records = [r for r in trace.records if prefill or r.phase == "decode"]
    covered = {r.layer for r in records}
    out = dict(slots)
    for group in [sorted(slots)] if groups is None else groups:
        layers = [layer for layer in group if slots.get(layer, 0) > 0 and layer in covered]
        total = sum(slots[layer] for layer in layers)
        if not layers:
            continue
        mine = [r for r in records if r.layer in set(layers)]
        plan, _ = guarded_allocate(mine, total, n_experts, floor_slots(total, len(layers), trace.header.k), policy)
        spare = total - sum(plan.values())  # slots the trace finds no use for still cost nothing: spread them
        while spare > 0 and any(plan[layer] < n_experts for layer in layers):
            for layer in sorted(layers, key=lambda x: plan[x]):
                if spare > 0 and plan[layer] < n_experts:
                    plan[layer] += 1
                    spare -= 1
        out.update(plan)
    return out
