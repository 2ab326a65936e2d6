"""`moerun trace ...`: offline analysis of routing traces (replay against cache policies; split the experts over
ranks for expert parallelism by the load the trace shows)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from moerun.errors import MoerunError
from moerun.experts.policy import POLICIES
from moerun.experts.trace import GROUPS, Trace, read_trace, simulate

ALL_POLICIES = (*POLICIES, "belady")


def _split(value: str, what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise click.BadParameter(f"empty {what} list")
    return items


def _parse_slots(ctx, param, value: str) -> list[int]:
    try:
        slots = [int(v) for v in _split(value, "slots")]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers") from None
    if any(s < 1 for s in slots):
        raise click.BadParameter("every cache size must be at least 1 slot")
    return sorted(dict.fromkeys(slots))


def _parse_policies(ctx, param, value: str) -> list[str]:
    policies = [p.lower() for p in _split(value, "policy")]
    unknown = [p for p in policies if p not in ALL_POLICIES]
    if unknown:
        raise click.BadParameter(f"unknown policy {', '.join(unknown)}; choose from {', '.join(ALL_POLICIES)}")
    return list(dict.fromkeys(policies))


def _table(results: dict[str, dict[int, float | None]], slots: list[int]) -> str:
    head = ["policy", *(f"{s} slots" for s in slots)]
    rows = [[p, *("n/a" if r[s] is None else f"{100 * r[s]:.1f}%" for s in slots)] for p, r in results.items()]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    rule = "|" + "|".join(("-" * (w + 2)) if i == 0 else ("-" * (w + 1) + ":") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(head), rule, *(line(r) for r in rows)])


def _plot(path: Path, results: dict[str, dict[int, float | None]], slots: list[int], tr: Trace) -> None:
    try:
        import matplotlib
    except ImportError:
        raise MoerunError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    try:
        for p, r in results.items():
            xs = [s for s in slots if r[s] is not None]
            ax.plot(xs, [100 * r[s] for s in xs], marker="o", label=p, linestyle="--" if p == "belady" else "-")
        h = tr.header
        ax.set_title(f"{h.family}: {h.n_experts} experts, top-{h.k}, {h.n_layers} layers")
        ax.set_xlabel("cache slots per layer")
        ax.set_ylabel("hit rate (%)")
        ax.set_ylim(0, 100)
        if len(slots) > 1 and slots[-1] / slots[0] >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(slots, [str(s) for s in slots])
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)


@click.group()
def trace():
    """Routing traces: replay them against expert-cache policies."""


@trace.command("simulate")
@click.argument("file", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("--slots", default="4,8,16", show_default=True, callback=_parse_slots,
              help="Cache sizes (experts per layer), comma-separated.")
@click.option("--policy", "policies", default=",".join(ALL_POLICIES), show_default=True,
              callback=_parse_policies, help=f"Policies, comma-separated: {', '.join(ALL_POLICIES)}.")
@click.option("--group", type=click.Choice(GROUPS), default="token", show_default=True,
              help="A cache step is one token's experts, or one batch step's (records sharing 'step').")
@click.option("--plot", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Write a PNG of hit rate against cache size per policy.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--total-slots", type=click.IntRange(min=1), default=None,
              help="Share this many slots in all over the layers (--allocate) instead of --slots per layer.")
@click.option("--allocate", type=click.Choice(["uniform", "trace"]), default="trace", show_default=True,
              help="With --total-slots: evenly, or the most hits for the trace (each layer's curve, exactly).")
@click.option("--write-plan", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="With --total-slots: write the allocation for --expert-cache-plan.")
def simulate_cmd(file: Path, slots: list[int], policies: list[str], group: str, plot: Path | None, as_json: bool,
                 total_slots: int | None, allocate: str, write_plan: Path | None):
    """Replay the routing trace FILE against each policy and cache size; print the hit rates."""
    tr = read_trace(file)
    if total_slots is not None:
        _allocate(file, tr, total_slots, allocate, policies[0] if policies[0] != "belady" else "lru", group,
                  write_plan, as_json)
        return
    if write_plan is not None:
        raise click.UsageError("--write-plan needs --total-slots")
    results: dict[str, dict[int, float | None]] = {p: {} for p in policies}
    rows = []
    for p, s in ((p, s) for p in policies for s in slots):
        stats = simulate(tr, s, p, group=group)
        results[p][s] = stats.hit_rate()
        tot = stats.totals()
        rows.append({"policy": p, "slots": s, **{k: getattr(tot["all"], k) for k in
                                                  ("queries", "hits", "misses", "evictions")},
                     "hit_rate": tot["all"].hit_rate, "prefill_hit_rate": tot["prefill"].hit_rate,
                     "decode_hit_rate": tot["decode"].hit_rate})
    if plot is not None:
        _plot(plot, results, slots, tr)
    h = tr.header
    if as_json:
        click.echo(json.dumps({"trace": {"path": str(file), **h.to_json(), "records": len(tr.records)},
                               "group": group, "results": rows, "plot": None if plot is None else str(plot)},
                              indent=2))
        return
    click.echo(f"trace {file}: {h.family}, {h.n_layers} layers, {h.n_experts} experts, top-{h.k}, "
               f"{len(tr.records)} records, one step per {group}")
    click.echo("")
    click.echo(_table(results, slots))
    if plot is not None:
        click.echo(f"\nplot written to {plot}")


def _allocate(file: Path, tr: Trace, total: int, how: str, policy: str, group: str, write: Path | None,
              as_json: bool) -> None:
    """`--total-slots`: the uniform and the chosen allocation side by side, replayed; the chosen one written."""
    from moerun.experts.allocate import (
        floor_slots,
        guarded_allocate,
        hit_curves,
        hits_of,
        uniform,
        write_plan,
    )

    n = tr.header.n_experts
    curves = hit_curves(tr, min(total, n), policy, group)
    queries = simulate(tr, 1, policy, group=group).get().queries or 1
    plans = {"uniform": uniform(curves, total)}
    plans["uniform"] = {layer: min(s, n) for layer, s in plans["uniform"].items()}
    cv_gain = None
    if how == "trace":  # every layer keeps k slots when the total allows; kept only if it holds across halves
        plans["trace"], cv_gain = guarded_allocate(list(tr.records), total, n,
                                                   floor_slots(total, len(curves), tr.header.k), policy, group)
    chosen = plans[how]
    rates = {name: hits_of(curves, p) / queries for name, p in plans.items()}
    if write is not None:
        write_plan(write, chosen, trace=str(file), policy=policy, total_slots=total, allocate=how,
                   hit_rate=rates[how])
    if as_json:
        click.echo(json.dumps({"trace": str(file), "policy": policy, "total_slots": total, "allocate": how,
                               "plans": {k: {"slots": v, "hit_rate": rates[k]} for k, v in plans.items()},
                               "cross_validated_gain": cv_gain,
                               "plan_file": None if write is None else str(write)}, indent=2))
        return
    click.echo(f"trace {file}: {len(curves)} layers, {n} experts, {policy}, {total} slots in all")
    for name, p in plans.items():
        click.echo(f"{name:8s} hit rate {100 * rates[name]:.1f}%  slots per layer: "
                   + " ".join(f"{layer}:{s}" for layer, s in p.items()))
    if cv_gain is not None:
        click.echo(f"cross-validated gain over uniform (each half's allocation on the other half): {cv_gain} hits"
                   + ("" if cv_gain > 0 else "; no gain, so the trace allocation is the uniform one"))
    if write is not None:
        click.echo(f"plan written to {write} (run with --expert-cache-plan {write})")


def split_loads(tr: Trace, phase: str) -> dict[int, list[float]]:
    """Layer -> routed (token, choice) pairs per expert in the trace's `phase` records ("all": every record)."""
    loads: dict[int, list[float]] = {}
    for rec in tr.records:
        if phase == "all" or rec.phase == phase:
            row = loads.setdefault(rec.layer, [0.0] * tr.header.n_experts)
            for e in rec.experts:
                row[e] += 1
    return loads


