"""`moerun estimate MODEL`: the cost model printed (moerun/placement/costmodel.py). Reads metadata and tensor
sizes only; no weights, no GPU libraries needed. The first estimate on a machine (or for a new layer shape)
probes it for a few seconds and caches what it measured; later ones read the cache (no torch import)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import click

from moerun.cli_flags import hub_options
from moerun.config import CACHE_POLICIES, DEFAULT_CACHE_POLICY, KV_CACHE_TYPES
from moerun.errors import MoerunError

MiB = 1 << 20


def _gb(n: float) -> str:
    from moerun.placement.devices import format_size

    return format_size(int(n))


def _cpu_cache_plan(the_plan, arch, cache_mib: float | None, layer_slots: dict[int, int] | None = None):
    """The runtime's CPU behaviour with --expert-cache-mib: experts stay in the file's map (home "disk") and a
    RAM cache of cache_mib split evenly over the MoE layers serves them (moerun/runtime.py _cache_slots); or,
    with --expert-cache-plan, the plan's slots per layer."""
    spec = arch.spec
    exp = {}
    for name, tp in the_plan.tensors.items():
        if "_exps" in name and name.startswith("blk."):
            layer = int(name.split(".")[1])
            exp[layer] = exp.get(layer, 0) + tp.nbytes
    if not exp or not spec.n_experts:
        return the_plan
    per_expert = max(exp.values()) // spec.n_experts
    d = the_plan.devices[0]
    if layer_slots is not None:
        sl = tuple(min(spec.n_experts, layer_slots.get(i, 0)) if i in exp else 0 for i in range(*d.layers))
        slots = max(sl, default=0)
    else:
        slots = min(spec.n_experts, int(cache_mib * MiB // (per_expert * len(exp))))
        sl = tuple(slots if i in exp else 0 for i in range(*d.layers))
        if not slots:
            click.echo(f"warning: --expert-cache-mib {cache_mib:g} gives no expert cache (0 slots): one slot in each "
                       f"of the {len(exp)} MoE layers takes {per_expert * len(exp) / MiB:.2f} MiB", err=True)
    cache = sum(s * exp.get(i, 0) // spec.n_experts for s, i in zip(sl, range(*d.layers)))
    dev = dataclasses.replace(d, expert_slots=sl, cache_bytes=cache)
    tensors = {n: (dataclasses.replace(t, tier="disk", cached=bool(slots)) if "_exps" in n else t)
               for n, t in the_plan.tensors.items()}
    ram = d.dense_bytes + d.kv_bytes + cache
    return dataclasses.replace(the_plan, devices=(dev,), home="disk", tensors=tensors, ram_bytes=ram)


def llama_cpp_command(model: Path, threads: int, ctx: int, the_plan, n_layers: int, n_experts: int = 0) -> str:
    """The llama.cpp command line that places the model the same way."""
    cmd = ["llama-cli", "-m", str(model), "-t", str(threads), "-c", str(ctx)]
    gpu = any(d.device != "cpu" for d in the_plan.devices)
    if gpu:
        cmd += ["-ngl", "999"]
        cpu_layers = sorted({int(n.split(".")[1]) for n, t in the_plan.tensors.items()
                             if "_exps" in n and n.startswith("blk.") and t.device == "cpu"})
        all_fit = all(s >= n_experts or s == 0 for d in the_plan.devices for s in d.expert_slots) and any(
            s for d in the_plan.devices for s in d.expert_slots)
        cached = any(t.cached for t in the_plan.tensors.values()) and not all_fit
        if cached:  # llama.cpp has no expert cache: experts stay on the CPU
            cmd += ["-ot", "exps=CPU"]
        elif cpu_layers and cpu_layers == list(range(len(cpu_layers))):
            cmd += ["--n-cpu-moe", str(len(cpu_layers))]
        elif cpu_layers:
            cmd += ["-ot", "blk\\.(" + "|".join(map(str, cpu_layers)) + ")\\.ffn_.*_exps=CPU"]
        if len(the_plan.devices) > 1:
            cmd += ["--tensor-split", ",".join(str(d.layers[1] - d.layers[0]) for d in the_plan.devices)]
    if the_plan.home == "ram":
        cmd.append("--no-mmap")
    return " ".join(cmd)


def _gather_rates(probes, options, spec):
    """probes.gather_rates; a layer probe that fails on a hybrid model's layers (moerun.model's linear
    attention) ends in one line that names --no-measure."""
    if not spec.hybrid:
        return probes.gather_rates(options)
    try:
        return probes.gather_rates(options)
    except MoerunError:
        raise
    except Exception as e:  # the probe runs the model's own code on its layers
        raise MoerunError(f"the layer probe cannot run this model's linear-attention layers "
                          f"({type(e).__name__}: {e}); `moerun estimate --no-measure` estimates from the "
                          "metadata and default overheads") from e


def default_figures(rates, qtypes: list[str], reads_file: bool) -> list[str]:
    """The rates lines this estimate used a built-in default for, where a probe would measure them (the GPU
    figures come from NVML, not from a probe)."""
    from moerun.placement.costmodel import F32_NAMES

    out = [name for name, fig in (("host RAM read", rates.ram_gbps), ("disk (file)", rates.disk_gbps))
           if fig.source == "default" and (reads_file or name != "disk (file)")]
    measured = {q for q, _ in rates.kernel_gbps} & {q for q, _ in rates.qflops}
    out += [f"kernel {q}" for q in qtypes if q not in F32_NAMES and q not in measured]
    out += [name for name, fig in (("torch float32", rates.float_flops), ("overhead", rates.layer_overhead_s))
            if fig.source == "default"]
    return out


RERUN = "re-run `moerun estimate --measure` when quiet"


def probe_notes(rates, used: dict[str, dict]) -> tuple[str | None, list[str]]:
    """(the host read figure's line: its value, age and load; warnings for the other probes this estimate used
    that were taken under load or too noisy), from probes.used_probes."""
    from moerun.placement import load

    host = used.get("host read")
    line = None if host is None else load.note(f"host read {rates.ram_gbps.value:.1f} GB/s", host, RERUN)
    bad = {name: e for name, e in used.items() if name != "host read" and not load.trusted(e)}
    if not bad:
        return line, []
    why = load.why_all(list(bad.values()))
    return line, [f"warning: the {', '.join(bad)} probe{'s' if len(bad) > 1 else ''} ran {why}: {RERUN}"]


def _probe_json(used: dict[str, dict]) -> dict:
    from moerun.placement import load

    return {name: {"measured_at": e.get("measured_at"), "age_s": load.age_s(e), "trusted": load.trusted(e),
                   "why": e.get("why"), "load": e.get("load"), "spread": e.get("spread"),
                   "described": load.describe(e)} for name, e in used.items()}


def _kv_bytes(name: str | None) -> float:
    """Bytes per value of a KV cache type, without torch (ggml's block sizes); None: float32, run's default."""
    from moerun.quant.ggml_types import QType, block_size

    elems, nbytes = block_size(QType[(name or "f32").upper()])
    return nbytes / elems


@click.command()
@hub_options(required=True, progress=True)
@click.argument("model", type=click.Path(), required=False)
@click.option("-t", "--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads (default: physical cores).")
@click.option("--ram-budget", default=None, help="Host RAM moerun may use, e.g. 12GiB (default: available).")
@click.option("--gpus", default=None, help="CUDA devices to plan for, e.g. 0,1 (default: every GPU found).")
@click.option("-b", "--batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="Sequences decoded together (serve's continuous batching): aggregate decode tok/s.")
@click.option("--vram-budget", default=None,
              help="GPU memory moerun may use per device, e.g. 6GiB or 6GiB,20GiB (default: free memory).")
@click.option("--expert-cache-mib", type=click.FloatRange(min=0), default=None,
              help="Expert cache size in MiB, split over the MoE layers (experts then stay in the file's map).")
@click.option("-c", "--ctx-size", type=click.IntRange(min=16), default=None,
              help="Context size in tokens (default: the model's, at most 4096).")
@click.option("--ram-bw", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Host RAM read bandwidth in GB/s (default: measured/cached, else a default).")
@click.option("--disk-bw", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Read bandwidth of the model file (home tier 'disk') in GB/s.")
@click.option("--vram-bw", type=click.FloatRange(min=0, min_open=True), default=None,
              help="GPU memory bandwidth in GB/s (default: from NVML's bus width and clock).")
@click.option("--h2d-bw", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Host-to-GPU copy bandwidth in GB/s (default: from NVML's PCIe generation and width).")
@click.option("--measure/--no-measure", default=None,
              help="--measure: run every probe now, thoroughly (~15 s), and cache it; --no-measure: metadata only, "
                   "the cached figures or the defaults. Default: probe what the cache lacks, quickly (a few seconds), "
                   "then use the cache.")
@click.option("--trace", "trace_path", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="Routing trace (moerun run --trace-routing) for the expected cache hit rate.")
@click.option("--cache-policy", type=click.Choice(CACHE_POLICIES), default=DEFAULT_CACHE_POLICY, show_default=True,
              help="The eviction policy the --trace replay assumes.")
@click.option("--expert-cache-plan", "cache_plan", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              default=None, help="Expert cache slots per layer from a file (`moerun trace simulate --write-plan`); "
                                 "CPU only, instead of --expert-cache-mib.")
@click.option("--expert-cache-trace", "cache_trace", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              default=None, help="Share --expert-cache-mib's slots over the layers by this routing trace's hit curves, "
                                 "as `run --expert-cache-trace` does (CPU only; --trace defaults to it).")
@click.option("-p", "--n-prompt", type=click.IntRange(min=1), default=512, show_default=True,
              help="Prompt tokens for the prefill / TTFT estimate.")
@click.option("-ub", "--ubatch", type=click.IntRange(min=1), default=512, show_default=True,
              help="Prefill chunk size in tokens.")
@click.option("--device", type=click.Choice(["auto", "cpu"]), default="auto", show_default=True,
              help="auto: the GPUs found, else the CPU.")
@click.option("--assume-gpus", default=None,
              help="Plan for GPUs of these memory sizes instead of the ones found, e.g. 24GiB or 24GiB,12GiB "
                   "(size a machine you do not have; give their links with --h2d-bw and --vram-bw).")
@click.option("-ctk", "--cache-type-k", type=click.Choice(KV_CACHE_TYPES), default=None,
              help="KV cache type of the keys, as `moerun run` takes it (default: float32).")
@click.option("-ctv", "--cache-type-v", type=click.Choice(KV_CACHE_TYPES), default=None,
              help="KV cache type of the values (default: float32).")
@click.option("--expert-parallel", type=click.IntRange(min=1), default=1, show_default=True,
              help="Also predict the model over N hosts like this one: expert parallelism against a pipeline of N "
                   "stages, and which decodes faster.")
@click.option("--link-gbps", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="The hosts' link for --expert-parallel, in Gbit/s.")
@click.option("--link-latency-us", type=click.FloatRange(min=0), default=50.0, show_default=True,
              help="One message's latency on that link, in microseconds.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def estimate(model, threads, gpus, batch, ram_budget, vram_budget, expert_cache_mib, ctx_size, ram_bw, disk_bw, vram_bw, h2d_bw,
             measure, trace_path, cache_policy, cache_plan, cache_trace, n_prompt, ubatch, device, assume_gpus,
             cache_type_k, cache_type_v, expert_parallel, link_gbps, link_latency_us, as_json, progress):
    """Predict decode and prefill speed and memory for MODEL on this machine, without loading weights
    (`default`: the built-in model)."""
    from moerun.arch import resolve
    from moerun.arch.summary import summarize
    from moerun.builtin import model_path
    from moerun.formats import open_model
    from moerun.placement import costmodel as cm
    from moerun.placement import probes
    from moerun.placement.devices import detect, parse_size
    from moerun.placement.planner import Budgets, plan

    t0 = time.perf_counter()
    model = model_path(model)
    try:
        with open_model(model) as mf:
            arch = resolve(mf)
    except MoerunError:
        raise
    except (OSError, ValueError) as e:
        raise MoerunError(f"cannot read {model}: {e}") from None
    spec = arch.spec
    summary = summarize(arch)
    inv = detect(gpus=device == "auto" and assume_gpus is None)
    if assume_gpus is not None:
        from moerun.placement.devices import GPU

        try:
            sizes = [parse_size(x) for x in assume_gpus.split(",")]
        except ValueError as e:
            raise MoerunError(f"--assume-gpus {assume_gpus}: {e}") from None
        inv = dataclasses.replace(inv, gpus=tuple(GPU(i, f"assumed {_gb(n)}", n, n, source="assumed")
                                                  for i, n in enumerate(sizes)))
    threads = threads or inv.physical_cores or 1
    if gpus is not None:
        try:
            wanted = {int(i) for i in gpus.split(",")}
        except ValueError:
            raise MoerunError(f"--gpus {gpus}: give CUDA device numbers, e.g. 0,1") from None
        found = {g.index for g in inv.gpus}
        if not wanted <= found:
            raise MoerunError(f"--gpus {gpus}: no CUDA device {sorted(wanted - found)} here (found: "
                              f"{sorted(found) or 'none'}); plan for GPUs this machine lacks with --assume-gpus "
                              "SIZE[,SIZE...] (e.g. --assume-gpus 24GiB), or estimate for the CPU with --device cpu")
        inv = dataclasses.replace(inv, gpus=tuple(g for g in inv.gpus if g.index in wanted))
    devices = tuple(g.device for g in inv.gpus) if inv.gpus else ("cpu",)
    ctx = ctx_size or min(4096, spec.context_length)
    try:
        vram = None if vram_budget is None else tuple(parse_size(v) for v in vram_budget.split(","))
        if vram is not None and devices == ("cpu",):
            click.echo("warning: --vram-budget has no effect: no GPU found (CPU only)", err=True)
            vram = None
        elif vram is not None and len(vram) == 1:
            vram = vram[0]
        budgets = Budgets(devices=devices, ram=None if ram_budget is None else parse_size(ram_budget), vram=vram,
                          ctx_size=ctx, kv_dtype_bytes=_kv_bytes(cache_type_k), kv_v_bytes=_kv_bytes(cache_type_v),
                          ubatch=ubatch,
                          cache_mib=None if expert_cache_mib is None else int(expert_cache_mib))
    except ValueError as e:
        raise MoerunError(f"{e}") from None
    the_plan = plan(arch, inv, budgets)
    if cache_plan is not None:
        if expert_cache_mib is not None:
            raise MoerunError("give --expert-cache-plan or --expert-cache-mib, not both")
        if devices != ("cpu",):
            raise MoerunError("--expert-cache-plan sizes a CPU cache; add --device cpu")
        from moerun.experts.allocate import PlanError, read_plan

        try:
            layer_slots = read_plan(cache_plan)
        except PlanError as e:
            raise MoerunError(str(e)) from None
        the_plan = _cpu_cache_plan(the_plan, arch, None, layer_slots)
    elif devices == ("cpu",) and expert_cache_mib is not None:
        the_plan = _cpu_cache_plan(the_plan, arch, expert_cache_mib)
    if cache_trace is not None:
        if cache_plan is not None or expert_cache_mib is None:
            raise MoerunError("--expert-cache-trace shares out the slots of --expert-cache-mib: give it, "
                              "not --expert-cache-plan")
        if devices != ("cpu",):
            raise MoerunError("--expert-cache-trace sizes a CPU cache; add --device cpu")
        from moerun.experts.allocate import plan_from_trace

        even = {i: s for d in the_plan.devices for i, s in zip(range(*d.layers), d.expert_slots)}
        the_plan = _cpu_cache_plan(the_plan, arch, None, plan_from_trace(cache_trace, even, spec.n_experts,
                                                                           cache_policy))
        trace_path = trace_path or cache_trace
    qtypes = sorted({src.records[0].qtype.name for src in arch.sources.values()})
    from moerun.placement.layer_probe import probe_layout

    options = probes.RateOptions(
        threads=threads, measure=measure, ram_gbps=ram_bw, disk_gbps=disk_bw, h2d_gbps=h2d_bw, vram_gbps=vram_bw,
        model_path=str(model), reads_file=the_plan.home == "disk", qtypes=qtypes, layout=probe_layout(arch),
        gpu=inv.gpus[0] if inv.gpus and devices != ("cpu",) else None, progress=progress)
    rates = _gather_rates(probes, options, spec)
    used = probes.used_probes(options, rates)
    host_note, probe_warnings = probe_notes(rates, used)
    hit_rates = hit_source = None
    slots = [0] * spec.n_layers
    for d in the_plan.devices:
        for i, s in zip(range(*d.layers), d.expert_slots):
            slots[i] = s
    if trace_path is not None:
        try:
            hit_rates, hit_source = cm.trace_hit_rates(trace_path, slots, spec.n_layers, cache_policy), "trace"
        except (OSError, ValueError) as e:
            raise MoerunError(f"cannot use trace {trace_path}: {e}") from None
    w = cm.workload(arch, the_plan, hit_rates, hit_source)
    bound = cm.decode_time(w, rates, bound=True, batch=batch)
    expect = cm.decode_time(w, rates, batch=batch)
    pre = cm.prefill_time(w, rates, n_prompt, ubatch)
    hosts = None
    if expert_parallel > 1:
        from moerun.placement import ep_cost
        from moerun.placement.expert_split import check_ranks

        check_ranks(expert_parallel, spec.n_experts)
        hosts = ep_cost.compare(w, rates, expert_parallel, ep_cost.Link(link_gbps, link_latency_us * 1e-6),
                                sum(spec.moe_layers), spec.vocab, batch, n_prompt, ubatch)
    cached_layers = [h for h, c in zip(w.hit_rate, slots) if h < 1 or c]
    hit = (sum(cached_layers) / len(cached_layers)) if cached_layers else None
    cmd = llama_cpp_command(model, threads, ctx, the_plan, spec.n_layers, spec.n_experts)
    mem = [{"device": d.device, "dense_bytes": d.dense_bytes, "kv_bytes": d.kv_bytes,
            "state_bytes": d.state_bytes, "cache_bytes": d.cache_bytes, "workspace_bytes": d.workspace_bytes,
            "used_bytes": d.used_bytes, "budget_bytes": d.budget} for d in the_plan.devices]
    home_bytes = sum(t.nbytes for t in the_plan.tensors.values() if t.tier == the_plan.home and t.tier != "vram")
    info = {
        "model": str(model), "threads": threads, "ctx_size": ctx, "devices": list(devices), "home": the_plan.home,
        "total_params": summary.total_params, "active_params": summary.active_params,
        "total_bytes": summary.total_bytes, "bytes_per_token": sum(dict(expect.bytes_by_class).values()) / batch, "batch": batch,
        "bytes_per_token_by_class": dict(expect.bytes_by_class), "bytes_per_token_by_tier": dict(expect.bytes_by_tier),
        "kv_bytes_per_token": the_plan.kv_bytes_per_token,
        "state_bytes_per_seq": the_plan.state_bytes_per_seq,
        "hit_rate": hit, "hit_source": w.hit_source,
        "decode": {"bound_tok_s": bound.tok_s, "expected_tok_s": expect.tok_s, "bound": bound.to_dict(),
                   "expected": expect.to_dict()},
        "prefill": {**pre.to_dict(), "ubatch": ubatch},
        "hosts": hosts,
        "memory": {"devices": mem, "home_bytes": home_bytes, "ram_bytes": the_plan.ram_bytes},
        "rates": {"ram_gbps": rates.ram_gbps.value, "disk_gbps": rates.disk_gbps.value,
                  "kernel_gbps": {q: rates.kernel(q) for q in qtypes},
                  "qflops": {q: rates.flops(q) for q in qtypes}, "float_flops": rates.float_flops.value,
                  "layer_overhead_s": rates.layer_overhead_s.value, "token_overhead_s": rates.token_overhead_s.value,
                  "h2d_gbps": rates.h2d_gbps.value if rates.h2d_gbps else None,
                  "device_gbps": rates.device_gbps.value if rates.device_gbps else None},
        "sources": rates.sources(), "probes": _probe_json(used),
        "llama_cpp": cmd, "plan": the_plan.to_json(), "seconds": time.perf_counter() - t0,
    }
    if as_json:
        info["plan"].pop("tensors", None)
        from moerun.placement import load

        if "host read" in used and not load.trusted(used["host read"]):
            click.echo(f"warning: {host_note}", err=True)
        for w in probe_warnings:
            click.echo(w, err=True)
        click.echo(json.dumps(info, indent=2, default=lambda x: None if isinstance(x, float) and math.isinf(x) else x))
        return
    e = click.echo
    e(f"model        {model}  ({spec.family}, {spec.n_layers} layers, {spec.n_experts} experts, top-{spec.n_experts_used})")
    e(f"parameters   {summary.total_params / 1e9:.3f}B total, {summary.active_params / 1e9:.3f}B active per token")
    e(f"threads {threads}, ctx {ctx}, devices {', '.join(devices)}, experts' home: {the_plan.home}")
    e("")
    e(the_plan.table())
    e("")
    step = "token" if batch == 1 else f"step of {batch} sequences"
    read = "weights and recurrent state" if spec.hybrid else "weights"
    e(f"{read} read per {step}: {_gb(info['bytes_per_token'] * batch)}")
    for c, b in expect.bytes_by_class:
        e(f"  {c:<16} {_gb(b):>12}")
    e("  by tier:       " + ", ".join(f"{t} {_gb(b)}" for t, b in expect.bytes_by_tier))
    if hit is not None:
        e(f"expert cache hit rate (decode): {hit:.1%} ({w.hit_source})")
    e("")
    per = "token" if batch == 1 else f"step of {batch}"
    e(f"decode bound     {bound.tok_s:8.1f} tok/s   (bandwidth only: {bound.total * 1e3:.2f} ms/{per})")
    e(f"decode expected  {expect.tok_s:8.1f} tok/s   ({expect.total * 1e3:.2f} ms/{per} = dense "
      f"{expect.dense * 1e3:.2f} + experts hit {expect.experts_hit * 1e3:.2f} + miss {expect.experts_miss * 1e3:.2f}"
      f" + overhead {expect.overhead * 1e3:.2f} + head {expect.head * 1e3:.2f})")
    e(f"prefill pp{n_prompt:<6} {pre.tok_s:8.1f} tok/s   TTFT {pre.seconds:.2f} s (compute {pre.compute:.2f} s, "
      f"memory {pre.memory:.2f} s, overhead {pre.overhead:.2f} s; ubatch {ubatch})")
    for line in ep_cost.lines(hosts) if hosts else ():
        e(line)
    e("")
    e("memory:")
    for m in mem:
        work = f", workspace {_gb(m['workspace_bytes'])}" if m["workspace_bytes"] else ""
        state = f" with recurrent state {_gb(m['state_bytes'])}" if m["state_bytes"] else ""
        e(f"  {m['device']:<8} {_gb(m['used_bytes']):>12} (dense {_gb(m['dense_bytes'])}, "
          f"KV {_gb(m['kv_bytes'])}{state}, cache {_gb(m['cache_bytes'])}{work}) of {_gb(m['budget_bytes'])}")
    e(f"  home     {_gb(home_bytes):>12} ({'host RAM' if the_plan.home == 'ram' else 'memory-mapped file'})")
    e("")
    e(f"llama.cpp:  {cmd}")
    e("")
    e("rates:")
    e(f"  host RAM read   {rates.ram_gbps.value:8.2f} GB/s   {rates.ram_gbps.source}")
    e(f"  disk (file)     {rates.disk_gbps.value:8.2f} GB/s   {rates.disk_gbps.source}")
    for q in qtypes:
        if q not in cm.F32_NAMES:
            src = dict(rates.kernel_gbps).get(q)
            fl = dict(rates.qflops).get(q)
            e(f"  kernel {q:<8} {rates.kernel(q):8.2f} GB/s decode, "
              f"{rates.flops(q) / 1e9:6.1f} GFLOP/s prefill   "
              f"{src.source if src else 'default'}{'' if src else f' ({cm.DEFAULT_KERNEL_EFF:.0%} of host RAM)'}"
              f"{'' if fl else ', prefill default'}")
    e(f"  torch float32   {rates.float_flops.value / 1e9:8.1f} GFLOP/s {rates.float_flops.source}")
    e(f"  overhead        {rates.layer_overhead_s.value * 1e3:8.3f} ms/layer + {rates.token_overhead_s.value * 1e3:.3f}"
      f" ms/token decode, {rates.prefill_overhead_s.value * 1e3:.3f} ms/layer/token prefill   "
      f"{rates.layer_overhead_s.source}")
    if rates.h2d_gbps:
        e(f"  host-to-device  {rates.h2d_gbps.value:8.2f} GB/s   {rates.h2d_gbps.source}")
        e(f"  device memory   {rates.device_gbps.value:8.2f} GB/s   {rates.device_gbps.source}")
    if host_note:
        e(f"  {host_note}")
    for w in probe_warnings:
        e(f"  {w}")
    defaults = default_figures(rates, qtypes, reads_file=the_plan.home == "disk")
    if defaults:
        e(f"  (default figures for {', '.join(defaults)}: run `moerun estimate` without --no-measure, or with "
          "--measure, to measure this machine)")
