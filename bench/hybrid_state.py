"""What one sequence holds in a hybrid (Qwen3-Next-shaped) model against a same-shaped all-attention model, at 4k
and 32k context: the linear layers' recurrent state (fixed) plus the attention layers' KV (per token); appends the
table to bench/RESULTS.md with --append.

    python bench/hybrid_state.py --preset next-L4 --layers 48 [--append]

The figures come from ModelSpec (state_layout, kv_layout) through moerun.arch.summary.sequence_bytes, the numbers
the planner and `moerun inspect` use; the all-attention model is the same spec with every layer full attention.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
from datetime import date

from compare_llamacpp import append_section, moerun_commit

from moerun.arch.summary import sequence_bytes
from moerun.tools.presets import preset

MiB = 2**20


def table(spec, contexts: tuple[int, ...] = (4096, 32768)) -> str:
    dense = dataclasses.replace(spec, layer_kinds=("full",) * spec.n_layers)
    lines = ["| KV type | context | hybrid: state + KV | all-attention KV | all-attention / hybrid |", "|---|---|---|---|---|"]
    for name, nbytes in (("f16", 2), ("f32", 4)):
        h, d = sequence_bytes(spec, nbytes), sequence_bytes(dense, nbytes)
        for ctx in contexts:
            hyb = h.state_bytes + ctx * h.kv_per_token
            att = ctx * d.kv_per_token
            lines.append(f"| {name} | {ctx // 1024}k | {hyb / MiB:,.1f} MiB ({h.state_bytes / MiB:,.1f} + "
                         f"{ctx * h.kv_per_token / MiB:,.1f}) | {att / MiB:,.1f} MiB | {att / hyb:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="next-L4")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--append", action="store_true")
    args = p.parse_args()
    spec = preset(args.preset, layers=args.layers)
    n_lin = sum(spec.linear(i) for i in range(spec.n_layers))
    commit = moerun_commit()
    text = (f"## {date.today()} — recurrent state against KV per sequence ({args.preset}, {spec.n_layers} layers)\n\n"
            f"Command: `python bench/hybrid_state.py --preset {args.preset} --layers {args.layers}` (commit {commit}, "
            f"{platform.machine()}; arithmetic, no run). {n_lin} linear-attention layers (state per layer: conv "
            f"{spec.ssm_conv_dim} x {spec.ssm_conv - 1} + {spec.ssm_v_heads} heads x {spec.ssm_k_dim} x {spec.ssm_v_dim}, "
            f"float32) and {spec.n_layers - n_lin} attention layers ({spec.n_kv_heads} KV heads of {spec.head_dim}); "
            "the all-attention model has the same shape with every layer attention. The engine also keeps one "
            "checkpoint of the state per sequence for prefix reuse (the planner reserves 2x the state).\n\n"
            + table(spec) + "\n")
    print(text)
    if args.append:
        append_section(text)


if __name__ == "__main__":
    main()