def _busiest(split, loads: dict[int, list[float]]) -> float:
    """The busiest rank's share of each layer's pairs, averaged over layers (1/N: even)."""
    shares = []
    for layer, load in loads.items():
        total = sum(load) or 1.0
        shares.append(max(sum(load[e] for e in split.owned(r, layer)) for r in range(split.ranks)) / total)
    return sum(shares) / max(1, len(shares))


@trace.command("split")
@click.argument("file", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("--expert-parallel", "ranks", type=click.IntRange(min=2), required=True,
              help="Ranks to split each layer's experts over.")
@click.option("--phase", type=click.Choice(["decode", "prefill", "all"]), default="decode", show_default=True,
              help="Which records' routing to balance.")
@click.option("-o", "--output", type=click.Path(path_type=Path, dir_okay=False), required=True,
              help="The split file to write (run with --expert-split FILE).")
def split_cmd(file: Path, ranks: int, phase: str, output: Path) -> None:
    """Split every layer's experts over ranks so that each expects the same share of FILE's routed pairs (each
    rank holding as many experts, give or take one), for --expert-parallel N --expert-split OUTPUT."""
    from moerun.placement.expert_split import ExpertSplit, balanced

    tr = read_trace(file)
    loads = split_loads(tr, phase)
    if not loads:
        raise MoerunError(f"{file}: no {phase} records to balance")
    split = balanced(loads, ranks)
    split.write(output)
    ranges = ExpertSplit.ranges(ranks, tr.header.n_experts, sorted(loads))
    click.echo(f"trace {file}: {len(loads)} layers, {tr.header.n_experts} experts, {phase} records; the busiest of "
               f"{ranks} ranks computes {_busiest(split, loads):.1%} of a layer's pairs on average "
               f"(contiguous ranges: {_busiest(ranges, loads):.1%}; even: {1 / ranks:.1%})")
    click.echo(f"split written to {output} (run with --expert-parallel {ranks} --expert-split {output})")

