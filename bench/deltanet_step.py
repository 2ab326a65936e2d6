"""Gated DeltaNet's decode step: the torch forms (moerun.model.deltanet) against the C kernel (moerun.kernels.delta),
alone at a layer's shape and in whole decode steps of a model file, alternating A and B; medians.

    python bench/deltanet_step.py ~/.cache/moerun/bench-models/next-L4-Q4_K_M.gguf -t 2 [--append]
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import date

import torch
from compare_llamacpp import append_section, moerun_commit

from moerun.engine.kv_cache import KVPool, SeqKV
from moerun.kernels.delta import delta_step
from moerun.loading import load_model
from moerun.model import deltanet
from moerun.model.ops import set_threads


def step_alone(spec, reps: int) -> dict[str, float]:
    """ms of one layer's recurrent step (conv window, delta rule, gated norm, the state read from and written
    back to its pool slot) for one sequence, torch and C."""
    nk, nv, dk, dv, K = spec.ssm_k_heads, spec.ssm_v_heads, spec.ssm_k_dim, spec.ssm_v_dim, spec.ssm_conv
    C = spec.ssm_conv_dim
    g = torch.Generator().manual_seed(0)
    conv, ssm = torch.randn(2, C, K - 1, generator=g), 0.01 * torch.randn(2, nv, dk, dv, generator=g)
    qkv, z = torch.randn(1, C, generator=g), torch.randn(1, nv * dv, generator=g)
    b, a, w = torch.randn(1, nv, generator=g), torch.randn(1, nv, generator=g), torch.randn(C, K, generator=g)
    A, dt, norm = -torch.rand(nv, generator=g), torch.randn(nv, generator=g), torch.ones(dv)
    slots, fresh = torch.tensor([1]), torch.tensor([False])

    def torch_step():
        c0, s0 = conv.index_select(0, slots), ssm.index_select(0, slots)
        y, c1 = deltanet.conv_step(qkv, w, c0)
        q, k, v = y.split((nk * dk, nk * dk, nv * dv), dim=-1)
        o, s1 = deltanet.delta_step(q.view(1, nk, dk), k.view(1, nk, dk), v.view(1, nv, dv),
                                    A * torch.nn.functional.softplus(a + dt), torch.sigmoid(b), s0)
        conv.index_copy_(0, slots, c1)
        ssm.index_copy_(0, slots, s1)
        return deltanet.gated_norm(o, norm, z.view(1, nv, dv), 1e-6)

    def c_step():
        return delta_step(qkv, z, b, a, conv, ssm, slots, fresh, w, A, dt, norm, 1e-6, nk, False)

    out: dict[str, list[float]] = {"torch": [], "C": []}
    for _ in range(reps):
        for name, f in (("torch", torch_step), ("C", c_step)):
            f()
            t = time.perf_counter()
            for _ in range(50):
                f()
            out[name].append((time.perf_counter() - t) / 50 * 1e3)
    return {k: statistics.median(v) for k, v in out.items()}


def decode_ms(path: str, rounds: int, n: int) -> dict[str, list[float]]:
    """ms per decoded token of the model, the C step on and off in turn."""
    m = load_model(path).model
    kv = SeqKV(KVPool(m.spec, 4096), 4096)
    m.forward(torch.randint(0, m.spec.vocab, (64,), generator=torch.Generator().manual_seed(0)), kv)
    c_path = m._delta_c
    out: dict[str, list[float]] = {"torch": [], "C": []}
    for _ in range(rounds):
        for name in ("torch", "C"):
            m._delta_c = c_path if name == "C" else (lambda *a: False)
            for _ in range(3):
                m.forward(torch.tensor([5]), kv)
            t = time.perf_counter()
            for _ in range(n):
                m.forward(torch.tensor([5]), kv)
            out[name].append((time.perf_counter() - t) / n * 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-r", "--rounds", type=int, default=5)
    p.add_argument("-n", type=int, default=48, help="tokens per timing")
    p.add_argument("--append", action="store_true")
    args = p.parse_args()
    set_threads(args.threads)
    torch.set_num_threads(1)  # decode steps: the kernel pool does the work (KernelOps.step)
    spec = load_model(args.model).model.spec
    alone = step_alone(spec, args.rounds)
    dec = decode_ms(args.model, args.rounds, args.n)
    med = {k: statistics.median(v) for k, v in dec.items()}
    commit = moerun_commit()
    rows = "\n".join(f"| {k} | {alone[k]:.3f} | {med[k]:.2f} ({', '.join(f'{x:.2f}' for x in dec[k])}) | "
                     f"{1e3 / med[k]:.1f} |" for k in ("torch", "C"))
    text = (f"## {date.today()} — gated DeltaNet's decode step: torch against C (issue 17)\n\n"
            f"Command: `python bench/deltanet_step.py {args.model} -t {args.threads} -r {args.rounds} -n {args.n}` "
            f"(commit {commit}). One layer's recurrent step at the model's shape ({spec.ssm_v_heads} value heads of "
            f"{spec.ssm_k_dim} x {spec.ssm_v_dim}, conv {spec.ssm_conv_dim} x {spec.ssm_conv}), one sequence, the "
            "state read from and written back to its pool slot; then whole decode steps of the model with one or "
            f"the other, alternating, {args.rounds} rounds of {args.n} tokens, medians.\n\n"
            "| step | one layer, ms | decode ms/token (rounds) | tok/s |\n|---|---:|---:|---:|\n" + rows + "\n")
    print(text)
    if args.append:
        append_section(text)


if __name__ == "__main__":
    main()
