"""The GPU path's work per decoded token, counted on the stand-in, and the decode speed it predicts for a GPU.

    counts = count_decode("model.gguf", devices=("standin:0",), slots=None, batch=1)   # Counts per step
    predict(counts, bytes_per_token(spec, "Q4_K_M"), H200)                             # tok/s, and why

The counts come from a real decode step through moerun.device.counting (torch ops through a dispatch mode, Triton
launches, device-to-host reads, bytes over the link) with the GPU's kernels (the Triton ones, in triton's
interpreter): they depend on the model's structure (layers, experts, k), not on its widths, so a model of the
shape's structure with small widths counts as the full one does.

The speed model (its figures are assumptions, to be corrected from the first GPU run, bench/RESULTS.md):

    eager   host = torch launches x eager_us + Triton launches x triton_us       the host issues the step
            gpu  = bytes / HBM + kernels x graph_kernel_us                       the device runs it
            step = max(host, gpu) + syncs x sync_us   with one sync (the sampled ids): host and device overlap;
                   host + gpu + syncs x sync_us       with more: each sync drains the queue, the times add
    graph   step = gpu + graph_launch_us + syncs x sync_us        (graph=True: as if the whole step were captured)
    kernels inside replayed graphs count on the device's side only; a replay is one launch on the host's
    link    + h2d bytes / link GB/s                                              (pages in, misses' rows)
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import torch

from moerun import device
from moerun.standin import Counts


@dataclass(frozen=True)
class GpuFigures:
    name: str
    hbm_gbps: float  # device memory bandwidth a decode step streams its weights at
    link_gbps: float  # host to device (PCIe)
    graph_kernel_us: float = 2.0  # a kernel inside a replayed CUDA graph
    eager_us: float = 8.0  # a torch op launched from Python
    triton_us: float = 20.0  # a Triton launch from Python
    sync_us: float = 10.0  # a device-to-host read: the round trip, the queue drained
    graph_launch_us: float = 8.0


H200 = GpuFigures("H200", hbm_gbps=4800, link_gbps=55)
CONSUMER_24G = GpuFigures("24 GB consumer card (RTX 4090 class)", hbm_gbps=1000, link_gbps=25)

# bits per weight of GGUF's types, and which matrices llama.cpp's Q4_K_M keeps at Q6_K (attn_v and ffn_down in
# half the layers, the output head); the rest Q4_K. Norms and routers stay F32.
BPW = {"Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625, "Q8_0": 8.5, "MXFP4": 4.25, "F16": 16.0, "F32": 32.0}


def bytes_per_token(spec, ftype: str = "Q4_K_M") -> float:
    """Bytes a decode step reads for one token of `spec` (a ModelSpec) stored as `ftype`, MoE layers' k experts."""
    low, high = ("Q4_K", "Q6_K") if ftype == "Q4_K_M" else (ftype, ftype)
    q_out = spec.n_heads * spec.head_dim * (2 if getattr(spec, "attn_gate", False) else 1)
    kv = spec.n_kv_heads * spec.head_dim
    total = 0.0
    for i in range(spec.n_layers):
        half = high if i % 2 == 0 else low
        attn = BPW[low] * spec.hidden * (q_out + kv + spec.n_heads * spec.head_dim) + BPW[half] * spec.hidden * kv
        if spec.moe_layers[i]:
            e = spec.n_experts_used * spec.expert_ffn * spec.hidden
            ffn = BPW[low] * 2 * e + BPW[half] * e + 32 * spec.n_experts * spec.hidden
            if getattr(spec, "shared_ffn", 0):
                ffn += BPW[low] * 3 * spec.shared_ffn * spec.hidden
        else:
            ffn = BPW[low] * 3 * spec.ffn * spec.hidden
        total += attn + ffn
    total += BPW[high] * spec.vocab * spec.hidden + BPW[high] * spec.hidden  # the head; one embedding row
    return total / 8


@dataclass(frozen=True)
class Prediction:
    tok_s: float
    step_us: float
    gpu_us: float
    host_us: float
    link_us: float

    def row(self) -> str:
        return (f"{self.tok_s:,.0f} tok/s (step {self.step_us:,.0f} us: device {self.gpu_us:,.0f}, host "
                f"{self.host_us:,.0f}, link {self.link_us:,.0f})")


def predict(c: Counts, nbytes: float, fig: GpuFigures, graph: bool = False, batch: int = 1) -> Prediction:
    """Decode tok/s on `fig` for a step that did what `c` counts and reads `nbytes` (module docstring)."""
    gpu = nbytes / (fig.hbm_gbps * 1e3) + c.kernels * fig.graph_kernel_us
    link = c.h2d_bytes / (fig.link_gbps * 1e3)
    graphs = c.launches["graph"]
    if graph:
        host = fig.graph_launch_us
        step = gpu + host + c.n_syncs * fig.sync_us
    else:
        host = ((c.n_launches - c.n_triton - graphs) * fig.eager_us + c.n_triton * fig.triton_us
                + graphs * fig.graph_launch_us)
        overlap = max(host, gpu) if c.n_syncs <= 1 else host + gpu
        step = overlap + c.n_syncs * fig.sync_us
    step += link
    return Prediction(batch * 1e6 / step, step, gpu, host, link)


