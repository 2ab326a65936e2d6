"""Small steps (decode) through the fused C attention block: one kernel call per layer does everything
before the experts (norms, q/k/v, RoPE, KV write, attention, output projection, residual, routing).

It replaces ~40 torch operations per layer when every weight it reads is a QTensor of a type the CPU
kernels take, or float32, and the model computes in float32 on the CPU (else `FusedAttention.build`
returns None and the model keeps its torch path, which stays the reference the tests compare with).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moerun.model.layers import rope_tables

if TYPE_CHECKING:
    from moerun.model.model import MoEModel


class FusedAttention:
    MAX_ROWS = 16  # above this (prefill chunks) torch's attention and GEMM paths are faster

    def __init__(self, model: MoEModel, cpu):
        s = model.spec
        self.cpu, self.spec = cpu, s
        qk_norm = None if s.qk_norm == "none" else s.qk_norm
        self.layers = [
            cpu.AttnLayer(hidden=s.hidden, n_heads=s.n_heads, n_kv_heads=s.n_kv_heads, head_dim=s.head_dim,
                          qk_norm=qk_norm, rope_style=s.rope_style, attn_norm=lw.attn_norm, ffn_norm=lw.ffn_norm,
                          wq=lw.wq, wk=lw.wk, wv=lw.wv, wo=lw.wo, q_norm=lw.q_norm, k_norm=lw.k_norm, bq=lw.bq,
                          bk=lw.bk, bv=lw.bv, router=lw.router, n_used=s.n_experts_used, norm_topk=s.norm_topk)
            for lw in model.layers]
        self._cos = self._sin = torch.empty((0, s.head_dim // 2))

    @staticmethod
    def build(model: MoEModel) -> FusedAttention | None:
        cpu = getattr(model.ops, "cpu", None)  # KernelOps carries the CPU kernels
        if cpu is None or model.dtype != torch.float32 or not hasattr(cpu, "AttnLayer"):
            return None
        try:
            return FusedAttention(model, cpu)
        except ValueError:  # a weight type or layout the fused block does not take
            return None

    def usable(self, n_rows: int, device: torch.device) -> bool:
        return n_rows <= self.MAX_ROWS and device.type == "cpu"

    def _rope(self, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [> top positions, head_dim / 2], grown by doubling and kept."""
        if self._cos.shape[0] <= top:
            n = max(2 * self._cos.shape[0], top + 1, 256)
            self._cos, self._sin = (t.contiguous() for t in
                                    rope_tables(torch.arange(n), self.spec.head_dim, self.spec.rope_theta))
        return self._cos, self._sin

    def rows(self, slot_tables: list[torch.Tensor], pos: torch.Tensor):
        """One step's rows (row r at position pos[r] of the sequence with slot table slot_tables[r])."""
        return self.cpu.AttnRows(slot_tables, pos, *self._rope(int(pos.max())))

    def __call__(self, i: int, x: torch.Tensor, rows, k_cache: torch.Tensor, v_cache: torch.Tensor):
        """x [B, H] += layer i's attention (in place) -> (ffn-normed x, ids [B, k], weights [B, k])."""
        return self.cpu.attn_block(self.layers[i], x, rows, k_cache, v_cache, self.spec.rms_eps, self.spec.clip_qkv)
