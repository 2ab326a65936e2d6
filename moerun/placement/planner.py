"""Placement planner, pure: (Arch, Inventory, Budgets) -> Plan. No torch allocation, no I/O.

Order (DESIGN.md decisions 3 and 7): dense weights (attention, routers, norms, shared experts, embeddings
with the first stage, head with the last) on the compute device(s), then the KV reserve, then as many
expert cache slots per layer as the budget left allows. Routed experts live in the home tier: host RAM
when it fits the RAM budget, else the memory-mapped file ("disk"). llama.cpp's --n-cpu-moe,
--override-tensor (-ot REGEX=DEVICE, searched in GGUF names, first match wins) and --tensor-split keep
their meaning. Tiers: "vram", "ram", "disk".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from moerun.arch.tensors import source_shape
from moerun.device import canonical
from moerun.errors import MoerunError
from moerun.formats.names import tensor_class
from moerun.placement.devices import Inventory, format_size
from moerun.quant.ggml_types import tensor_bytes

MiB = 1 << 20
STREAM_CHUNK = 8  # experts per half of a device stage's prefill stream buffer (double-buffered)
# copies of a linear layer's recurrent state a context holds: the live state, one checkpoint for prefix reuse
STATE_COPIES = 2


class PlanError(MoerunError):
    """The budgets cannot hold what must be placed; the message says what would fit."""


def parse_device(name: str) -> str:
    """llama.cpp's CPU / CUDA0 (or cpu / cuda:0 / cuda0 / standin:0) -> 'cpu' / 'cuda:0' / 'standin:0'."""
    return canonical(name)


def workspace_bytes(spec, ubatch: int, ctx_size: int, stream_expert_bytes: int) -> int:
    """Device memory a stage needs besides weights, KV and slots, for one prompt chunk of `ubatch` tokens:
    float32 activations (hidden states, q/k/v, the routed pairs' rows and hidden units), the prompt attention's
    workspace over the context (attention_workspace_bytes), the last token's logits, and the prefill stream's
    double buffer of STREAM_CHUNK experts per half. A linear layer's q/k/v (the conv1d's channels), gate, beta
    and alpha and output in place of attention's q/k/v where wider."""
    t, k = ubatch, max(spec.n_experts_used, 1)
    attn = spec.q_dim * (2 if spec.attn_gate else 1) + 2 * spec.kv_dim
    if spec.hybrid:
        attn = max(attn, spec.ssm_conv_dim + 2 * spec.ssm_value_dim + 2 * spec.ssm_v_heads)
    act = 4 * t * (4 * spec.hidden + attn + k * (spec.hidden + 2 * spec.expert_ffn))
    return act + attention_workspace_bytes(spec, t, ctx_size) + 4 * spec.vocab + 2 * STREAM_CHUNK * stream_expert_bytes


MASK_BYTES = 9  # per (query, key): the bool mask, its additive form in the compute dtype and that padded (float32)


def attention_fused(spec) -> bool:
    """Whether a device's prompt attention runs in kernels that never hold the scores (layers.attend_fused:
    flash / memory-efficient SDPA; they take head dims in multiples of 8, else SDPA's math path)."""
    dv = spec.v_head_dim if spec.attention == "mla" else spec.head_dim
    return not spec.attn_sinks and spec.head_dim % 8 == 0 and dv % 8 == 0


