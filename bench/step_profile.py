"""Where a decode step's time goes on the fused C path: by layer kind and by part, with the bytes each reads.

    python bench/step_profile.py MODEL.gguf [-t 2] [--steps 32] [--prompt 64]

Prefills `--prompt` tokens, then times `--steps` one-token steps layer by layer (each layer whole in C, as
`decode_tokens` runs it, with a timer around each call) and the head, and the whole step in one call for
comparison: `--rounds` rounds of `--steps` steps each, the cache wound back to the prompt after each, each round
between two passes of the read probe, so that a round's rate is set against the memory's rate of that moment (a shared
host's memory can read 50 or 85 GB/s by the minute). The rounds are listed with their ratios under the table. Per layer kind (attention or DeltaNet mixer, with a routed or a dense FFN) it prints the median time
per token, the weight (and recurrent-state) bytes read, and the GB/s that makes, beside the read-bandwidth probe's
GB/s for the same threads. The head's row is the output projection over the vocabulary. The argmax (greedy) and
the sampler chain (temperature 0.8, top-k 40, top-p 0.95; and top-k off) over the step's logits are timed too.
Last, one round of whole steps with the kernel pool's times kept (pool.h's qk_pool_trace): per job kind the
caller's share, its wait for the workers, its work between jobs and the time outside the kernels, ms a step.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch
from toolkit import add, cpu_model, parser

from moerun.kernels import cpu


def layer_bytes(model, i: int) -> tuple[str, int]:
    """(kind, bytes one token reads) of layer i: its dense weights, n_used routed experts, a DeltaNet state read and
    written."""
    s, lw = model.spec, model.layers[i]
    mla = [q if q is not None and cpu.has_deq_dot(q.qtype) else f  # MLA's W_UK / W_UV as the fused path reads them
           for q, f in ((lw.wk_b_q, lw.wk_b), (lw.wv_b_q, lw.wv_b))]
    mats = [lw.wq, lw.wk, lw.wv, lw.wo, lw.router, lw.wqkv, lw.wz, lw.wba, lw.wbeta, lw.walpha, lw.ssm_out,
            lw.shexp_gate, lw.wq_a, lw.wkv_a, *mla, *(lw.shexp or ()), *(lw.ffn or ())]
    n = sum(getattr(m, "nbytes", 0) for m in mats if m is not None)
    if lw.router is not None:
        n += sum(t.nbytes for t in model.store.stacks(i)) * s.n_experts_used // s.n_experts
    if s.linear(i):
        n += 2 * 4 * s.ssm_v_heads * s.ssm_k_dim * s.ssm_v_dim
    mixer = "deltanet" if s.linear(i) else "mla" if s.attention == "mla" else "attention"
    kind = mixer + (" + moe" if lw.router is not None else " + dense")
    return kind, n


def quick_probe(threads: int) -> float:
    """The read probe in one quick pass (its 1 GiB, one run of each pattern, the best), between rounds of steps (a
    256 MiB pass read 10-15 % faster than the 1 GiB one beside it)."""
    from moerun.placement.bandwidth import measure_host_read_bandwidth

    return measure_host_read_bandwidth(threads, runs=1)["gbps"]


def main() -> None:
    ap = add(parser(__doc__, "all"), "model", "threads")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of whole steps, each between two probe passes")
    args = ap.parse_args()

    from moerun.config import SamplingParams
    from moerun.engine.kv_cache import KVPool, SeqKV
    from moerun.engine.sampler import Sampler
    from moerun.loading import load_model
    from moerun.model.ops import thread_budget
    from moerun.placement.bandwidth import measure_host_read_bandwidth

    model = load_model(args.model).model
    f = model.fused
    if f is None or not f.whole_model:
        raise SystemExit(f"{args.model}: not on the fused whole-model path (fused={f is not None})")
    s = model.spec
    kinds = [layer_bytes(model, i) for i in range(s.n_layers)]
    head_bytes = model.head.nbytes if hasattr(model.head, "nbytes") else model.head.numel() * 4
    times: dict[str, list[float]] = defaultdict(list)
    g = torch.Generator().manual_seed(0)
    with thread_budget(args.threads), torch.inference_mode():
        pool = KVPool(s, args.prompt + 2 * args.steps + 16)
        kv = SeqKV(pool, args.prompt + 2 * args.steps + 8)
        prompt = torch.randint(0, s.vocab, (args.prompt,), generator=g)
        for chunk in prompt.split(16):
            model.forward(chunk, kv)
        caches = pool.caches(0, s.n_layers)
        tok = int(prompt[-1])
        for _ in range(args.steps):  # layer by layer, each whole in C
            kv.reserve(1)
            pos = torch.tensor([kv.length])
            rows = f.rows([kv], pos)
            x = model.embed(torch.tensor([tok]))
            per: dict[str, float] = defaultdict(float)
            for i in range(s.n_layers):
                t0 = time.perf_counter()
                f(i, x, rows, *caches[i], moe=True)
                per[kinds[i][0]] += time.perf_counter() - t0
            t0 = time.perf_counter()
            logits = f.head_logits(x)
            per["head"] += time.perf_counter() - t0
            kv.length += 1
            for k, v in per.items():
                times[k].append(v)
            t0 = time.perf_counter()
            tok = int(logits[-1].argmax())
            times["argmax"].append(time.perf_counter() - t0)
        start, rounds = kv.length, []
        for _ in range(args.rounds):  # the whole step in one call, between two passes of the probe
            before, steps = quick_probe(args.threads), []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                logits = model.decode(torch.tensor([tok]), [kv])
                steps.append(time.perf_counter() - t0)
                tok = int(logits[-1].argmax())
            kv.length = start
            rounds.append((statistics.median(steps), before, quick_probe(args.threads)))
            times["whole step"] += steps
        pool_rows, pool_steps = pool_round(model, kv, tok, args.steps)
        kv.length = start
        for name, params in (("sampler k40 p0.95 t0.8", SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=0)),
                             ("sampler p0.95 t0.8 (top-k off)", SamplingParams(temperature=0.8, top_k=0, top_p=0.95, seed=0))):
            sampler = Sampler(params, s.vocab)
            history = prompt[-64:]
            for _ in range(args.steps):
                t0 = time.perf_counter()
                sampler.sample(logits[-1], history)
                times[name].append(time.perf_counter() - t0)
    bw = measure_host_read_bandwidth(args.threads)["gbps"]
    step = statistics.median(times["whole step"])
    print(f"{args.model}: {s.family}, {s.n_layers} layers, vocab {s.vocab}; {cpu_model()}, {args.threads} threads; "
          f"read-bandwidth probe {bw:.1f} GB/s")
    print("| part | layers | ms / token | % of step | MB read | GB/s | % of probe |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    groups: dict[str, list[int]] = defaultdict(list)
    for i, (k, _) in enumerate(kinds):
        groups[k].append(i)
    total_bytes = 0
    for k, idx in sorted(groups.items()):
        ms, nb = statistics.median(times[k]) * 1e3, sum(kinds[i][1] for i in idx)
        total_bytes += nb
        print(f"| {k} | {len(idx)} | {ms:.2f} | {ms / step / 10:.1f} | {nb / 1e6:.0f} | {nb / ms / 1e6:.1f} | "
              f"{100 * nb / ms / 1e6 / bw:.0f} |")
    ms = statistics.median(times["head"]) * 1e3
    total_bytes += head_bytes
    print(f"| head | | {ms:.2f} | {ms / step / 10:.1f} | {head_bytes / 1e6:.0f} | {head_bytes / ms / 1e6:.1f} | "
          f"{100 * head_bytes / ms / 1e6 / bw:.0f} |")
    for k in ("argmax", "sampler k40 p0.95 t0.8", "sampler p0.95 t0.8 (top-k off)"):
        ms = statistics.median(times[k]) * 1e3
        print(f"| {k} | | {ms:.3f} | {ms / step / 10:.2f} | | | |")
    print(f"| whole step (one call) | {s.n_layers} | {step * 1e3:.2f} | 100 | {total_bytes / 1e6:.0f} | "
          f"{total_bytes / step / 1e9:.1f} | {100 * total_bytes / step / 1e9 / bw:.0f} |")
    ratios = [total_bytes / t / 1e9 / ((a + b) / 2) for t, a, b in rounds]
    print("\nwhole step by round (ms, GB/s, probe GB/s before / after, % of their mean): " + "; ".join(
        f"{t * 1e3:.2f}, {total_bytes / t / 1e9:.1f}, {a:.1f} / {b:.1f}, {100 * r:.0f}"
        for (t, a, b), r in zip(rounds, ratios)))
    print(f"median over rounds: {100 * statistics.median(ratios):.0f} % of the probe beside it")
    print_pool(pool_rows, pool_steps)


def pool_round(model, kv, tok: int, steps: int) -> tuple[list[tuple], list[float]]:
    """One more round of whole steps with the kernel pool's per-job-kind times kept (pool.h's qk_pool_trace), and
    as a last row ("spans", matched, missed) the threads' first reads against the spans the job before announced
    (pool.h's qk_pool_first_read)."""
    from moerun.kernels import _cpu

    times = []
    _cpu.pool_trace(True)
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            logits = model.decode(torch.tensor([tok]), [kv])
            times.append(time.perf_counter() - t0)
            tok = int(logits[-1].argmax())
        rows = [*_cpu.pool_trace_rows(), ("spans", *_cpu.pool_span_checks())]
    finally:
        _cpu.pool_trace(False)
    return rows, times


def print_pool(rows: list[tuple], times: list[float]) -> None:
    """Where the caller's time goes by pool job kind, ms a step: its share of each job (the worker's start
    included), its wait for the workers after that, its own work between jobs, and the time outside the kernels
    (gaps over 30 us: Python and the argmax between two steps). Then how many of the threads' shares started where
    the job before had said, for the idle threads' prefetch (cpu.set_idle_prefetch)."""
    n = len(times)
    *rows, (_, matched, missed) = rows
    print(f"\nthe kernel pool, one round of {n} whole steps (median {statistics.median(times) * 1e3:.2f} ms; "
          "ms a step, the caller's side):")
    print("| job (task) | jobs a step | own share | wait for the workers | work before it | outside the kernels |")
    print("|---|---:|---:|---:|---:|---:|")
    tot = [0.0] * 4
    for name, jobs, *ns in sorted(rows, key=lambda r: -r[2]):
        ms = [v / n / 1e6 for v in ns]
        tot = [a + b for a, b in zip(tot, ms)]
        print(f"| {name} | {jobs / n:.1f} | " + " | ".join(f"{v:.3f}" for v in ms) + " |")
    print("| all | | " + " | ".join(f"{v:.3f}" for v in tot) + " |")
    print(f"\nshares that started where the job before said (idle prefetch {cpu.features()['idle_prefetch']} bytes): "
          f"{matched / n:.1f} a step, {missed / n:.1f} elsewhere")


if __name__ == "__main__":
    main()