def count_decode(model: str, devices: tuple[str, ...] = ("standin:0",), slots: int | None = None, batch: int = 1,
                 steps: int = 2, prompt: int = 2, threads: int = 1) -> Counts:
    """What one decode step of `batch` sequences does on the stand-in (the last of `steps`, after a prompt of
    `prompt` tokens each), with the GPU's kernels: Triton's, interpreted (TRITON_INTERPRET=1 and
    MOERUN_STANDIN_KERNELS=triton are set for the call). slots: expert slots per layer (None: every expert on
    the device)."""
    from moerun.config import RuntimeConfig
    from moerun.runtime import build

    saved = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "MOERUN_STANDIN_KERNELS")}
    os.environ.update(TRITON_INTERPRET="1", MOERUN_STANDIN_KERNELS="triton")
    try:
        rt = build(RuntimeConfig(model=model, devices=devices, expert_cache_slots=slots, threads=threads))
        model_, eng = rt.engine.model, rt.engine
        dev = model_.dev
        seqs = [eng.new_sequence() for _ in range(batch)]
        gen = torch.Generator().manual_seed(0)
        for s in seqs:
            model_.forward(torch.randint(0, model_.spec.vocab, (prompt,), generator=gen), s.kv, last_only=True)
        tokens = torch.randint(0, model_.spec.vocab, (batch,), generator=gen)
        counts = Counts()
        for _ in range(steps):
            with device.counting(dev) as step:
                logits = model_.decode(tokens, [s.kv for s in seqs])
                (tokens,) = device.to_host([torch.argmax(logits, dim=-1)], dev=dev)  # the sampled ids
            counts = step  # the last step's
        for s in seqs:
            s.free()
        rt.close()
        return counts
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


STRUCTURES = {  # name: (preset at small widths with the real structure, overrides, the real shape, its ftype)
    "a3b-L12 Q4_K_M": ("tiny-qwen3moe", {"experts": 128, "experts_used": 8}, "a3b-L12", "Q4_K_M"),
    "gpt-oss-20b MXFP4": ("tiny-gptoss", {"experts": 32, "experts_used": 4}, "gptoss-20b", "MXFP4"),
}


def table(folder: str, batch: int = 1) -> list[dict]:
    """For each structure and placement (all in VRAM; experts behind a 25 % cache): syncs a step, kernels a layer
    and outside the layers, host launches, bytes a token, and the decode tok/s predicted on an H200 and a 24 GB
    card for the real shape's depth (models of the structure at 2 and 4 layers written into `folder`)."""
    from pathlib import Path

    from moerun.tools.make_model import make_model
    from moerun.tools.presets import preset

    rows = []
    for name, (base, kw, real, ftype) in STRUCTURES.items():
        paths = {}
        for n in (2, 4):
            paths[n] = Path(folder) / f"{base}-{kw['experts']}-L{n}.gguf"
            if not paths[n].exists():
                make_model(preset(base, layers=n, **kw), paths[n], ftype="Q8_0", progress=False, threads=1)
        spec = preset(real)
        for placement, slots in (("all in VRAM", None), ("experts in RAM, 25 % cache", kw["experts"] // 4)):
            two, four = (count_decode(str(paths[n]), slots=slots, batch=batch) for n in (2, 4))
            layer = (four.kernels - two.kernels) / 2
            sync_layer = (four.n_syncs - two.n_syncs) / 2
            # the link's bytes are the small widths' here: left out (misses' traffic is `moerun estimate`'s)
            step = Counts(syncs=Counter(step=round(two.n_syncs + sync_layer * (spec.n_layers - 2))),
                          launches=Counter(four.launches))
            host_layer = (four.n_launches - two.n_launches) / 2
            step.launches["layers"] = round(host_layer * (spec.n_layers - 4))
            step.graph_kernels = round(two.kernels - 2 * layer + layer * spec.n_layers) - \
                (step.n_launches - step.launches["graph"])
            nbytes = bytes_per_token(spec, ftype)
            rows.append({"model": name, "placement": placement, "batch": batch, "syncs_step": step.n_syncs,
                         "kernels_layer": layer, "kernels_outside": two.kernels - 2 * layer,
                         "host_launches_step": step.n_launches, "graph": bool(four.launches["graph"]),
                         "bytes_token": nbytes,
                         "h200_ts": predict(step, nbytes, H200, batch=batch).tok_s,
                         "consumer_ts": predict(step, nbytes, CONSUMER_24G, batch=batch).tok_s})
    return rows


def main() -> int:
    """python -m moerun.gpu_counts [FOLDER]: `table` as JSON lines, then as Markdown (stderr)."""
    import json
    import sys
    import tempfile

    folder = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="moerun-counts-")
    rows = table(folder)
    for r in rows:
        print(json.dumps(r))
    print("| model | placement | syncs / step | kernels / layer | outside | host launches / step | H200 tok/s | "
          "24 GB card tok/s |\n|---|---|---:|---:|---:|---:|---:|---:|", file=sys.stderr)
    for r in rows:
        print(f"| {r['model']} | {r['placement']} | {r['syncs_step']} | {r['kernels_layer']:g} | "
              f"{r['kernels_outside']:g} | {r['host_launches_step']} | {r['h200_ts']:,.0f} | "
              f"{r['consumer_ts']:,.0f} |", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