def attention_workspace_bytes(spec, ubatch: int, ctx_size: int) -> int:
    """Transient bytes of one layer's prompt attention on a device stage (the stand-in budgeted as the GPU it
    stands in for), for a chunk of `ubatch` queries over `ctx_size` keys (the context's last chunk), float32 at
    worst; linear in ctx_size. Fused kernels (attention_fused): the mask from the positions only (MASK_BYTES
    per query and key; none where callers pass q_start and no window cuts in, not counted on). SDPA's math
    path: float32 scores and probabilities [nh, T, S] too. Sinks (the two-matmul form, QUERY_BLOCK queries at a
    time): the scores, the sink's column joined to them and their softmax. MLA's expanded form: every head's
    keys and values made from the latents, [nh, S, nope + rope + v], and the nope part's product."""
    from moerun.model.layers import QUERY_BLOCK, SMALL_T

    t, s, nh = ubatch, ctx_size, spec.n_heads
    if t <= SMALL_T:  # a chunk of decode size: the two-matmul form
        work = 3 * 4 * nh * t * s + MASK_BYTES * t * s
    elif spec.attn_sinks:
        rows = min(t, QUERY_BLOCK)
        work = 3 * 4 * nh * rows * (s + 1) + MASK_BYTES * rows * s
    elif attention_fused(spec):
        work = MASK_BYTES * t * s
    else:
        work = 2 * 4 * nh * t * s + MASK_BYTES * t * s
    if spec.attention == "mla" and t > SMALL_T:
        work += 4 * nh * s * (spec.qk_nope_dim + spec.head_dim + spec.v_head_dim)
    return work


def parse_override(text: str) -> tuple[tuple[str, str], ...]:
    """llama.cpp's -ot value 'REGEX=DEVICE[,REGEX=DEVICE...]' -> ((regex, 'cpu' | 'cuda:N'), ...)."""
    out = []
    for part in text.split(","):
        pattern, sep, dev = part.rpartition("=")
        if not sep or not pattern:
            raise ValueError(f"override {part!r} is not REGEX=DEVICE (e.g. exps=CPU)")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"override {part!r}: bad regular expression: {e}") from None
        out.append((pattern, parse_device(dev)))
    return tuple(out)


