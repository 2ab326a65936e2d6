"""Parameter and byte counts of a resolved model: totals, per token, per tensor class and qtype; the KV cache
and recurrent state one sequence holds.

Pure arithmetic over the records and the spec (no weights read); `moerun inspect` prints it and the cost model
(`moerun estimate`) builds on it. Linear-attention layers' tensors are dense ("attention", "norms"): every
token reads them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from moerun.arch import Arch
from moerun.arch.spec import ModelSpec
from moerun.arch.tensors import source_shape
from moerun.formats.names import tensor_class
from moerun.quant.ggml_types import tensor_bytes


@dataclass
class Summary:
    total_params: int = 0
    active_params: int = 0  # per token: everything but routed experts, plus k of E routed experts
    expert_params: int = 0  # routed experts, all of them
    total_bytes: int = 0
    bytes_per_token: int = 0  # weight bytes read to generate one token (one embedding row, k of E experts)
    by_class: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))

    def to_dict(self) -> dict:
        return {"total_params": self.total_params, "active_params": self.active_params,
                "expert_params": self.expert_params, "total_bytes": self.total_bytes,
                "bytes_per_token": self.bytes_per_token,
                "bytes_by_class": {c: dict(q) for c, q in sorted(self.by_class.items())}}


def summarize(arch: Arch) -> Summary:
    spec = arch.spec
    frac = spec.n_experts_used / spec.n_experts if spec.n_experts else 0.0
    s = Summary()
    active_expert_params = 0.0
    expert_bytes_read = 0.0
    for cn, src in arch.sources.items():
        shape = source_shape(src)
        qtype = src.records[0].qtype
        numel = 1
        for d in shape:
            numel *= d
        nbytes = tensor_bytes(qtype, shape)
        cls = tensor_class(cn.kind)
        s.total_params += numel
        s.total_bytes += nbytes
        s.by_class[cls][qtype.name] += nbytes
        if cls == "routed_experts":
            s.expert_params += numel
            active_expert_params += numel * frac
            expert_bytes_read += nbytes * frac
        elif cls == "embeddings":
            # one row is read per token, unless the table doubles as the LM head (read whole)
            s.bytes_per_token += nbytes if spec.tie_embeddings else nbytes // shape[0]
        else:
            s.bytes_per_token += nbytes
    s.active_params = s.total_params - s.expert_params + round(active_expert_params)
    s.bytes_per_token += round(expert_bytes_read)
    return s


@dataclass(frozen=True)
class SequenceBytes:
    """What one sequence holds besides the weights, for KV entries of `dtype_bytes`: KV bytes per position of
    the layers whose cache grows with the context (full attention, MLA's latent); the fixed bytes of the
    sliding layers' rings (moerun.engine.kv_cache) and of the linear layers' recurrent state (float32, one
    copy)."""

    kv_per_token: int
    window_bytes: int
    state_bytes: int
    kv_layers: int  # layers whose cache grows with the context
    window_layers: int
    linear_layers: int

    def at(self, positions: int) -> int:
        """Bytes of one sequence of `positions` positions, the windows full (positions past them)."""
        return positions * self.kv_per_token + self.window_bytes + self.state_bytes if positions > 0 else 0

    def to_dict(self) -> dict:
        return {"kv_bytes_per_token": self.kv_per_token, "kv_window_bytes": self.window_bytes,
                "state_bytes_per_seq": self.state_bytes}


def sequence_bytes(spec: ModelSpec, dtype_bytes: int = 4) -> SequenceBytes:
    """SequenceBytes of `spec` (windows' rings at the model's context: full)."""
    grow = window = n_grow = n_window = 0
    for i in range(spec.n_layers):
        lay = spec.kv_layout(i)
        if lay is None:
            continue
        if lay.window:
            window += spec.kv_bytes(i, spec.context_length, dtype_bytes)
            n_window += 1
        else:
            grow += lay.elems() * dtype_bytes
            n_grow += 1
    n_linear = sum(spec.linear(i) for i in range(spec.n_layers))
    return SequenceBytes(grow, window, spec.state_bytes(), n_grow, n_window, n_linear)
