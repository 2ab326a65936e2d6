"""The layer probe (issue 15, item 6): decode and prefill through this model's own layers, built in memory.

A model's speed is its layers' speed: the same kernels on the same layouts, the same thread pool, the same
working set. The probe builds models of one and of three of the model's MoE layers (its attention, router,
experts and their qtypes; random weights, since the values do not change the speed; laid out as load_model
holds weights in RAM: huge pages, the kernels' interleaved layout), decodes and prefills on them in turns,
and reports the time the cost model's byte and FLOP terms do not explain: seconds per layer (the slope
between one and three layers) and per step (the intercept). The estimate for the model in RAM then
reproduces what its own layers measured, and every other placement (an expert cache, the file, a GPU) reuses
the same terms.

The probe keeps the model's routing width (top-k) and caps its experts so that a layer's expert bytes stay
near PROBE_EXPERT_BYTES, and never fewer than k: a token reads k experts either way, from a working set far
larger than the CPU's caches. Prefill runs a PROBE_PROMPT-token prompt, so the dense projections see the long
products a real prompt gives them, on the same weights routed to fewer experts per token (`prefill_k`) so
that each expert gets as many tokens as a 512-token prompt gives it in the model: both kinds of product keep
their real shapes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import statistics
from collections import Counter

from moerun.arch.spec import ModelSpec, Yarn
from moerun.formats.names import CName

PROBE_EXPERT_BYTES = 64 << 20  # a probe layer's routed experts, about: far beyond any L3
PROBE_VOCAB = 256
MODEL_PROMPT = 512  # the prompt whose tokens-per-expert the probe's prompt matches
PROBE_PROMPT = 256


def probe_layout(arch) -> dict:
    """What the probe builds for `arch`, as JSON-able data: the spec of its layers (every field but the layer
    count and what depends on it), the qtype of each tensor kind (the most common over the file's layers),
    how many experts and, for prefill, how many of them a token takes. `layout_key` names it in the cache."""
    spec = arch.spec
    kinds: dict[str, Counter] = {}
    for cn, src in arch.sources.items():
        kinds.setdefault(cn.kind, Counter())[src.records[0].qtype.name] += 1
    qtypes = {k: c.most_common(1)[0][0] for k, c in sorted(kinds.items())}
    first = next((i for i, m in enumerate(spec.moe_layers) if m), None)
    if first is None:
        return {}
    kinds_from = [spec.layer_kinds[i] for i in range(first, spec.n_layers)] if spec.layer_kinds else []
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    for name in ("n_layers", "moe_layers", "layer_kinds", "vocab", "context_length", "n_experts", "n_groups",
                 "topk_groups"):
        fields.pop(name)
    fields["yarn"] = dataclasses.asdict(spec.yarn) if spec.yarn else None
    k = max(spec.n_experts_used, 1)
    expert_bytes = _expert_bytes(spec, qtypes)
    experts = min(spec.n_experts, max(k, math.ceil(PROBE_EXPERT_BYTES / max(expert_bytes, 1))))
    per_expert = MODEL_PROMPT * k / spec.n_experts  # tokens each expert gets from a 512-token prompt
    prefill_k = max(1, min(k, round(per_expert * experts / PROBE_PROMPT)))
    return {"spec": fields, "qtypes": qtypes, "experts": experts, "prompt": PROBE_PROMPT, "prefill_k": prefill_k,
            "layer_kinds": kinds_from}


def layout_key(layout: dict) -> str:
    text = json.dumps(layout, sort_keys=True, default=str)
    return f"{layout['spec']['family']}-{hashlib.sha1(text.encode()).hexdigest()[:12]}"


def _expert_bytes(spec: ModelSpec, qtypes: dict[str, str]) -> int:
    """Bytes of one routed expert (gate, up, down) in the probe's qtypes."""
    from moerun.quant.ggml_types import QType, tensor_bytes

    H, I = spec.hidden, spec.expert_ffn
    return sum(tensor_bytes(QType[qtypes.get(kind, "F32")], shape) for kind, shape in
               (("ffn_gate_exps.weight", (I, H)), ("ffn_up_exps.weight", (I, H)), ("ffn_down_exps.weight", (H, I))))


def probe_spec(layout: dict, n_layers: int, k: int | None = None) -> ModelSpec:
    """The probe model's spec: `n_layers` MoE layers of the layout's kind (its attention kinds in turn), no
    expert groups (they choose which experts, not how many), a small vocabulary; k: experts per token (default:
    the model's)."""
    kinds = layout["layer_kinds"]
    fields = dict(layout["spec"], yarn=Yarn(**layout["spec"]["yarn"]) if layout["spec"]["yarn"] else None)
    if k:
        fields["n_experts_used"] = k
    return ModelSpec(**fields, n_layers=n_layers, moe_layers=(True,) * n_layers,
                     layer_kinds=tuple(kinds[i % len(kinds)] for i in range(n_layers)) if kinds else (),
                     vocab=PROBE_VOCAB, context_length=4 * MODEL_PROMPT, n_experts=layout["experts"])


class Tiles:
    """Weights of any shape in a quantized type, as load_model holds them in RAM, made fast: 8 rows quantized
    once per (qtype, row length) and tiled over the rows (on huge pages), in the kernels' interleaved layout
    where they take it (interleaving identical groups of 8 rows and then tiling them is interleaving the tiled
    rows). The values do not change the kernels' speed."""

    def __init__(self, seed: int = 0):
        import torch

        try:
            from moerun.kernels import cpu
        except ImportError:
            cpu = None
        self.cpu = cpu if cpu is not None and cpu.available() else None
        self.g = torch.Generator().manual_seed(seed)
        self.rows8: dict[tuple, object] = {}

    def __call__(self, qtype, shape: tuple[int, ...], interleave: bool = True):
        import torch

        from moerun.hostmem import host_empty
        from moerun.quant.qtypes import FLOAT_QTYPES, QTensor
        from moerun.quant.quantize import quantize

        if qtype in FLOAT_QTYPES:
            t = (0.02 * torch.randn(shape, generator=self.g)).to(FLOAT_QTYPES[qtype])
            return QTensor.from_float(t if len(shape) > 1 else 1 + t)
        K, rows = shape[-1], math.prod(shape[:-1])
        layout = 8 if interleave and rows % 8 == 0 and self.cpu is not None else 1
        if (qtype, K, layout) not in self.rows8:
            base = QTensor.from_bytes(quantize(torch.randn(8, K, generator=self.g), qtype), qtype, (8, K))
            if layout == 8 and self.cpu.can_interleave(base):
                base = self.cpu.interleave(base)
            self.rows8[qtype, K, layout] = base
        base = self.rows8[qtype, K, layout]
        rb = base.data.shape[-1]
        data = host_empty(rows * rb)
        group = base.data.reshape(-1)
        n = min(len(group), len(data))
        data[:n] = group[:n]
        while n < len(data):  # doubling copies: memcpy speed
            m = min(n, len(data) - n)
            data[n:n + m] = data[:m]
            n += m
        return QTensor(data.view(*shape[:-1], rb), qtype, tuple(shape), base.interleave if rows % 8 == 0 else 1)


def build_weights(layout: dict, spec: ModelSpec) -> dict:
    """Every tensor `spec` reads, in the layout's qtypes (vectors float32), as load_model holds it in RAM."""
    from moerun.arch.tensors import expected_shapes
    from moerun.quant.qtypes import QType

    tiles = Tiles()
    return {cn: tiles(QType[layout["qtypes"].get(cn.kind, "F32")] if len(shape) > 1 else QType.F32, shape,
                      interleave=cn.kind != "token_embd.weight")
            for cn, shape in expected_shapes(spec).items()}


def _parts(spec: ModelSpec, weights: dict[CName, object]):
    from moerun.placement.costmodel import parts_from_tensors

    return parts_from_tensors(spec, ((cn, t.qtype, t.shape) for cn, t in weights.items()))


def measure_layers(threads: int, layout: dict, rates, *, rounds: int = 8, n_gen: int = 12,
                   prompt_runs: int = 1) -> dict:
    """Decode `n_gen` tokens on probe models of 1 and 3 layers, one after the other, `rounds` times (the first
    warms up), then prefill the layout's prompt `prompt_runs` times on each; subtract what the cost model
    predicts for each from its byte and FLOP terms at `rates` (no overheads) and fit per layer and per step.
    The per-layer figure is the median over rounds of that round's difference, so a drift of the machine's
    bandwidth during the probe cancels. -> {"layer_s", "token_s", "prefill_layer_token_s", "residual_s"}."""
    import torch

    from moerun.engine.kv_cache import KVPool, SeqKV
    from moerun.model.model import MoEModel
    from moerun.model.ops import thread_budget
    from moerun.model.timing import time_gen, time_prompt
    from moerun.placement.costmodel import Workload, decode_time, prefill_time, state_flops, state_parts

    bare = dataclasses.replace(rates, layer_overhead_s=dataclasses.replace(rates.layer_overhead_s, value=0.0),
                               token_overhead_s=dataclasses.replace(rates.token_overhead_s, value=0.0),
                               prefill_overhead_s=dataclasses.replace(rates.prefill_overhead_s, value=0.0))
    P = layout["prompt"]
    tokens = torch.randint(0, PROBE_VOCAB, (P,), generator=torch.Generator().manual_seed(0))
    w3 = build_weights(layout, probe_spec(layout, 3))
    probes = {}  # (layers, "decode" | "prefill") -> (model, pool, workload): the same weights, k or prefill_k
    for n in (1, 3):
        w = {cn: t for cn, t in w3.items() if cn.layer is None or cn.layer < n}  # one layer: the first's weights
        for phase, k in (("decode", None), ("prefill", layout["prefill_k"])):
            spec = probe_spec(layout, n, k)
            work = Workload(n, spec.n_experts, spec.n_experts_used, spec.hidden, spec.n_heads, spec.head_dim,
                            _parts(spec, w) + state_parts(spec), (1.0,) * n, "resident",
                            linear=tuple(spec.linear(i) for i in range(n)) if spec.hybrid else (),
                            state_flops=state_flops(spec) if spec.hybrid else 0.0)
            probes[n, phase] = (MoEModel(spec, w), KVPool(spec, P + n_gen + 16), work)

    def timed(fn, model, pool, n_tokens, *args) -> float:
        seq = SeqKV(pool, n_tokens + 4)
        try:
            return fn(model, seq, *args) / 1e9
        finally:
            seq.free()

    dec: dict[int, list[float]] = {1: [], 3: []}
    pre: dict[int, list[float]] = {1: [], 3: []}
    with thread_budget(threads):
        for _ in range(rounds):
            for n in (1, 3):
                model, pool, _ = probes[n, "decode"]
                dec[n].append(timed(time_gen, model, pool, n_gen, 1, n_gen) / n_gen)
        for _ in range(prompt_runs):
            for n in (1, 3):
                model, pool, _ = probes[n, "prefill"]
                pre[n].append(timed(time_prompt, model, pool, P, tokens, P))
    pred = {n: decode_time(probes[n, "decode"][2], bare).total for n in (1, 3)}
    slope = [((t3 - pred[3]) - (t1 - pred[1])) / 2 for t1, t3 in zip(dec[1][1:], dec[3][1:])]
    layer = statistics.median(slope)
    one = statistics.median(dec[1][1:]) - pred[1]
    ppred = {n: prefill_time(probes[n, "prefill"][2], bare, P, P).seconds for n in (1, 3)}
    pslope = [((t3 - ppred[3]) - (t1 - ppred[1])) / 2 / P for t1, t3 in zip(pre[1], pre[3])]
    return {"layer_s": max(layer, 0.0), "token_s": max(one - layer, 0.0),
            "prefill_layer_token_s": max(statistics.median(pslope), 0.0),
            "residual_s": {"decode": {"1": one, "3": statistics.median(dec[3][1:]) - pred[3]},
                           "prefill": {str(n): statistics.median(v) - ppred[n] for n, v in pre.items()}}}