@dataclass(frozen=True)
class Budgets:
    """What the user allows. vram: bytes per device (one figure for all, or one per device); None: free memory.
    ram: bytes; None: available RAM. cache_mib caps each device's expert cache; cache_slots caps slots per layer.
    A device named twice holds two stages, which share its budget. ubatch: prompt chunk (device workspace)."""

    devices: tuple[str, ...] = ("cpu",)
    vram: int | tuple[int, ...] | None = None
    ram: int | None = None
    cache_mib: float | None = None
    cache_slots: int | None = None
    ctx_size: int = 4096
    kv_dtype_bytes: float = 2  # bytes per key value of the KV cache (a quantized type's: a fraction)
    kv_v_bytes: float | None = None  # per value value; None: as the keys
    n_cpu_moe: int = 0
    override_tensor: tuple[tuple[str, str], ...] = ()
    tensor_split: tuple[float, ...] | None = None
    ubatch: int = 512
    kv_contexts: int = 1  # contexts of KV and state the devices hold (serve's -np); CPU plans count one

    def __post_init__(self):
        devs = tuple(parse_device(d) for d in self.devices)
        object.__setattr__(self, "devices", devs)
        cpu_stages = bool(devs) and set(devs) == {"cpu"}  # cpu,cpu: stages sharing the host (how splits are tested)
        if not devs:
            raise ValueError("devices must not be empty")
        if "cpu" in devs and not cpu_stages:
            raise ValueError("the compute devices are either 'cpu' (one or more stages) or GPUs (cuda:N, standin:N)")
        if len({d.split(":")[0] for d in devs}) > 1:
            raise ValueError(f"the stages' devices are all GPUs or all stand-ins, not both: {list(devs)}")
        if self.ubatch <= 0 or self.kv_contexts <= 0:
            raise ValueError(f"ubatch and kv_contexts must be positive, got {self.ubatch}, {self.kv_contexts}")
        if isinstance(self.vram, (list, tuple)):
            object.__setattr__(self, "vram", tuple(self.vram))
            n = len(dict.fromkeys(devs))
            if len(self.vram) != n:
                raise ValueError(f"{len(self.vram)} VRAM budgets for {n} devices")
        for name in ("ram", "cache_mib", "cache_slots"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{name} must not be negative, got {v}")
        if any(v < 0 for v in (self.vram if isinstance(self.vram, tuple) else (self.vram or 0,))):
            raise ValueError("VRAM budgets must not be negative")
        if self.cache_mib is not None and self.cache_slots is not None:
            raise ValueError("give the expert cache size in MiB or in slots, not both")
        if self.ctx_size <= 0 or self.kv_dtype_bytes <= 0 or self.n_cpu_moe < 0:
            raise ValueError("ctx_size and kv_dtype_bytes must be positive and n_cpu_moe not negative")
        object.__setattr__(self, "override_tensor", tuple((p, parse_device(d)) for p, d in self.override_tensor))
        for _, d in self.override_tensor:
            if d != "cpu" and d not in devs:
                raise ValueError(f"--override-tensor names {d}, which is not among the devices {list(devs)}")
        if self.tensor_split is not None:
            object.__setattr__(self, "tensor_split", tuple(float(x) for x in self.tensor_split))
            if len(self.tensor_split) != len(devs) or min(self.tensor_split) < 0 or sum(self.tensor_split) <= 0:
                raise ValueError(f"tensor_split needs {len(devs)} non-negative proportions, got {self.tensor_split}")


@dataclass(frozen=True)
class DevicePlan:
    device: str
    layers: tuple[int, int]  # [start, stop)
    budget: int
    dense_bytes: int  # everything resident here that is not KV or cache (incl. tensors pinned by -ot)
    kv_bytes: int  # KV cache and linear layers' recurrent state (STATE_COPIES per context), all contexts
    expert_slots: tuple[int, ...]  # per layer of the range; 0: experts computed at home / pinned / none
    cache_bytes: int
    workspace_bytes: int = 0  # activations and the prefill stream buffer (device stages)
    state_bytes: int = 0  # of kv_bytes: the linear layers' recurrent state

    @property
    def used_bytes(self) -> int:
        return self.dense_bytes + self.kv_bytes + self.cache_bytes + self.workspace_bytes


@dataclass(frozen=True)
class TensorPlan:
    device: str  # where it is computed
    tier: str  # where its bytes live: vram / ram / disk
    nbytes: int
    cached: bool = False  # routed experts served through the device's expert cache


@dataclass(frozen=True)
class RankPlan:
    """One expert-parallel rank's figures (moerun.placement.ep_plan): what it holds and its cache, sized from
    its own memory. owned / expert_slots: per layer of the model (0 where a layer has no routed experts);
    budget: its device's memory, or on the CPU its RAM (in one process, its share of the host's); dense_bytes /
    kv_bytes: 0 for a rank in one process whose device holds only experts."""

    rank: int
    device: str
    owned: tuple[int, ...]
    expert_bytes: int
    expert_slots: tuple[int, ...]
    cache_bytes: int
    home: str
    budget: int
    dense_bytes: int = 0
    kv_bytes: int = 0
    workspace_bytes: int = 0
    ram_bytes: int = 0  # host RAM it holds: its experts when home is ram, its CPU cache, CPU dense and KV


@dataclass(frozen=True)
class Plan:
    devices: tuple[DevicePlan, ...]
    home: str  # home tier of the routed experts: "ram" or "disk"
    ram_budget: int
    ram_bytes: int  # host RAM moerun holds: home experts (when home is ram), tensors on cpu, cpu cache
    tensors: dict[str, TensorPlan] = field(default_factory=dict)  # by GGUF name
    ctx_size: int = 0
    kv_bytes_per_token: int = 0  # one context's attention KV per position (windows averaged over ctx_size)
    state_bytes_per_seq: int = 0  # one context's recurrent state, STATE_COPIES of it (fixed: any ctx_size)
    ranks: tuple[RankPlan, ...] = ()  # expert parallelism: the ranks this process plans (the plan: the first's)

    def rank(self, r: int) -> RankPlan | None:
        return next((rp for rp in self.ranks if rp.rank == r), None)

    def context_bytes(self, ctx: int | None = None) -> int:
        """KV and recurrent state one context of `ctx` positions (default: ctx_size) holds."""
        return (self.ctx_size if ctx is None else ctx) * self.kv_bytes_per_token + self.state_bytes_per_seq

    def layer_device(self, layer: int) -> str:
        for d in self.devices:
            if d.layers[0] <= layer < d.layers[1]:
                return d.device
        raise KeyError(layer)

    def totals(self) -> dict:
        t = {"vram": 0, "ram": 0, "disk": 0}
        for tp in self.tensors.values():
            t[tp.tier] += tp.nbytes
        return {"model_bytes": sum(t.values()), "bytes_by_tier": t, "ram_bytes": self.ram_bytes,
                "kv_bytes": sum(d.kv_bytes for d in self.devices),
                "cache_bytes": sum(d.cache_bytes for d in self.devices)}

    def to_json(self) -> dict:
        return {"devices": [{**d.__dict__, "layers": list(d.layers), "expert_slots": list(d.expert_slots)}
                            for d in self.devices],
                "home": self.home, "ram_budget": self.ram_budget, "ram_bytes": self.ram_bytes,
                "ctx_size": self.ctx_size, "kv_bytes_per_token": self.kv_bytes_per_token,
                "state_bytes_per_seq": self.state_bytes_per_seq,
                "ranks": [{**r.__dict__, "owned": list(r.owned), "expert_slots": list(r.expert_slots)}
                          for r in self.ranks],
                "tensors": {n: dict(t.__dict__) for n, t in sorted(self.tensors.items())},
                "totals": self.totals()}

    @classmethod
    def from_json(cls, d: dict) -> Plan:
        devs = tuple(DevicePlan(**{**x, "layers": tuple(x["layers"]), "expert_slots": tuple(x["expert_slots"])})
                     for x in d["devices"])
        return cls(devs, d["home"], d["ram_budget"], d["ram_bytes"],
                   {n: TensorPlan(**t) for n, t in d["tensors"].items()}, d["ctx_size"],
                   d["kv_bytes_per_token"], d.get("state_bytes_per_seq", 0),
                   tuple(RankPlan(**{**r, "owned": tuple(r["owned"]),
                                     "expert_slots": tuple(r["expert_slots"])}) for r in d.get("ranks", ())))

    def table(self) -> str:
        rows = [("device", "layers", "dense", "KV", "expert slots", "cache", "workspace", "budget")]
        for d in self.devices:
            slots = sorted({s for s in d.expert_slots})
            rows.append((d.device, f"{d.layers[0]}-{d.layers[1] - 1}" if d.layers[1] > d.layers[0] else "-",
                         format_size(d.dense_bytes), format_size(d.kv_bytes),
                         "-" if slots in ([], [0]) else "/".join(map(str, slots)) + " per layer",
                         format_size(d.cache_bytes), format_size(d.workspace_bytes) if d.workspace_bytes else "-",
                         format_size(d.budget)))
        home = sum(t.nbytes for t in self.tensors.values() if t.tier == self.home and t.tier != "vram")
        rows.append((f"home ({self.home})", "", "", "", "", format_size(home), "", format_size(self.ram_budget)
                     if self.home == "ram" else "mmap"))
        lines = _grid(rows)
        if self.ranks:  # expert parallelism: each rank's share, cache and home, from its own memory
            rows = [("rank", "device", "experts", "expert bytes", "expert slots", "cache", "home", "budget")]
            for r in self.ranks:
                slots = sorted({s for s, n in zip(r.expert_slots, r.owned) if n})
                per = "/".join(map(str, sorted(set(r.owned) - {0})))
                rows.append((str(r.rank), r.device, f"{sum(r.owned)} ({per} per layer)", format_size(r.expert_bytes),
                             "-" if slots in ([], [0]) else "/".join(map(str, slots)) + " per layer",
                             format_size(r.cache_bytes), "mmap" if r.home == "disk" else r.home,
                             format_size(r.budget)))
            lines += [""] + _grid(rows)
        return "\n".join(lines)


def _grid(rows: list[tuple[str, ...]]) -> list[str]:
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    lines.insert(1, "-+-".join("-" * x for x in w))
    return lines


def _split_layers(n: int, weights: list[float]) -> list[tuple[int, int]]:
    """Contiguous ranges covering range(n), sized in proportion to `weights` (cumulative rounding)."""
    total, acc, bounds = sum(weights), 0.0, [0]
    for w in weights:
        acc += w
        bounds.append(round(n * acc / total))
    bounds[-1] = n
    return [(bounds[i], bounds[i + 1]) for i in range(len(weights))]


def plan(arch, inventory: Inventory, budgets: Budgets, owned: dict[int, int] | None = None,
         dense: bool = True) -> Plan:
    """owned: MoE layer -> how many of its routed experts this plan holds (an expert-parallel rank's shard,
    moerun.placement.ep_plan; None: all); a layer's cache never has more slots than it holds. dense: False for
    a rank that holds only its experts (in one process, rank 0's device holds the dense part and the KV)."""
    spec, devs = arch.spec, budgets.devices
    L, E = spec.n_layers, spec.n_experts
    held = [E if owned is None else owned.get(i, E) for i in range(L)]
    overrides = list(budgets.override_tensor)
    if devs != ("cpu",):
        overrides += [(rf"^blk\.{i}\.ffn_(up|down|gate)_exps", "cpu") for i in range(min(budgets.n_cpu_moe, L))]
    # KV bytes of one context, per layer (spec.kv_layout: what each layer's cache holds; windows capped); a
    # linear layer's: STATE_COPIES of its recurrent state, whatever the context
    kv_layer, state_layer = _context_bytes(spec, budgets)
    if not dense:
        kv_layer, state_layer = [0] * L, [0] * L
    ram_budget = inventory.ram_available if budgets.ram is None else budgets.ram

    # every tensor: bytes, class, override
    info: dict[str, tuple] = {}  # name -> (layer, expert?, nbytes, override device | None)
    for cn, src in arch.sources.items():
        name = cn.gguf
        ov = next((d for p, d in overrides if re.search(p, name)), None)
        nbytes = tensor_bytes(src.records[0].qtype, source_shape(src))
        is_exp = tensor_class(cn.kind) == "routed_experts"
        if is_exp and E and cn.layer is not None:
            nbytes = nbytes // E * held[cn.layer]  # the shard's experts
        elif not is_exp and not dense:
            nbytes = 0
        info[name] = (cn.layer, is_exp, nbytes, ov, cn.kind)
    exp_bytes = [0] * L  # routed expert bytes per layer, counted only where served by a cache
    cached_layer = [False] * L
    for i in range(L):  # a slot holds an expert's matrices; their biases (gpt-oss) stay with the layer
        names = [n for n, v in info.items() if v[0] == i and v[1] and v[4].endswith(".weight")]
        cached_layer[i] = bool(names) and all(info[n][3] is None for n in names)
        exp_bytes[i] = sum(info[n][2] for n in names) if cached_layer[i] else 0
    slot_b = [b // h if h else 0 for b, h in zip(exp_bytes, held)]

    if set(devs) == {"cpu"}:
        return _plan_cpu(spec, info, budgets, ram_budget, kv_layer, state_layer, slot_b, held)

    phys = list(dict.fromkeys(devs))  # a device named twice holds two stages sharing its budget
    try:
        free = {d: inventory.gpu(d).free_bytes for d in phys}
    except KeyError as e:
        raise PlanError(f"{e.args[0]}; use --device cpu or --gpus with the GPUs present") from None
    given = budgets.vram if isinstance(budgets.vram, tuple) else [budgets.vram] * len(phys)
    whole = {d: (b if b is not None else free[d]) for d, b in zip(phys, given)}
    budget = {d: whole[d] // devs.count(d) for d in phys}
    # dense bytes each layer brings to its stage; embeddings to the first, head and output norm to the last
    lay_dense, first, last, pinned = [0] * L, 0, 0, {d: 0 for d in phys}
    for name, (layer, is_exp, nbytes, ov, kind) in info.items():
        if ov is not None:
            if ov != "cpu":
                pinned[ov] += nbytes
        elif is_exp:
            pass
        elif layer is not None:
            lay_dense[layer] += nbytes
        elif kind == "token_embd.weight":
            first += nbytes
        else:
            last += nbytes

    def stage(d: str, k: int, r: tuple[int, int]) -> tuple[int, int, int, int]:
        """(dense, kv, workspace, slots) of device d holding layers r; slots -1 when dense + KV do not fit."""
        dense = (pinned[d] if devs.index(d) == k else 0) + sum(lay_dense[r[0]:r[1]]) + (first if k == 0 else 0) + (
            last if k == len(devs) - 1 else 0)
        kv = budgets.kv_contexts * sum(kv_layer[r[0]:r[1]])  # every context its own KV and state
        work = workspace_bytes(spec, budgets.ubatch, budgets.ctx_size, max(slot_b[r[0]:r[1]], default=0)) \
            if r[1] > r[0] else 0
        left, per = budget[d] - dense - kv - work, sum(slot_b[r[0]:r[1]])
        if left < 0:
            return dense, kv, work, -1
        slots = E if per == 0 else min(E, left // per)
        if budgets.cache_slots is not None:
            slots = min(slots, budgets.cache_slots)
        if budgets.cache_mib is not None and per:
            slots = min(slots, int(budgets.cache_mib * MiB // per))
        return dense, kv, work, slots

    ranges = _split_layers(L, list(budgets.tensor_split or [budget[d] for d in devs]))
    if budgets.tensor_split is None:  # move boundaries while it raises the smallest slot counts (maximin)
        def score(rs):
            return sorted(stage(d, k, r)[3] for k, (d, r) in enumerate(zip(devs, rs)))
        best, improved = score(ranges), True
        while improved:
            improved = False
            for b in range(1, len(devs)):
                for step in (-1, 1):
                    cut = ranges[b][0] + step
                    if not ranges[b - 1][0] <= cut <= ranges[b][1]:
                        continue
                    cand = ranges[:b - 1] + [(ranges[b - 1][0], cut), (cut, ranges[b][1])] + ranges[b + 1:]
                    s = score(cand)
                    if s > best:
                        ranges, best, improved = cand, s, True
    stages = []
    for k, (d, r) in enumerate(zip(devs, ranges)):
        dense, kv, work, slots = stage(d, k, r)
        if slots < 0:
            per_layer = (sum(lay_dense[r[0]:r[1]]) + budgets.kv_contexts * sum(kv_layer[r[0]:r[1]])) / max(
                r[1] - r[0], 1)
            fit = max(0, int((budget[d] - work - (dense - sum(lay_dense[r[0]:r[1]]))) // per_layer)) if per_layer else 0
            raise PlanError(
                f"the dense weights need {format_size(dense)} (+ {format_size(kv)} KV for --ctx-size "
                f"{budgets.ctx_size}{_contexts(budgets)}, {format_size(work)} workspace for -ub {budgets.ubatch}) but {d} has a budget of "
                f"{format_size(budget[d])}: about {fit} of its {r[1] - r[0]} layers would fit; try "
                "-ot/--override-tensor to keep tensors on the CPU, a smaller --ctx-size or -ub, a larger "
                "--vram-budget, more --gpus or --device cpu")
        sl = tuple(min(slots, held[i]) if cached_layer[i] else 0 for i in range(*r))
        stages.append(DevicePlan(d, r, budget[d], dense, kv, sl, sum(s * slot_b[i] for s, i in zip(sl, range(*r))),
                                 work, budgets.kv_contexts * sum(state_layer[r[0]:r[1]])))
    for d in phys:  # memory honesty: what the plan takes must be free on the device, whatever the budget says
        mine = [st for st in stages if st.device == d]
        used = sum(st.used_bytes for st in mine)
        if used > free[d]:
            raise PlanError(_overflow(spec, d, mine, used, free[d], budgets, kv_layer, state_layer, slot_b))

    host = sum(v[2] for v in info.values() if v[3] == "cpu" or (v[1] and v[3] is None))
    home = "ram" if host <= ram_budget else "disk"
    tensors = {}
    for name, (layer, is_exp, nbytes, ov, kind) in info.items():
        own = devs[0] if kind == "token_embd.weight" else devs[-1] if layer is None else \
            next(s.device for s in stages if s.layers[0] <= layer < s.layers[1])
        if ov is not None:
            tensors[name] = TensorPlan(ov, "vram" if ov != "cpu" else home, nbytes)
        elif is_exp:
            tensors[name] = TensorPlan(own if cached_layer[layer] else "cpu", home, nbytes, cached_layer[layer])
        else:
            tensors[name] = TensorPlan(own, "vram", nbytes)
    return Plan(tuple(stages), home, ram_budget, host if home == "ram" else 0, tensors, budgets.ctx_size,
                *_per_context(kv_layer, state_layer, budgets.ctx_size))


def _context_bytes(spec, budgets: Budgets) -> tuple[list[int], list[int]]:
    """Per layer, the KV and recurrent state of one context of ctx_size positions, and the state's part."""
    ctx, dt, vt = budgets.ctx_size, budgets.kv_dtype_bytes, budgets.kv_v_bytes
    state = [STATE_COPIES * spec.kv_bytes(i, ctx, dt) if spec.linear(i) else 0 for i in range(spec.n_layers)]
    kv = [state[i] if spec.linear(i) else spec.kv_bytes(i, ctx, dt, vt) for i in range(spec.n_layers)]
    return kv, state


def _per_context(kv_layer: list[int], state_layer: list[int], ctx: int) -> tuple[int, int]:
    """(attention KV per position, recurrent state) of one context: Plan.kv_bytes_per_token and
    state_bytes_per_seq."""
    state = sum(state_layer)
    return round((sum(kv_layer) - state) / ctx), state


def _contexts(budgets: Budgets) -> str:
    return f" x {budgets.kv_contexts} slots (-np)" if budgets.kv_contexts > 1 else ""


def _overflow(spec, d: str, mine: list[DevicePlan], used: int, free: int, budgets: Budgets, kv_layer: list[int],
              state_layer: list[int], slot_b: list[int]) -> str:
    """The one line for a plan that needs more of device d than is free: what it needs, and what would fit (a
    shorter context shrinks the attention layers' KV and the prompt attention's workspace, not the linear
    layers' state)."""
    dense = sum(st.dense_bytes for st in mine)
    kv = sum(st.kv_bytes for st in mine)
    work = sum(st.workspace_bytes for st in mine)
    cache = sum(st.cache_bytes for st in mine)
    per_slot = sum(sum(slot_b[st.layers[0]:st.layers[1]]) for st in mine)  # one more slot in every layer
    slots = max((s for st in mine for s in st.expert_slots), default=0)
    base = dense + kv + work  # what the plan needs without a single slot
    if base <= free:
        fits = [f"--expert-cache-slots {(free - base) // per_slot}"] if per_slot else []
        fits.append(f"--vram-budget {format_size(free)} (the slots sized to it)")
    else:
        layers = [i for st in mine for i in range(*st.layers)]
        state = budgets.kv_contexts * sum(state_layer[i] for i in layers)
        attn = len(mine) * attention_workspace_bytes(spec, budgets.ubatch, budgets.ctx_size) / budgets.ctx_size
        tok = budgets.kv_contexts * sum(kv_layer[i] - state_layer[i] for i in layers) / budgets.ctx_size
        ctx = int((free - dense - (work - attn * budgets.ctx_size) - state) // (tok + attn)) if tok else 0
        fits = [f"-c {ctx} and no expert slots"] if 16 <= ctx < budgets.ctx_size else []
        fits.append("fewer layers here (--tensor-split, more --gpus) or a smaller -ub")
    return (f"the plan needs {format_size(used)} on {d} (dense {format_size(dense)}, KV {format_size(kv)} for -c "
            f"{budgets.ctx_size}{_contexts(budgets)}, {slots} expert slots per layer {format_size(cache)}, workspace {format_size(work)}) "
            f"but only {format_size(free)} is free there; it fits with " + ", or ".join(fits))


def _plan_cpu(spec, info, budgets: Budgets, ram_budget: int, kv_layer: list[int], state_layer: list[int],
              slot_b: list[int], held: list[int]) -> Plan:
    """CPU only: dense + KV in RAM; experts in RAM when the whole model fits and no cache is asked for, else
    mmap + a RAM cache (of the size asked for, or what the budget leaves).
    Several cpu stages split the layers (equally, or by tensor_split) and share the RAM budget; each stage's
    row counts its layers' dense weights (embeddings with the first, head with the last), KV and cache."""
    L, E = spec.n_layers, spec.n_experts
    dense = sum(v[2] for v in info.values() if not v[1])
    experts = sum(v[2] for v in info.values() if v[1])
    kv = sum(kv_layer)
    if dense + kv > ram_budget:
        raise PlanError(f"the dense weights need {format_size(dense)} (+ {format_size(kv)} KV for --ctx-size "
                        f"{budgets.ctx_size}) but the RAM budget is {format_size(ram_budget)}; try a smaller "
                        "--ctx-size or a larger --ram-budget")
    left, per = ram_budget - dense - kv, sum(slot_b)
    asked = budgets.cache_slots is not None or budgets.cache_mib is not None
    if dense + kv + experts <= ram_budget and not asked:  # an asked-for cache serves experts from the file
        home, slots = "ram", 0
    else:
        home = "disk"
        if budgets.cache_slots is not None:
            slots = min(E, budgets.cache_slots)
        elif budgets.cache_mib is not None:
            slots = min(E, int(budgets.cache_mib * MiB // per)) if per else 0
        else:
            slots = min(E, left // per) if per else 0
        need = sum(min(slots, h) * b for h, b in zip(held, slot_b))
        if need > left:
            raise PlanError(f"an expert cache of {slots} slots per layer needs {format_size(need)} but only "
                            f"{format_size(left)} of the RAM budget is left after the dense weights and KV; "
                            f"at most {left // per} slots per layer fit")
    sl = tuple(min(slots, held[i]) if slot_b[i] else 0 for i in range(L))
    cache = sum(s * b for s, b in zip(sl, slot_b))
    n = len(budgets.devices)
    ranges = _split_layers(L, list(budgets.tensor_split or [1.0] * n))
    stage_dense = [0] * n
    for layer, is_exp, nbytes, _, kind in info.values():
        if not is_exp:
            k = 0 if kind == "token_embd.weight" else n - 1 if layer is None else \
                next(k for k, r in enumerate(ranges) if r[0] <= layer < r[1])
            stage_dense[k] += nbytes
    stages = tuple(DevicePlan("cpu", r, ram_budget, d, sum(kv_layer[r[0]:r[1]]),
                              sl[r[0]:r[1]], sum(s * b for s, b in zip(sl[r[0]:r[1]], slot_b[r[0]:r[1]])),
                              state_bytes=sum(state_layer[r[0]:r[1]]))
                   for r, d in zip(ranges, stage_dense))
    tensors = {n: TensorPlan("cpu", home if v[1] else "ram", v[2], cached=v[1] and home == "disk" and bool(slots))
               for n, v in info.items()}
    ram = dense + kv + cache + (experts if home == "ram" else 0)
    return Plan(stages, home, ram_budget, ram, tensors, budgets.ctx_size,
                *_per_context(kv_layer, state_layer, budgets.ctx_size))
