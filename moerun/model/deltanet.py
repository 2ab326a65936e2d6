"""Gated DeltaNet, the linear attention of Qwen3-Next and Qwen3.5 (a shared layer, as attention is).

Per sequence and layer the state is fixed-size: the causal conv1d's last kernel - 1 inputs [C, K-1] and one
matrix per value head S [nv, dk, dv]. A token's q, k (key heads, repeated onto the value heads) and v come
from the conv1d (then SiLU); q and k are L2-normalised, q scaled by dk ** -0.5; with the decay
g = ssm_a * softplus(alpha + dt_bias) (ssm_a = -exp(A_log) < 0) and beta = sigmoid(beta_logit):

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q            (the delta rule, per value head)

then o is RMS-normed per head, times silu(z), and projected out. Decode steps run the rule token by token
(`delta_step`, any number of sequences at once); prompt chunks run its chunked form (`delta_chunked`: 64
positions at a time, within a chunk a triangular solve and matrix products, across chunks the state), which
computes the same values up to rounding. On the CPU with the kernels built, prompt chunks run the conv1d, the
recurrence and the gated norm in C instead (moerun.kernels.delta: conv_prompt, delta_prompt; tested against
`conv_prompt`, `delta_steps` and `gated_norm`). The state is float32 whatever the compute type.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # positions per block of the chunked form (the reference implementations' size)
STEP_T = 8  # up to this many positions of one sequence run the recurrence step by step (delta_steps)


def conv_prompt(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv1d + SiLU over one sequence's x [T, C] continuing `state` [C, K-1] (None: zeros)
    with w [C, K] -> (y [T, C], the new state [C, K-1]: the last K - 1 inputs)."""
    T, C = x.shape
    K = w.shape[1]
    prev = torch.zeros((C, K - 1), dtype=x.dtype, device=x.device) if state is None else state.to(x.dtype)
    if T <= STEP_T:  # step by step, as a decode batch computes it: a few positions do not pay for a convolution
        out, s = [], prev[None]
        for t in range(T):
            y, s = conv_step(x[t:t + 1], w, s)
            out.append(y)
        return torch.cat(out), s[0]
    xx = torch.cat((prev, x.t()), dim=1)  # [C, K-1+T]
    y = F.conv1d(xx[None], w.to(x.dtype)[:, None, :], groups=C)[0]  # [C, T]
    return F.silu(y.t()), xx[:, -(K - 1):] if K > 1 else xx[:, :0]


def conv_step(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One position of B sequences: x [B, C], state [B, C, K-1] -> (y [B, C], new state [B, C, K-1])."""
    xx = torch.cat((state.to(x.dtype), x[:, :, None]), dim=2)  # [B, C, K]
    return F.silu((xx * w.to(x.dtype)).sum(-1)), xx[:, :, 1:]


def _prepare(q: torch.Tensor, k: torch.Tensor, n_v: int, order: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [.., nk, dk] -> L2-normalised, q scaled, repeated onto the n_v value heads [.., nv, dk] float32."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    r = n_v // q.shape[-2]
    if r > 1:
        if order == "grouped":  # value head j reads key head j // r
            q, k = q.repeat_interleave(r, dim=-2), k.repeat_interleave(r, dim=-2)
        else:  # tiled: value head j reads key head j % nk
            reps = (1,) * (q.dim() - 2) + (r, 1)
            q, k = q.repeat(reps), k.repeat(reps)
    return q, k


def delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, order: str = "grouped") -> tuple[torch.Tensor, torch.Tensor]:
    """One position of B sequences. q, k [B, nk, dk]; v [B, nv, dv]; g, beta [B, nv]; state [B, nv, dk, dv]
    -> (o [B, nv, dv] float32, the new state)."""
    q, k = _prepare(q, k, v.shape[-2], order)  # [B, nv, dk]
    s = state.float() * g.float().exp()[..., None, None]
    kv_mem = (k.unsqueeze(-2) @ s).squeeze(-2)  # [B, nv, dv]: S^T k (batched products: 16x the broadcast sums)
    delta = (v.float() - kv_mem) * beta.float()[..., None]
    s = s.addcmul_(k.unsqueeze(-1), delta.unsqueeze(-2))
    return (q.unsqueeze(-2) @ s).squeeze(-2), s


def delta_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor | None, order: str = "grouped") -> tuple[torch.Tensor, torch.Tensor]:
    """T positions of one sequence, one step each (delta_chunked's arguments and results)."""
    s = (torch.zeros((v.shape[1], q.shape[2], v.shape[2]), device=v.device) if state is None else state)[None]
    out = []
    for t in range(v.shape[0]):
        o, s = delta_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s, order)
        out.append(o)
    return torch.cat(out), s[0]


def delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor | None, order: str = "grouped") -> tuple[torch.Tensor, torch.Tensor]:
    """T positions of one sequence in blocks of CHUNK. q, k [T, nk, dk]; v [T, nv, dv]; g, beta [T, nv]; state
    [nv, dk, dv] (None: zeros) -> (o [T, nv, dv] float32, the state after the last position)."""
    T, nv, dv = v.shape
    q, k = _prepare(q, k, nv, order)
    dk = q.shape[-1]
    pad = (-T) % CHUNK
    n = (T + pad) // CHUNK

    def blocks(t: torch.Tensor) -> torch.Tensor:  # [T, nv, ...] -> [nv, n, CHUNK, ...] (zero-padded)
        t = t.float().movedim(0, 1)
        t = F.pad(t, (0, 0, 0, pad)) if t.dim() == 3 else F.pad(t, (0, pad))
        return t.reshape(nv, n, CHUNK, *t.shape[2:])

    q, k, v, g, beta = blocks(q), blocks(k), blocks(v), blocks(g), blocks(beta)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)  # [nv, n, C]: log of the decay from the block's start
    dev = v.device
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=dev).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [nv, n, C, C]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # the UT system's strictly lower part, and its diagonal
    system = system.masked_fill(~torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=dev).tril(-1), 0.0)
    eye = torch.eye(CHUNK, device=dev)
    u = torch.linalg.solve_triangular(system + eye, v_beta, upper=False, unitriangular=True)  # [nv, n, C, dv]
    w = torch.linalg.solve_triangular(system + eye, k_beta * cum.exp()[..., None], upper=False,
                                      unitriangular=True)  # [nv, n, C, dk]
    intra = (q @ k.transpose(-1, -2)) * decay  # [nv, n, C, C] (causal: decay is 0 above the diagonal)
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    block_decay = cum[..., -1].exp()  # [nv, n]
    s = torch.zeros((nv, dk, dv), device=dev) if state is None else state.float()
    out = torch.empty((nv, n, CHUNK, dv), device=dev)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ s  # [nv, C, dv]: what the block writes beyond what the state predicts
        out[:, i] = q_dec[:, i] @ s + intra[:, i] @ v_new
        s = s * block_decay[:, i, None, None] + k_dec[:, i].transpose(-1, -2) @ v_new
    return out.reshape(nv, n * CHUNK, dv)[:, :T].movedim(0, 1), s


def gated_norm(o: torch.Tensor, w: torch.Tensor, z: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of each head's output o [.., dv] (weight w [dv]) times silu(z), in float32 (as the reference)."""
    o = F.rms_norm(o.float(), (o.shape[-1],), eps=eps)
    return w.float() * o * F.silu(z.float())
