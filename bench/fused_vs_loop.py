"""Greedy tokens and logits of a model file through the fused C decode path and through the torch layer loop over
the same kernels (issue 36's parity on full-depth files; tests/test_fused_families.py does it on tiny ones).

    python bench/fused_vs_loop.py MODEL.gguf [MODEL ...] [-n 16] [--prompt 24]

Per file: the greedy continuation of a fixed random prompt both ways (equal or not, and where they part), whether
every step's logits are equal bit for bit, the largest relative difference between the two paths' logits over the
steps while their tokens agree, each layer alone against the loop's (layer_by_layer), and the median time of a
decode step each way (`--rounds` alternating rounds of the n steps; noisy on a shared machine, a ratio rather than
a speed).
"""

from __future__ import annotations

import statistics
import time

import torch
from toolkit import add, parser


def run(model, prompt: torch.Tensor, n: int, fused: bool, times: list[float] | None = None
        ) -> tuple[list[int], list[torch.Tensor]]:
    from moerun.engine.kv_cache import KVPool, SeqKV

    saved = model.fused
    model.fused = saved if fused else None
    try:
        kv = SeqKV(KVPool(model.spec, len(prompt) + n + 16), len(prompt) + n + 8)
        logits = model.forward(prompt, kv, last_only=True)
        tokens, all_logits = [], []
        for _ in range(n):
            all_logits.append(logits[-1])
            tokens.append(int(logits[-1].argmax()))
            t0 = time.perf_counter()
            logits = model.forward(torch.tensor([tokens[-1]]), kv)
            if times is not None:
                times.append(time.perf_counter() - t0)
        return tokens, all_logits
    finally:
        model.fused = saved


def layer_by_layer(model, T: int, tol: float = 1e-5) -> tuple[dict[str, float], int, int]:
    """Each layer on the same random input [T, H] (one sequence at positions 0..T-1, fresh caches): the whole layer in
    C against the torch loop's mixer and FFN over the same kernels. -> (the largest relative difference per layer
    kind among the layers within `tol`, how many layers chose other experts (a near tie under 1e-7 noise), how many
    differ by more than `tol` with the same experts: a 1-ulp difference before an 8-bit activation rounding moves
    one value a step, ~1e-3 on a 2048-wide layer)."""
    from moerun.engine.kv_cache import KVPool, SeqKV
    from moerun.model.layers import rope_tables
    from moerun.model.moe import route

    s, f = model.spec, model.fused
    g = torch.Generator().manual_seed(T)
    pos = torch.arange(T)
    rope = rope_tables(pos, s.rotary_dim, s.rope_theta, s.yarn)
    flips, over, worst = 0, 0, {}
    with torch.inference_mode():
        for i, lw in enumerate(model.layers):
            x = torch.randn(T, s.hidden, generator=g)
            kv_t, kv_c = (SeqKV(KVPool(s, 64), 64) for _ in range(2))
            for kv in (kv_t, kv_c):
                kv.reserve(T)
            xn = model.ops.rms_norm(x, lw.attn_norm, s.rms_eps)
            mixed = x + (model.linear_attention(i, xn, pos, kv_t) if s.linear(i) else
                         model.attention(i, xn, pos, rope, kv_t))
            ffn_in = model.ops.rms_norm(mixed, lw.ffn_norm, s.rms_eps)
            ref = mixed + model.ffn(i, ffn_in, "decode", pos)
            got = x.clone()
            _, ids, _ = f(i, got, f.rows([kv_c] * T, pos), *kv_c.pool.caches(i, i + 1)[0], moe=True)
            if lw.router is not None and not torch.equal(ids, route(model.ops, ffn_in, lw, s)[1]):
                flips += 1
                continue
            err = ((got - ref).norm() / ref.norm()).item()
            kind = "deltanet" if s.linear(i) else "mla" if s.attention == "mla" else "attention"
            if err >= tol:
                over += 1
                continue
            worst[kind] = max(worst.get(kind, 0.0), err)
    return worst, flips, over


def main() -> None:
    ap = add(parser(__doc__, "all"), "models")
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=1, help="alternating timing rounds of n steps each way")
    args = ap.parse_args()
    from moerun.loading import load_model

    print("| file | fused path | greedy tokens equal | logits equal bit for bit | first difference (top-2 margin "
          "there) | max relative logit difference | each layer alone: max relative difference (flips) | "
          "ms a step fused / loop |")
    print("|---|---|---|---|---:|---:|---|---|")
    for path in args.models:
        model = load_model(path).model
        whole = model.fused is not None and model.fused.whole_model
        prompt = torch.randint(0, model.spec.vocab, (args.prompt,), generator=torch.Generator().manual_seed(0))
        tf, tl = [], []
        with torch.inference_mode():
            a, la = run(model, prompt, args.n, True, tf)
            b, lb = run(model, prompt, args.n, False, tl)
            for _ in range(args.rounds - 1):
                run(model, prompt, args.n, True, tf)
                run(model, prompt, args.n, False, tl)
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        upto = len(a) if same is None else same + 1
        err = max(((x - y).norm() / y.norm()).item() for x, y in zip(la[:upto], lb[:upto]))
        where = ""
        if same is not None:  # how close the loop's top two were where the paths parted, against their gap
            top = lb[same].topk(2).values
            where = f"{same} ({(top[0] - top[1]).item():.2e} vs {(la[same] - lb[same]).abs().max().item():.2e})"
        worst, flips, over = layer_by_layer(model, 1) if whole else ({}, 0, 0)
        layers = ", ".join(f"{k} {v:.1e}" for k, v in sorted(worst.items())) + f" ({flips} routing, {over} rounding)"
        ms = f"{1e3 * statistics.median(tf):.1f} / {1e3 * statistics.median(tl):.1f}"
        bits = len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))
        print(f"| {path} | {'whole model' if whole else 'no'} | {a == b} | {bits} | {where} | {err:.1e} | {layers} | "
              f"{ms} |")


if __name__ == "__main__":
    main()
