"""Routing traces of a trained MoE (the routing bench model, issue 19) and their statistics beside the published
figures of real models: reuse distance, repeats at the next token and within 8, each layer's working set over 300
tokens, LRU hit rate against cache size; then per-layer slot allocation from one text's trace evaluated on
another's. Writes traces, a plot and (with --append) a section of bench/RESULTS.md.

    python -m moerun.tools.train_default --shape routing --steps 2400 --aux-coef 0.001 --threads 2 \\
        --out ~/.cache/moerun/routing/hf --gguf ~/.cache/moerun/routing/routing-qwen3moe.gguf
    python bench/routing_traces.py ~/.cache/moerun/routing/routing-qwen3moe.gguf [--append]

Texts: held out from training, in turn: standard-library files of the trainer's validation split (every 40th
file), English prose (installed packages' descriptions) and other packages' code; A and B alternate.
Each text is prefilled, then 300 tokens are generated greedily and sampled (temperature 0.8), one request
each; decode steps are the trace (prefill's routing is recorded but the statistics are of decode, as the
published ones are).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from toolkit import add, moerun_commit, parser, publish

HERE = Path(__file__).resolve().parent
PUBLISHED = ("Qwen3-30B-A3B (128 experts, top-8): median reuse distance ~2 tokens, 45% of a token's choices repeat "
             "at the next token, 80% within 8, LRU at ~40% residency 90-95%; a 512-expert top-10 model: LRU 64 "
             "slots ~67%, 128 ~81%, the first layer touches 384 of 512 experts in 300 tokens; gpt-oss-120b at "
             "~3% residency 8-9% (shared/REFERENCES.md)")


HELD_OUT_PACKAGES = ("click", "jinja2", "rich", "tqdm", "uvicorn", "fastapi", "openai", "psutil", "safetensors",
                     "gguf", "transformers", "numpy", "tokenizers", "prometheus_client", "llguidance", "matplotlib")


def package_texts(chars: int) -> tuple[list[str], list[str]]:
    """(prose, code) the trainer never saw: installed packages' descriptions (their METADATA's markdown) and
    sources, in HELD_OUT_PACKAGES order (the test install's dependencies)."""
    from importlib import metadata

    prose, code = [], []
    for name in HELD_OUT_PACKAGES:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        body = (dist.read_text("METADATA") or "").split("\n\n", 1)[-1]
        if len(body) > chars:
            prose.append(body[:chars])
        sources = sorted(str(f) for f in dist.files or () if str(f).endswith(".py") and "test" not in str(f))
        for f in sources[len(sources) // 2:]:  # past the __init__s and the alphabet's first modules
            t = Path(dist.locate_file(f)).read_text(errors="replace")
            if len(t) > chars:
                code.append(t[:chars])
                break
    return prose, code


def texts(n: int, chars: int = 1500) -> list[str]:
    """n held-out texts, taking in turn: standard-library code of the trainer's validation split (every 40th
    file), English prose (package descriptions) and other packages' code."""
    from moerun.tools.train_default import VAL_EVERY, corpus_files

    files = [f for i, f in enumerate(corpus_files()) if i % VAL_EVERY == VAL_EVERY - 1]
    stdlib = [t[:chars] for t in (f.read_text(errors="replace") for f in files) if len(t) > chars]
    prose, code = package_texts(chars)
    mixed = [t for group in zip(stdlib, prose, code) for t in group]
    if len(mixed) < n:
        raise SystemExit(f"only {len(mixed)} held-out texts here (stdlib {len(stdlib)}, prose {len(prose)}, "
                         f"package code {len(code)}); ask for fewer")
    return mixed[:n]


def text_sets(n: int) -> tuple[list[str], list[str]]:
    """Texts A (the traces learned from) and B (held out), n each, each a mix of the three kinds."""
    both = texts(2 * n)
    return both[0::2], both[1::2]


def record(model_path: str, prompts: list[str], n_gen: int, temperature: float, out: Path, seed: int = 0) -> Path:
    from moerun.config import RuntimeConfig, SamplingParams
    from moerun.experts.trace import RouteRecorder
    from moerun.runtime import build

    rt = build(RuntimeConfig(model=model_path, threads=2, ctx_size=2048))
    eng = rt.engine
    if out.exists():
        out.unlink()
    rec = RouteRecorder(out, eng.model.spec)
    eng.model.on_route = rec
    for i, p in enumerate(prompts):
        rec.request = i
        params = SamplingParams(temperature=temperature, seed=seed + i, max_tokens=n_gen, ignore_eos=True) \
            if temperature else SamplingParams.greedy(max_tokens=n_gen, ignore_eos=True)
        gen = eng.generate(eng.tokenizer.encode(p), params).run()
        gen.seq.free()
    rec.writer.close()
    rt.close()
    return out


def live_hit_rate(model_path: str, prompts: list[str], n_gen: int, plan: Path | None = None,
                  slots: int | None = None, policy: str = "lru", trace: Path | None = None) -> float:
    """The decode hit rate of a live greedy run with the experts' home on disk (the file's map) behind a cache
    of `slots` per layer (re-shared by `trace`'s curves when given) or the per-layer `plan`, evicting by
    `policy`."""
    from moerun.config import RuntimeConfig, SamplingParams
    from moerun.runtime import build

    rt = build(RuntimeConfig(model=model_path, threads=2, ctx_size=2048, mmap=True,
                             expert_cache_plan=None if plan is None else str(plan), expert_cache_slots=slots,
                             expert_cache_trace=None if trace is None else str(trace), cache_policy=policy))
    eng = rt.engine
    for p in prompts:
        gen = eng.generate(eng.tokenizer.encode(p), SamplingParams.greedy(max_tokens=n_gen, ignore_eos=True)).run()
        gen.seq.free()
    rate = rt.cache.stats.get(phase="decode").hit_rate
    rt.close()
    return rate


def decode_steps(trace) -> dict[tuple[int, int], list[tuple[int, ...]]]:
    """(request, layer) -> the experts of each decode step, in order."""
    out: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    for r in trace.records:
        if r.phase == "decode":
            out.setdefault((r.request_id, r.layer), []).append(r.experts)
    return out


def reuse(trace) -> dict:
    """Reuse distances (tokens since the expert was last chosen at that layer), the share of choices repeating
    at the next token and within 8, and each layer's distinct experts over its first 300 decode tokens."""
    dists, first300 = [], {}
    for (req, layer), steps in decode_steps(trace).items():
        last: dict[int, int] = {}
        for t, experts in enumerate(steps):
            for e in experts:
                if e in last:
                    dists.append(t - last[e])
                last[e] = t
        first300.setdefault(layer, []).append(len({e for s in steps[:300] for e in s}))
    n_choices = sum(len(s) * len(s[0]) for s in decode_steps(trace).values() if s)
    return {"median": statistics.median(dists) if dists else None,
            "next": sum(d == 1 for d in dists) / n_choices, "within8": sum(d <= 8 for d in dists) / n_choices,
            "hist": [sum(d == k for d in dists) / n_choices for k in range(1, 17)],
            "working_set": {layer: statistics.median(v) for layer, v in sorted(first300.items())}}


def lru_curve(trace, sizes: list[int]) -> list[float]:
    from moerun.experts.trace import simulate

    records = [r for r in trace.records if r.phase == "decode"]
    return [simulate(records, s, "lru").hit_rate() for s in sizes]


def plot(path: Path, curves: dict[str, list[float]], sizes: list[int], n_experts: int, hist: dict[str, list]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, c in curves.items():
        a.plot([100 * s / n_experts for s in sizes], [100 * x for x in c], marker="o", label=name)
    a.set_xlabel("cache slots per layer (% of the experts)")
    a.set_ylabel("LRU decode hit rate (%)")
    a.set_ylim(0, 100)
    a.grid(True, alpha=0.3)
    a.legend()
    for name, h in hist.items():
        b.plot(range(1, 17), [100 * x for x in h], marker=".", label=name)
    b.set_xlabel("reuse distance (tokens)")
    b.set_ylabel("share of choices (%)")
    b.grid(True, alpha=0.3)
    b.legend()
    fig.suptitle("routing bench model: decode routing")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def concave(curve: list[int]) -> list[int]:
    """The upper concave envelope of a hit curve (what a smoother allocation learns from)."""
    import numpy as np

    hull: list[tuple[int, int]] = []
    for p in enumerate(curve):
        while len(hull) >= 2 and (hull[-1][1] - hull[-2][1]) * (p[0] - hull[-1][0]) <= \
                (p[1] - hull[-1][1]) * (hull[-1][0] - hull[-2][0]):
            hull.pop()
        hull.append(p)
    return [round(v) for v in np.interp(range(len(curve)), [x for x, _ in hull], [y for _, y in hull])]


def allocation_table(learn_records, held_records, n_experts: int, k: int, totals: list[int]) -> str:
    """Held-out hit rates of the even spread, the exact allocation and the envelope's, learned on one trace."""
    from moerun.experts.allocate import allocate, floor_slots, guarded_allocate, hit_curves, hits_of, uniform

    learn, held = hit_curves(learn_records, n_experts), hit_curves(held_records, n_experts)
    smooth = {layer: concave(c) for layer, c in learn.items()}
    q = sum(len(r.experts) for r in held_records)
    rows = [f"| {t} | {100 * hits_of(held, uniform(learn, t)) / q:.1f}% | "
            f"{100 * hits_of(held, allocate(learn, t, floor_slots(t, len(learn), k))) / q:.1f}% | "
            f"{100 * hits_of(held, allocate(smooth, t, floor_slots(t, len(learn), k))) / q:.1f}% | "
            f"{100 * hits_of(held, guarded_allocate(learn_records, t, n_experts, floor_slots(t, len(learn), k))[0]) / q:.1f}% |"
            for t in totals]
    return ("| total slots | uniform | trace (exact) | trace (concave envelope) | trace (guarded) |\n"
            "|---:|---:|---:|---:|---:|\n"
            + "\n".join(rows))


def policy_table(decode: dict[str, list], sizes: list[int]) -> str:
    """Decode hit rate of every policy and Belady's bound, per trace and cache size (prefill bypasses the cache)."""
    from moerun.experts.policy import POLICIES
    from moerun.experts.trace import simulate

    head = "| trace | policy | " + " | ".join(f"{s} slots" for s in sizes) + " |\n|---|---|" + "---:|" * len(sizes)
    rows = [f"| {name} | {pol} | " + " | ".join(f"{100 * simulate(recs, s, pol).hit_rate():.1f}%" for s in sizes) + " |"
            for name, recs in decode.items() for pol in (*POLICIES, "belady")]
    return head + "\n" + "\n".join(rows)


def main() -> None:
    p = add(parser(__doc__), "model")
    p.add_argument("--texts", type=int, default=12)
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--out", type=Path, default=Path("~/.cache/moerun/routing").expanduser())
    args = add(p, "append").parse_args()
    sys.path.insert(0, str(HERE))
    from moerun.experts.allocate import (
        floor_slots,
        guarded_allocate,
        hit_curves,
        hits_of,
        uniform,
        write_plan,
    )
    from moerun.experts.trace import read_trace

    args.out.mkdir(parents=True, exist_ok=True)
    text_a, text_b = text_sets(args.texts)
    traces = {}
    for name, temp, part in (("greedy A", 0.0, text_a), ("sampled A", 0.8, text_a), ("greedy B", 0.0, text_b)):
        path = args.out / f"trace-{name.replace(' ', '-')}.jsonl"
        traces[name] = read_trace(record(args.model, part, args.tokens, temp, path))
    n = traces["greedy A"].header.n_experts
    sizes = sorted({max(1, round(n * f)) for f in (0.0625, 0.125, 0.25, 0.4, 0.5, 0.75, 1.0)})
    stats = {k: reuse(t) for k, t in traces.items()}
    curves = {k: lru_curve(t, sizes) for k, t in traces.items()}
    plot_path = HERE / "routing_traces.png"
    plot(plot_path, curves, sizes, n, {k: s["hist"] for k, s in stats.items()})
    rows = "\n".join(f"| {k} | {s['median']} | {100 * s['next']:.0f}% | {100 * s['within8']:.0f}% | "
                     + ", ".join(f"{v:.0f}" for v in s["working_set"].values()) + " | "
                     + " / ".join(f"{100 * c:.0f}%" for c in curves[k]) + " |" for k, s in stats.items())
    # per-layer allocation: curves from text A, evaluated on text B at the same totals
    dec = {k: [r for r in t.records if r.phase == "decode"] for k, t in traces.items()}
    alloc_rows = []
    layers, k = traces["greedy A"].header.n_layers, traces["greedy A"].header.k
    for frac, policy in ((0.1875, "lru"), (0.25, "lru"), (0.375, "lru"), (0.25, "lfru")):
        total = max(layers, round(frac * n * layers))
        learn = hit_curves(dec["greedy A"], min(n, total), policy)
        held = hit_curves(dec["greedy B"], min(n, total), policy)
        queries = sum(len(r.experts) for r in dec["greedy B"])
        even = uniform(learn, total)
        chosen, _ = guarded_allocate(dec["greedy A"], total, n, floor_slots(total, layers, k), policy)
        plan_path = args.out / f"plan-{total}-{policy}.json"
        write_plan(plan_path, chosen, total_slots=total, policy=policy)
        live_even = live_hit_rate(args.model, text_b, args.tokens, slots=total // layers, policy=policy)
        live_plan = live_hit_rate(args.model, text_b, args.tokens, plan=plan_path, policy=policy)
        alloc_rows.append(f"| {total} ({100 * frac:.1f}%) | {policy} | {100 * hits_of(held, even) / queries:.1f}% | "
                          f"{100 * hits_of(held, chosen) / queries:.1f}% | {100 * live_even:.1f}% | "
                          f"{100 * live_plan:.1f}% | " + " ".join(str(chosen[layer]) for layer in sorted(chosen)) + " |")
    more = allocation_table(dec["greedy A"], dec["greedy B"], n, k,
                            [round(f * n * layers) for f in (0.09375, 0.125, 0.1875, 0.25, 0.375, 0.5)])
    text = (f"## routing bench model: decode routing against the published figures (issue 19)\n\n"
            f"Command: `python bench/routing_traces.py {args.model}` (commit {moerun_commit()}); {args.texts} "
            f"held-out texts per trace (A; B for the held-out check), stdlib code, package prose and package code "
            f"in turn, {args.tokens} generated tokens each. "
            f"{n} experts, top-{traces['greedy A'].header.k}, {traces['greedy A'].header.n_layers} layers. "
            f"Plot: `bench/routing_traces.png`.\n\n"
            "| trace | median reuse distance | repeat at next token | within 8 | experts touched in 300 tokens, by "
            f"layer | LRU hit rate at {', '.join(map(str, sizes))} slots |\n|---|---:|---:|---:|---|---|\n"
            + rows + f"\n\nPublished: {PUBLISHED}.\n\nPer-layer allocation from trace A's curves, replayed on "
            "trace B (held-out text) at the same total, and live greedy runs of text B with the experts' home on "
            "disk (`--mmap`) behind `--expert-cache-slots total/layers` or `--expert-cache-plan` (decode hit "
            "rates):\n\n| total slots (residency) | policy | uniform, replay | trace, replay | uniform, live | plan, live | "
            "slots by layer |\n|---|---|---:|---:|---:|---:|---|\n" + "\n".join(alloc_rows)
            + "\n\nMore totals, learned on trace A and replayed on trace B:\n\n" + more
            + "\n\nEviction policies, decode only:\n\n" + policy_table(dec, [n // 4, round(0.4 * n), n // 2]) + "\n")
    publish(text, args.append)


if __name__ == "__main__":
    main()
