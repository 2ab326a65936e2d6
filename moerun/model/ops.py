"""How weights are multiplied: the torch reference (dequantize, then matmul) or the quantized CPU kernels.

The forward pass calls `ops.linear` and `ops.moe`; which implementation runs is the model's choice
(`MoEModel(..., kernels=...)`), so a test can run the same model both ways.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moerun.experts.store import Expert
from moerun.model.layers import SMALL_T, apply_rope, attend, mla_form, rms_norm
from moerun.quant.qtypes import FLOAT_QTYPES, QTensor

Weight = torch.Tensor | QTensor


def as_float(w: QTensor, dtype: torch.dtype) -> torch.Tensor:
    """A float-typed QTensor as a tensor of `dtype`: a view (plus a cast), no reference dequantizer."""
    return w.data.view(FLOAT_QTYPES[w.qtype]).reshape(w.shape).to(dtype)


@dataclass(frozen=True)
class ExpertFn:
    """What a layer's routed experts compute around their three matrices: the activation (ModelSpec.expert_act:
    swiglu silu(g) * u, or swiglu_oai min(g, limit) * sigmoid(alpha min(g, limit)) * (clamp(u, +-limit) + 1)) and
    the projections' biases by expert id (gate [E, I], up [E, I], down [E, H]; gpt-oss)."""

    act: str = "swiglu"
    alpha: float = 1.702
    limit: float = 7.0
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def plain(self) -> bool:
        return self.act == "swiglu" and self.biases is None

    def glu(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if self.act == "swiglu":
            return F.silu(g) * u
        g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
        return g * torch.sigmoid(self.alpha * g) * (u + 1)

    def bias(self, m: int, e: int) -> torch.Tensor | None:
        """Expert e's bias of matrix m (0 gate, 1 up, 2 down), or None."""
        return None if self.biases is None else self.biases[m][e]

    def to(self, dev: torch.device) -> ExpertFn:
        if self.biases is None or self.biases[0].device == dev:
            return self
        return ExpertFn(self.act, self.alpha, self.limit, tuple(b.to(dev) for b in self.biases))


PLAIN = ExpertFn()


class ReferenceOps:
    """Quantized weights are dequantized at each use (the oracle the kernels are tested against)."""

    name = "reference"

    def __init__(self):
        self.free_cpus = FreeCpus()

    def floats(self, w: QTensor) -> torch.Tensor:
        """w as float32: QTensor.dequantize's values (a weight used as floats, e.g. MLA's per-head matrices)."""
        return w.dequantize(torch.float32)

    def linear(self, x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] @ w[out, in].T (+ b)."""
        if isinstance(w, QTensor):
            w = as_float(w, x.dtype) if w.qtype in FLOAT_QTYPES else w.dequantize(x.dtype)
        return F.linear(x, w, b)

    def linears(self, x: torch.Tensor, ws: list[Weight], bs: list | None = None) -> list[torch.Tensor]:
        """[x @ w.T (+ b) for w, b in zip(ws, bs)]: several products of one input (the kernels take them in one
        call); bs: a bias or None for each (None: no biases)."""
        return [self.linear(x, w, None if bs is None else bs[j]) for j, w in enumerate(ws)]

    def attend(self, q, k, v, q_pos, k_pos, scale=None, sinks=None, window=0, q_start=None) -> torch.Tensor:
        """moerun.model.layers.attend (causal GQA attention) -> [T, nh * Dv]. q_start: the first query's position as a
        host integer, where queries and keys are consecutive and end together (no position is read back then)."""
        return attend(q, k, v, q_pos, k_pos, scale=scale, sinks=sinks, window=window, q_start=q_start)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """moerun.model.layers.rms_norm over x's last dimension."""
        return rms_norm(x, w, eps)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
        """moerun.model.layers.apply_rope: x [T, heads, D], tables [T, R / 2]."""
        return apply_rope(x, cos, sin, style)

    def gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x * sigmoid(gate): gated attention's output gate."""
        return x * torch.sigmoid(gate)

    def mla(self, q_nope, q_pe, latent, wk_b, wv_b, q_pos, k_pos, scale, q_start=None) -> torch.Tensor:
        """MLA's attention over the latents (moerun.model.layers.mla_form for T = q_nope.shape[0] queries)."""
        return mla_form(q_nope.shape[0])(q_nope, q_pe, latent, wk_b, wv_b, q_pos, k_pos, scale, q_start=q_start)

    def route(self, logits: torch.Tensor, spec, score_b: torch.Tensor | None):
        """The router's (weights, ids) from float32 logits [T, E] (bias added), or None: moerun.model.moe.route's
        torch form then."""

    def swiglu(self, x: torch.Tensor, gate: Weight, up: Weight, down: Weight) -> torch.Tensor:
        """down(silu(gate x) * up x). x [T, H] -> [T, H]."""
        g, u = self.linears(x, [gate, up])
        return self.glu_down(g, u, down)

    def glu_down(self, g: torch.Tensor, u: torch.Tensor, down: Weight, gate: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """down(silu(g) * u), scaled by sigmoid(gate) [T, 1] when given (a shared expert's gate). g may be used up."""
        out = self.linear(F.silu(g) * u, down)
        return out if gate is None else torch.sigmoid(gate) * out

    def expert(self, x: torch.Tensor, ex: Expert, fn: ExpertFn = PLAIN, e: int = 0) -> torch.Tensor:
        """Expert e (weights ex) on x [T, H] -> [T, H]: down(glu(gate x + b, up x + b)) + b, as fn says."""
        if fn.plain:
            return self.swiglu(x, ex.gate, ex.up, ex.down)
        h = fn.glu(self.linear(x, ex.gate, fn.bias(0, e)), self.linear(x, ex.up, fn.bias(1, e)))
        return self.linear(h, ex.down, fn.bias(2, e))

    def moe_table(self, experts: dict[int, Expert]):
        """What `moe` can prepare once for experts that stay put (a GPU stage's resident layers); None here."""
        return

    def moe_stacked(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, stacks, *, fn: ExpertFn = PLAIN):
        """`moe` over a layer's experts as the stacked (gate, up, down) tensors they are stored in [E, ..], or None
        where these ops do not take them that way (the caller fetches experts one by one)."""

    def moe(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, experts: dict[int, Expert],
            table=None, *, fn: ExpertFn = PLAIN) -> torch.Tensor:
        """sum over each token's k choices of w * expert(x). x [T, H], ids/w [T, k] -> [T, H].

        Experts run in ascending id order, so the result does not depend on where their weights live.
        table: `moe_table(experts)`, when the ops make one. fn: the experts' activation and biases.
        """
        out = torch.zeros_like(x)
        for e in sorted(experts):
            tok, slot = torch.where(ids == e)  # tokens routed to e, and which of their k choices it was
            out.index_add_(0, tok, self.expert(x[tok], experts[e], fn, e) * w[tok, slot, None])
        return out

    def moe_pairs(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, experts: dict[int, Expert],
                  out: torch.Tensor | None = None, *, fn: ExpertFn = PLAIN) -> torch.Tensor:
        """Each (token, choice) pair's weighted expert output, unsummed: [T * k, H], row t * k + j =
        w[t, j] * expert_e(x_t) for e = ids[t, j] in `experts`, 0 for pairs whose expert is not given. Pairs
        split over several calls (and devices) and combined by `sum_pairs` give the same result as one call.
        out: a float32 [T * k, H] buffer to write into (pinned memory for a copy to a device)."""
        T, k = ids.shape
        res = torch.zeros(T * k, x.shape[1], dtype=x.dtype, device=x.device)
        for e in sorted(experts):
            tok, slot = torch.where(ids == e)
            if len(tok):
                res[tok * k + slot] = self.expert(x[tok], experts[e], fn, e) * w[tok, slot, None]
        return res if out is None else out.copy_(res)

    def step(self, n_tokens: int, c_only: bool = False):
        """Context for one forward step of n_tokens: torch's threads, as many as have a core (`FreeCpus`).
        c_only: the step runs in one C call of the kernels (KernelOps), torch's threads idle."""
        return step_threads(self.free_cpus)


def sum_pairs(pairs: torch.Tensor, k: int) -> torch.Tensor:
    """[T * k, H] per-pair rows -> [T, H], summed in the order of the k choices (as the CPU kernel sums), so
    the result does not depend on which call or device computed which pair."""
    rows = pairs.view(-1, k, pairs.shape[-1])
    out = rows[:, 0].clone()
    for j in range(1, k):
        out += rows[:, j]
    return out


class KernelOps(ReferenceOps):
    """Quantized weights go through moerun.kernels.cpu (activations quantized as llama.cpp does); float
    weights, other devices and unsupported types fall back to the reference."""

    name = "cpu-kernels"

    # steps this small leave torch's few remaining ops single-threaded: the fused attention block (up to 16
    # rows) and the kernels do the work on their own pool (batched decode of 8 sequences on 2 cores: 22 ms
    # per step with torch's 2 threads spinning against the pool, 5 ms with 1)
    DECODE_TOKENS = 16

    def __init__(self):
        from moerun.kernels import cpu, rows

        super().__init__()
        self.cpu, self.rows = cpu, rows
        self.c_attention = cpu.features()["isa"] == "avx512vnni"  # prompt attention in C: its AVX-512 set only

    def step(self, n_tokens: int, c_only: bool = False):
        """DESIGN decision 9, one thread budget: in small decode steps the kernel pool does the heavy work
        and torch's OpenMP threads, left at the budget, spin against it (measured on a3b-L4 Q4_K_M, 2
        cores: 15 ms/token with 2 torch threads, 8 ms with 1). Prefill keeps torch's threads for attention,
        as many as have a core to themselves (`FreeCpus`), and the kernel pool's threads likewise. A step that
        is one C call (c_only) leaves torch's threads as they are: it runs no parallel torch operation, and
        setting them twice a token cost ~0.1 ms from cold caches."""
        torch_n = 0 if c_only else 1 if n_tokens <= self.DECODE_TOKENS else None
        return step_threads(self.free_cpus, torch_n, self.cpu)

    def c_threads(self) -> int:
        """The kernel pool's threads for a step that is one C call, as step(c_only=True) sets them (for a call that
        sets them itself: layer.decode_tokens)."""
        return self.free_cpus(max(torch.get_num_threads(), self.cpu.get_threads()))

    def floats(self, w: QTensor) -> torch.Tensor:
        """The same values (gguf.quants') from the C dequantizer where it reads w's type: V2-Lite's 27 MLA value
        matrices took 0.3 s of its load through the torch reference."""
        if w.qtype in FLOAT_QTYPES or not w.data.is_cpu or not self.cpu.supports(w.qtype):
            return super().floats(w)
        if w.interleave != 1:
            w = self.cpu.deinterleave(w)
        n = w.numel // w.shape[-1]
        rows = QTensor(w.data.reshape(n, w.data.shape[-1]), w.qtype, (n, w.shape[-1]))
        return self.cpu.dequant_rows(rows, torch.arange(n)).view(w.shape)

    def _ok(self, x: torch.Tensor, qtype) -> bool:
        return x.device.type == "cpu" and x.dtype == torch.float32 and self.cpu.supports(qtype)

    def attend(self, q, k, v, q_pos, k_pos, scale=None, sinks=None, window=0, q_start=None):
        """A prompt's attention in C where the AVX-512 set runs (float32 on the CPU; measured against torch's
        blocked SDPA in bench/RESULTS.md); decode-sized steps and other machines keep torch's path."""
        if (q.shape[0] > SMALL_T and self.c_attention and q.dtype == k.dtype == v.dtype ==
                torch.float32 and q.is_cpu and q.shape[-1] <= 256 and v.shape[-1] % 16 == 0):
            return self.cpu.attend_prompt(q, k, v, q_pos, k_pos, q.shape[-1] ** -0.5 if scale is None else scale,
                                          sinks, window)
        if q_start is not None and k.shape == v.shape and k.shape[-1] == q.shape[-1] and self._rows(q, k, v):
            return self.rows.attend(q, k, v, q_start, q_start + q.shape[0] - k.shape[0], scale, sinks, window)
        return super().attend(q, k, v, q_pos, k_pos, scale, sinks, window, q_start)

    @staticmethod
    def _f32(*ts: torch.Tensor) -> bool:
        return all(t.is_cpu and t.dtype == torch.float32 for t in ts)

    def _rows(self, *ts: torch.Tensor) -> bool:
        """A decode-sized step's float32 CPU tensors (the rows the fused layers take): the loop's attention, MLA
        and routing in their arithmetic (moerun.kernels.rows), so a step gives the same bits through the loop as
        through one C call. (Norms, RoPE and the gate take it at every size: _f32.)"""
        return ts[0].shape[0] <= SMALL_T and self._f32(*ts)

    # Norms, RoPE and the output gate work row by row: the C forms for every step, a prompt's too, so a token's
    # rows get one arithmetic whatever the step's size, and a prompt spends less time in them than in torch's
    # (bench/journal/issue-36.md, "A prompt's norms, RoPE and gate in C").
    def rms_norm(self, x, w, eps):
        return self.rows.rms_norm(x, w, eps) if self._f32(x, w) else super().rms_norm(x, w, eps)

    def rope(self, x, cos, sin, style):
        if self._f32(x, cos, sin):
            return self.rows.rope(x, cos, sin, style == "neox")
        return super().rope(x, cos, sin, style)

    def gate(self, x, gate):
        return self.rows.gate_mul(x, gate) if self._f32(x, gate) else super().gate(x, gate)

    def mla(self, q_nope, q_pe, latent, wk_b, wv_b, q_pos, k_pos, scale, q_start=None):
        if q_start is not None and self._rows(q_nope, q_pe, latent, wk_b, wv_b):
            return self.rows.mla(q_nope, q_pe, latent, wk_b, wv_b, q_start, scale)
        return super().mla(q_nope, q_pe, latent, wk_b, wv_b, q_pos, k_pos, scale, q_start)

    def route(self, logits, spec, score_b):
        if self._rows(logits, *([] if score_b is None else [score_b])):
            return self.rows.route(logits, spec, score_b)
        return None

    def linear(self, x, w, b=None):
        if isinstance(w, QTensor) and self._ok(x, w.qtype):
            y = self.cpu.matmul(x.contiguous(), w)
            return y if b is None else y + b
        if isinstance(w, torch.Tensor) and w.dtype == torch.float32 and self._rows(x, w):  # a router: the float kernel
            y = self.linears(x, [w])[0]
            return y if b is None else y + b
        return super().linear(x, w, b)

    def glu_down(self, g, u, down, gate=None):
        """In C where the down projection's type has a kernel: the fused layers' arithmetic, so a layer run in the
        loop (an expert cache, a routing hook) equals the same layer run whole, bit for bit."""
        if ((self._ok(g, down.qtype) if isinstance(down, QTensor) else self._rows(g, down) and down.is_contiguous())
                and g.is_contiguous() and u.is_contiguous()):
            return self.cpu.glu_down(g, u, down, gate)
        return super().glu_down(g, u, down, gate)

    def moe(self, x, ids, w, experts, table=None, *, fn=PLAIN):
        ex = next(iter(experts.values()), None)
        if ex is not None and all(self._ok(x, t.qtype) for t in (ex.gate, ex.up, ex.down)):
            return self.cpu.moe_ffn_experts(x.contiguous(), ids, w, experts, fn=None if fn.plain else fn.to(x.device))
        return super().moe(x, ids, w, experts, fn=fn)

    def linears(self, x, ws, bs=None):
        """The quantized matrices (and a decode step's float32 ones) in one kernel call, the activations quantized
        once: a step's q/k/v, or a router beside its shared expert's gate and up, cost a call each otherwise (~8 us
        of set-up apiece; a prompt's x quantized three times: pp512 1.05x on qwen3moe with them together). A
        prompt's float32 matrices (routers) take torch's sgemm. The same bits as one call each."""
        if not (x.device.type == "cpu" and x.dtype == torch.float32):
            return super().linears(x, ws, bs)
        small = x.shape[0] <= self.DECODE_TOKENS
        mine = [j for j, w in enumerate(ws) if (self.cpu.supports(w.qtype) if isinstance(w, QTensor) else
                                                small and w.dtype == torch.float32 and w.is_cpu and w.is_contiguous())]
        out: list[torch.Tensor | None] = [None] * len(ws)
        xc = x.contiguous()
        for c in range(0, len(mine), self.cpu.MATMULS_MAX):
            part = mine[c:c + self.cpu.MATMULS_MAX]
            for j, y in zip(part, self.cpu.matmuls(xc, [ws[j] for j in part])):
                out[j] = y if bs is None or bs[j] is None else y + bs[j]
        return [y if y is not None else self.linear(x, w, None if bs is None else bs[j])
                for j, (y, w) in enumerate(zip(out, ws))]

    def moe_stacked(self, x, ids, w, stacks, *, fn=PLAIN):
        """The kernels straight over the stacked tensors: no per-expert address table per call (50-70 us a layer in
        a decode step)."""
        if all(self._ok(x, t.qtype) and t.data.is_cpu for t in stacks):
            return self.cpu.moe_ffn(x.contiguous(), ids, w, *stacks, fn=None if fn.plain else fn.to(x.device))
        return None

    def moe_pairs(self, x, ids, w, experts, out: torch.Tensor | None = None, *, fn=PLAIN):
        """As ReferenceOps.moe_pairs; out: a float32 [T * k, H] buffer for the kernels to write (pinned memory
        for a copy to a device)."""
        ex = next(iter(experts.values()), None)
        if ex is not None and all(self._ok(x, t.qtype) for t in (ex.gate, ex.up, ex.down)):
            given = torch.zeros(max(experts) + 1, dtype=torch.bool)
            given[list(experts)] = True
            mine = torch.where(given[ids.clamp(0, len(given) - 1)] & (ids < len(given)), ids, -1)
            return self.cpu.moe_ffn_experts(x.contiguous(), mine, w, experts, pairs=True, out=out,
                                            fn=None if fn.plain else fn.to(x.device))
        return super().moe_pairs(x, ids, w, experts, out, fn=fn)


class FreeCpus:
    """How many threads would each have a core to themselves now (DESIGN decision 9).

    Why: torch's OpenMP threads split each parallel region evenly and wait for the slowest, and a kernel-pool
    thread that holds a work item holds up its whole call. With another process busy on one of two cores,
    the thread that shares its core gets a time slice now and then, and every region waits for it: the built-in
    model's prefill at 2 threads fell to 0.25-0.37x of 1 thread's, issue 15 (bench/RESULTS.md). So each step
    runs on the cores that are free when it starts.

    A reading is /proc/loadavg's count of runnable threads less this process's running ones (in C where the
    kernels are built: ~0.1 ms from the cold caches a decode step leaves, several times that through Python's
    files). Busy processes show in every reading, a daemon waking for a moment in one: the count is the least of
    the last `keep` readings, taken at most every `ttl` seconds and at most `fresh` seconds old. A long step
    (prefill) tops them up to `keep` readings `gap` seconds apart first (~1 ms when the last ones are stale).
    The CPUs this process may run on are read again after `cpus_ttl` seconds (an affinity changes rarely; the
    two calls took ~0.06 ms after a decode step's weights streamed through)."""

    def __init__(self, ttl: float = 0.05, keep: int = 3, fresh: float = 0.25, gap: float = 5e-4,
                 cpus_ttl: float = 1.0):
        self.ttl, self.keep, self.fresh, self.gap, self.cpus_ttl = ttl, keep, fresh, gap, cpus_ttl
        self._readings: list[tuple[float, int]] = []  # (time, other processes' runnable threads)
        self._cpus, self._at = 0, -1.0  # CPUs this process may run on (0: fewer than the machine's), when read

    def __call__(self, budget: int, long: bool = False) -> int:
        """Of `budget` threads, those that would have a core: the CPUs this process may run on less the
        others' runnable threads, at least 1. `budget` where that cannot be known (no /proc, or an affinity
        narrower than the machine: the count is machine-wide)."""
        if budget <= 1:
            return 1
        try:
            now = time.monotonic()
            if self._at < 0 or now - self._at > self.cpus_ttl:
                cpus, self._at = len(os.sched_getaffinity(0)), now
                self._cpus = cpus if cpus == os.cpu_count() else 0
            if not self._cpus:
                return budget
            self._readings = [r for r in self._readings if now - r[0] < self.fresh][-self.keep:]
            if not self._readings or now - self._readings[-1][0] > self.ttl:
                self._readings.append((now, _others_runnable()))
            while long and len(self._readings) < self.keep:
                time.sleep(self.gap)
                self._readings.append((time.monotonic(), _others_runnable()))
        except (OSError, ValueError, IndexError, AttributeError):
            return budget
        return max(1, min(budget, self._cpus - min(o for _, o in self._readings[-self.keep:])))


def _others_runnable() -> int:
    """Runnable threads of other processes: /proc/loadavg's machine-wide count less this process's running
    threads."""
    n = _kernel_reading()
    if n >= 0:
        return n
    runnable = int(_read("/proc/loadavg").split()[3].split("/")[0])
    mine = 0
    for task in os.listdir("/proc/self/task"):
        stat = _read(f"/proc/self/task/{task}/stat")
        mine += stat[stat.rindex(")") + 2] == "R"
    return max(0, runnable - mine)


def _kernel_reading() -> int:
    """_others_runnable's reading by the CPU kernels' C (moerun.kernels.cpu.others_runnable), -1 where they are
    not built or /proc cannot tell."""
    try:
        from moerun.kernels import cpu
    except ImportError:
        return -1
    return cpu.others_runnable() if cpu.available() else -1


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


@contextmanager
def step_threads(free: FreeCpus, torch_n: int | None = None, pool=None):
    """torch's intra-op threads (torch_n, or as many of the budget as `free` finds free; 0: left as they are)
    and the kernel pool's active threads (as many as `free` finds) for one step; the budget again after it."""
    before = torch.get_num_threads()
    n = free(max(before, pool.get_threads() if pool is not None else 1), long=torch_n is None)
    want = min(before, n) if torch_n is None else torch_n or before
    if pool is not None:
        pool.set_active(n)
    if want != before:
        torch.set_num_threads(want)
    try:
        yield
    finally:
        if want != before:
            torch.set_num_threads(before)
        if pool is not None:
            pool.set_active(0)


def set_threads(n: int) -> None:
    """One thread budget for the process (DESIGN decision 9): torch's intra-op threads and the CPU kernels'
    pool (when built)."""
    torch.set_num_threads(n)
    try:
        from moerun.kernels import cpu
    except ImportError:
        return
    if cpu.available():
        cpu.set_threads(n)


@contextmanager
def thread_budget(n: int):
    """set_threads(n) for the block, then the previous budget again."""
    try:
        from moerun.kernels import cpu
    except ImportError:
        cpu = None
    before = torch.get_num_threads(), (cpu.get_threads() if cpu is not None and cpu.available() else None)
    set_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        if before[1] is not None:
            cpu.set_threads(before[1])


def make_ops(kernels: bool = True) -> ReferenceOps:
    """KernelOps when asked for and the CPU kernels are built (and not disabled), else the reference."""
    if kernels:
        try:
            from moerun.kernels import cpu
        except ImportError:  # a tree without the kernels module
            return ReferenceOps()
        if cpu.available():
            return KernelOps()
    return ReferenceOps()
