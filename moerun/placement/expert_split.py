"""Which rank owns which routed expert under expert parallelism (DESIGN decision 16): pure, no tensors.

Every MoE layer's experts are split over `ranks`: by default in contiguous balanced ranges (expert e of E goes
to rank e * N // E, so the ranges differ by one expert at most), or as a file says (an assignment from a
routing trace that balances the expected load). A split file is JSON:

    {"expert_parallel": N, "n_experts": E, "layers": {"<layer>": [rank of expert 0, rank of expert 1, ...]}}

Layers the file leaves out are split in ranges. `balanced` makes such a split from per-expert loads (e.g. a
trace's routed-token counts): heaviest expert first, to the least loaded rank that still has room, every rank
holding the same number of experts (give or take one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moerun.errors import MoerunError


class SplitError(MoerunError):
    """An expert split file that cannot be read, or does not fit the model or the number of ranks."""


@dataclass(frozen=True)
class ExpertSplit:
    """ranks: how many ranks share each layer's experts; owner: MoE layer -> the rank of each expert, by id."""

    ranks: int
    owner: dict[int, tuple[int, ...]]

    @classmethod
    def ranges(cls, ranks: int, n_experts: int, layers: list[int]) -> ExpertSplit:
        """Contiguous ranges: expert e to rank e * ranks // n_experts."""
        check_ranks(ranks, n_experts)
        row = tuple(e * ranks // n_experts for e in range(n_experts))
        return cls(ranks, dict.fromkeys(layers, row))

    def owned(self, rank: int, layer: int) -> list[int]:
        """The experts of `layer` that `rank` computes, ascending."""
        return [e for e, r in enumerate(self.owner[layer]) if r == rank]

    def shard(self, rank: int) -> dict[int, list[int]]:
        """Layer -> the experts `rank` owns, for every MoE layer."""
        return {layer: self.owned(rank, layer) for layer in self.owner}

    def to_json(self) -> dict:
        n = len(next(iter(self.owner.values()), ()))
        return {"expert_parallel": self.ranks, "n_experts": n,
                "layers": {str(layer): list(row) for layer, row in sorted(self.owner.items())}}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()) + "\n")


def check_ranks(ranks: int, n_experts: int) -> None:
    if not 1 <= ranks <= n_experts:
        raise SplitError(f"expert parallelism over {ranks} ranks needs 1..{n_experts} ranks (the model has "
                         f"{n_experts} routed experts per layer)")


def read_split(path: str | Path, ranks: int, n_experts: int, layers: list[int]) -> ExpertSplit:
    """A split file for `ranks` ranks over a model's MoE `layers` of n_experts each; layers it leaves out are
    split in ranges. Anything that does not fit is one SplitError line naming the file."""
    check_ranks(ranks, n_experts)
    try:
        raw = json.loads(Path(path).read_text())
        given = {int(k): tuple(v) for k, v in raw["layers"].items()}
        n = int(raw["expert_parallel"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SplitError(f"{path}: not an expert split file ({type(e).__name__}: {e})") from None
    if n != ranks:
        raise SplitError(f"{path}: splits the experts over {n} ranks, not {ranks}")
    extra = sorted(set(given) - set(layers))
    if extra:
        raise SplitError(f"{path}: layers {extra} have no routed experts in this model")
    for layer, row in given.items():
        if len(row) != n_experts or not all(isinstance(r, int) and 0 <= r < ranks for r in row):
            raise SplitError(f"{path}: layer {layer} needs a rank in 0..{ranks - 1} for each of its {n_experts} "
                             "experts")
        idle = sorted(set(range(ranks)) - set(row))
        if idle:
            raise SplitError(f"{path}: layer {layer} gives rank {idle[0]} no expert (every rank needs one)")
    default = ExpertSplit.ranges(ranks, n_experts, layers).owner
    return ExpertSplit(ranks, {layer: given.get(layer, default[layer]) for layer in layers})


def balanced(loads: dict[int, list[float]], ranks: int) -> ExpertSplit:
    """A split whose ranks expect equal work: per layer, experts by load (heaviest first, ties by id) each to the
    rank with the least load so far among those holding fewer than ceil(E / ranks) experts (ties: the one holding
    fewest, then the lowest rank), so every rank holds at least one. Loads are >= 0."""
    owner = {}
    for layer, load in loads.items():
        n = len(load)
        check_ranks(ranks, n)
        room, held, total, row = -(-n // ranks), [0] * ranks, [0.0] * ranks, [0] * n
        for e in sorted(range(n), key=lambda e: (-load[e], e)):
            r = min((r for r in range(ranks) if held[r] < room), key=lambda r: (total[r], held[r], r))
            row[e], held[r], total[r] = r, held[r] + 1, total[r] + load[e]
        owner[layer] = tuple(row)
    return ExpertSplit(ranks, owner)
