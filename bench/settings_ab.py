"""Kernel settings against each other in one process, whole decode steps, the read probe beside each round (issue 36).

    python bench/settings_ab.py MODEL.gguf [-t 2] [--steps 16] [--rounds 8] [--prompt 64]
        [--settings "none=pf:0,hint:t1,wide:0" "nta4k=pf:4096,hint:nta,wide:0" ...]

Fresh processes started seconds apart cannot separate a few percent on a shared machine whose memory reads 50 or
85 GB/s by the minute; here one loaded model runs every setting in each round, in an order rotated each round, so
the settings meet the same moments. A setting is NAME=KEY:VALUE,...: `pf` the prefetch distance in bytes
(cpu.set_prefetch), `hint` t0 / t1 / t2 / nta (cpu.set_prefetch_hint), `wide` 0 / 1 or row types joined by +, such
as q6_k or q4_k+mxfp4 (cpu.set_wide: one token through those types on 512-bit vectors), `spread` 0 / 1
(cpu.set_prefetch_spread: a block's prefetches beside its loads), `idle` bytes (cpu.set_idle_prefetch: how much of
its next share a thread done with its share of a pool job prefetches while it waits), `near` bytes
(cpu.set_prefetch_near: a second prefetch into L1, that far ahead); a key left out keeps the CPU's default. Each
setting's turn in a round: two warm-up steps, then `--steps` whole steps (`model.decode`, the fused path from token
ids to logits), the cache wound back after each turn.
The first setting is the baseline: per round, each other setting's median step time over the baseline's (below 1:
faster). Rounds are classed by the probe before them (fast: above `--fast` GB/s) and the ratios given for each class.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests load this file by its path
from toolkit import add, cpu_model, md_table, parser

KEYS = ("pf", "hint", "wide", "spread", "idle", "near")
DEFAULT_SETTINGS = ("default=", "none=pf:0,wide:0", "nta4k=pf:4096,hint:nta", "wide=wide:1")


def parse_setting(text: str) -> tuple[str, dict[str, str]]:
    """'NAME=KEY:VALUE,...' -> (NAME, {key: value}); a clear error for anything else."""
    name, eq, rest = text.partition("=")
    if not eq or not name.strip():
        raise SystemExit(f"setting {text!r}: expected NAME=KEY:VALUE,... (keys {', '.join(KEYS)})")
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, colon, value = part.partition(":")
        if not colon or key not in KEYS or not value:
            raise SystemExit(f"setting {text!r}: {part!r} is not KEY:VALUE with KEY one of {', '.join(KEYS)}")
        out[key] = value.strip().lower()
    return name.strip(), out


def wide_value(text: str) -> bool | list[str]:
    """`wide`'s value: 0 / 1 (none, all), or row types joined by + (q6_k, q4_k+mxfp4)."""
    return bool(int(text)) if text in ("0", "1") else text.split("+")


def apply(cpu, setting: dict[str, str]) -> None:
    """Each key's value, or the CPU's default where the setting leaves it out."""
    try:
        cpu.set_prefetch(int(setting["pf"]) if "pf" in setting else None)
        cpu.set_prefetch_hint(setting.get("hint"))
        cpu.set_wide(wide_value(setting["wide"]) if "wide" in setting else None)
        cpu.set_prefetch_spread(bool(int(setting["spread"])) if "spread" in setting else None)
        cpu.set_idle_prefetch(int(setting["idle"]) if "idle" in setting else None)
        cpu.set_prefetch_near(int(setting["near"]) if "near" in setting else None)
    except ValueError as e:
        raise SystemExit(f"setting {setting}: {e}") from None


def as_setting(features: dict) -> dict[str, str]:
    """cpu.features()'s kernel settings as a setting for apply: to put them back after a run."""
    return {"pf": str(features["prefetch"]), "hint": features["prefetch_hint"],
            "wide": "+".join(features["wide"]) or "0", "spread": str(int(features["prefetch_spread"])),
            "idle": str(features["idle_prefetch"]), "near": str(features["prefetch_near"])}


def main(argv: list[str] | None = None) -> None:
    ap = add(parser(__doc__, "all"), "model", "threads")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--fast", type=float, default=68.0, help="probe GB/s above which a round counts as fast memory")
    ap.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS))
    args = ap.parse_args(argv)
    settings = [parse_setting(s) for s in args.settings]

    import torch

    from moerun.engine.kv_cache import KVPool, SeqKV
    from moerun.kernels import cpu
    from moerun.loading import load_model
    from moerun.model.ops import thread_budget
    from moerun.placement.bandwidth import measure_host_read_bandwidth

    model = load_model(args.model).model
    s = model.spec
    was = cpu.features()  # put back afterwards (the environment's MOERUN_PREFETCH* included)
    g = torch.Generator().manual_seed(0)
    rows = []  # (probe GB/s, {name: median step s})
    with thread_budget(args.threads), torch.inference_mode():
        pool = KVPool(s, args.prompt + args.steps + 16)
        kv = SeqKV(pool, args.prompt + args.steps + 8)
        prompt = torch.randint(0, s.vocab, (args.prompt,), generator=g)
        for chunk in prompt.split(16):
            model.forward(chunk, kv)
        start, tok = kv.length, int(prompt[-1])
        for r in range(args.rounds):
            probe = measure_host_read_bandwidth(args.threads, runs=1)["gbps"]
            order = settings[r % len(settings):] + settings[:r % len(settings)]
            got = {}
            for name, setting in order:
                apply(cpu, setting)
                times = []
                for i in range(args.steps + 2):
                    t0 = time.perf_counter()
                    logits = model.decode(torch.tensor([tok]), [kv])
                    if i >= 2:
                        times.append(time.perf_counter() - t0)
                    tok = int(logits[-1].argmax())
                kv.length = start
                got[name] = statistics.median(times)
            rows.append((probe, got))
            print(f"round {r + 1}: probe {probe:.1f} GB/s; " + ", ".join(
                f"{n} {got[n] * 1e3:.2f} ms" for n, _ in settings), flush=True)
    apply(cpu, as_setting(was))
    base = settings[0][0]
    print(f"\n{args.model}: {s.family}, {s.n_layers} layers; {cpu_model()}, {args.threads} threads; "
          f"{args.rounds} rounds of {args.steps} steps, baseline {base}")
    body = []
    for name, setting in settings:
        cells = [name, ",".join(f"{k}:{v}" for k, v in setting.items()) or "the CPU's defaults"]
        for label, keep in (("all", lambda p: True), ("fast", lambda p: p > args.fast),
                            ("slow", lambda p: p <= args.fast)):
            sel = [got for p, got in rows if keep(p)]
            if not sel:
                cells.append("-")
                continue
            ms = statistics.median(got[name] for got in sel) * 1e3
            ratio = statistics.median(got[name] / got[base] for got in sel)
            cells.append(f"{ms:.2f} ms, {ratio:.3f} ({len(sel)})")
        body.append(cells)
    print(md_table(["setting", "values", "all rounds: step, / baseline (rounds)", "fast memory", "slow memory"], body))


if __name__ == "__main__":
    main()
