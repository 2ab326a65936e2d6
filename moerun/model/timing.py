"""How long a model takes to run a prompt and to generate, one forward at a time: what `moerun bench` reports
and what the layer probe (moerun.placement.layer_probe) fits its per-layer figures to. `model` is anything with
MoEModel's forward(tokens, seq, last_only=True); `seq` its KV sequence (moerun.engine.kv_cache.SeqKV). torch is
imported where a token is made, so `moerun bench` starts without it.
"""

from __future__ import annotations

import time

__all__ = ["time_gen", "time_prompt"]


def time_prompt(model, seq, tokens, ubatch: int) -> int:
    """Nanoseconds to run `tokens` through `model` into the (empty) `seq`, `ubatch` tokens per forward."""
    t0 = time.perf_counter_ns()
    for chunk in tokens.split(ubatch):
        logits = model.forward(chunk, seq, last_only=True)
    int(logits[-1].argmax())  # the prompt is done when its last logits are (a sync point on any device)
    return time.perf_counter_ns() - t0


def time_gen(model, seq, first_token: int, n_gen: int) -> int:
    """Nanoseconds to generate `n_gen` tokens one at a time into `seq`, greedy, starting from first_token."""
    import torch

    tok = first_token
    t0 = time.perf_counter_ns()
    for _ in range(n_gen):
        logits = model.forward(torch.tensor([tok], dtype=torch.long), seq, last_only=True)
        tok = int(logits[-1].argmax())
    return time.perf_counter_ns() - t0
