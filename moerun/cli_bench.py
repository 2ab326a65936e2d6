"""`moerun bench`: llama-bench's command line (pp/tg tests, sweeps, md/json/jsonl/csv) for moerun."""

from __future__ import annotations

import os
from pathlib import Path

import click

from moerun.cli_flags import hub_options
from moerun.config import CACHE_POLICIES, DEFAULT_CACHE_POLICY


def _int_lists(ctx, param, values):
    from moerun.bench import parse_int_lists

    if not values:
        return None
    try:
        return parse_int_lists(values)
    except ValueError as e:
        raise click.BadParameter(str(e), ctx=ctx, param=param) from None


def _ranks(o: dict) -> dict:
    """The placement fields of expert parallelism and of a pipeline over processes (as `moerun run` reads them:
    under torchrun, --expert-parallel WORLD_SIZE makes its processes expert-parallel ranks); none when unused.
    Under torchrun its agent's store holds MASTER_PORT, and a group joined there cannot be joined afresh for the
    next test: the tests' groups are rank 0's own, from MASTER_PORT + 1."""
    if o["expert_parallel"] > 1 and os.environ.get("WORLD_SIZE") == str(o["expert_parallel"]) and \
            o["ep_world_size"] == 1:
        o["ep_rank"], o["ep_world_size"] = o["pipeline_rank"], o["pipeline_world_size"]
        o["pipeline_rank"], o["pipeline_world_size"] = 0, 1
    out = {}
    if o["expert_parallel"] > 1 or o["ep_world_size"] > 1:
        out.update((k, o[k]) for k in ("expert_parallel", "ep_rank", "ep_world_size", "ep_timeout", "expert_split"))
    if o["pipeline_world_size"] > 1:
        out.update((k, o[k]) for k in ("pipeline_rank", "pipeline_world_size", "pipeline_timeout"))
    if o["ep_world_size"] > 1 or o["pipeline_world_size"] > 1:
        agent = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None) is not None
        out.update(master_addr=o["master_addr"], master_port=o["master_port"] + agent)
    return out


def _cache_sizes(ctx, param, values):
    """Comma lists of MiB; "none" (or "-") is a test without an expert cache."""
    if not values:
        return None
    out = []
    for item in (v for value in values for v in value.split(",")):
        item = item.strip().lower()
        try:
            mib = None if item in ("none", "-") else float(item)
        except ValueError:
            raise click.BadParameter(f"{item!r} is not a size in MiB or 'none'", ctx=ctx, param=param) from None
        if mib is not None and not mib >= 0:
            raise click.BadParameter(f"{item!r}: sizes must be >= 0", ctx=ctx, param=param)
        out.append(mib)
    return out


@click.command()
@hub_options("models", required=True)
@click.option("-m", "--model", "models", multiple=True,
              help="GGUF file or Hugging Face folder, or hf://REPO[:QUANT] (repeat for several models; `default`: "
                   "the built-in model).")
@click.option("-p", "--n-prompt", multiple=True, callback=_int_lists,
              help="Prompt sizes for ppN tests; 0 skips them.  [default: 512]")
@click.option("-n", "--n-gen", multiple=True, callback=_int_lists,
              help="Generation lengths for tgN tests; 0 skips them.  [default: 128]")
@click.option("-t", "--threads", multiple=True, callback=_int_lists,
              help="CPU thread counts.  [default: physical cores]")
@click.option("-ub", "--ubatch", "--ubatch-size", "ubatch", multiple=True, callback=_int_lists,
              help="Prompt chunk sizes.  [default: 512]")
@click.option("-r", "--repetitions", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timed runs per test.")
@click.option("-o", "--output", "fmt", type=click.Choice(["md", "json", "jsonl", "csv"]), default="md",
              show_default=True, help="Output format on stdout.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Compute precision.")
@click.option("--measure-bw", is_flag=True,
              help="Measure host read bandwidth again (else the cached figure, in ~/.cache/moerun/hardware.json; "
                   "measured quickly when none is cached, or when it was probed under load and the machine is quiet "
                   "now).")
@click.option("--no-warmup", is_flag=True, help="Skip the warm-up run before each test.")
@click.option("--expert-cache-mib", "cache_mib", multiple=True, callback=_cache_sizes,
              help="Expert cache sizes to sweep, e.g. 256,512,none (none: no cache).  [default: none]")
@click.option("--cache-policy", type=click.Choice(CACHE_POLICIES), default=DEFAULT_CACHE_POLICY, show_default=True,
              help="Expert cache eviction policy.")
@click.option("--prefetch/--no-prefetch", default=False, show_default=True,
              help="With an expert cache: decode steps guess the next layer's experts and page them in ahead.")
@click.option("--mmap/--no-mmap", default=None,
              help="Keep routed experts in the file's map (default when a cache is asked for) or copy them to RAM.")
@click.option("--repack/--no-repack", default=True, show_default=True,
              help="Interleave Q3_K, Q4_K, Q5_K, Q6_K, Q8_0, MXFP4, IQ4_XS, Q5_0, Q5_1 and IQ4_NL weights held in RAM for the "
                   "CPU kernels at load (llama.cpp's repack; on NEON Q3_K, Q6_K, IQ4_XS and IQ4_NL stay as stored).")
@click.option("--trace-routing", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Record the routing of the timed runs (JSON Lines) for `moerun estimate --trace`.")
@click.option("--gpus", default=None, help="Placement: CUDA devices in PCI order, one stage each, e.g. 0,1.")
@click.option("--devices", default=None, help="Placement: one stage per device, e.g. cuda:0,cuda:1 or standin:0.")
@click.option("--tensor-split", default=None, help="Placement: share of the layers per stage, e.g. 3,1.")
@click.option("--vram-budget", default=None, help="Placement: GPU memory per device, e.g. 6GiB or 6GiB,20GiB.")
@click.option("--n-cpu-moe", type=click.IntRange(min=0), default=0,
              help="Placement: the routed experts of the first N layers are computed on the CPU.")
@click.option("--miss-path", type=click.Choice(["auto", "fetch", "home"]), default="auto", show_default=True,
              help="Placement: expert-cache misses paged in, computed at home, or as the cost model says.")
@click.option("--h2d-bw", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Placement: host-to-GPU GB/s for the cost model (default: measured).")
@click.option("--vram-bw", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Placement: GPU memory GB/s for the cost model (default: NVML's).")
@click.option("--expert-parallel", type=click.IntRange(min=1), default=1, show_default=True,
              help="Ranks sharing each MoE layer's routed experts: devices of this process (--devices, one per rank; "
                   "else N CPUs) or processes (--ep-world-size; under torchrun, N = WORLD_SIZE).")
@click.option("--ep-rank", type=click.IntRange(min=0), default=0, show_default=True,
              help="This process's rank in expert parallelism over processes (0 runs the tests and prints them).")
@click.option("--ep-world-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes in expert parallelism, each running this command with its --ep-rank.")
@click.option("--ep-timeout", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              help="Seconds to wait for the other expert-parallel ranks to join, or to answer a step.")
@click.option("--expert-split", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Which rank owns which expert (a split file; default: contiguous ranges).")
@click.option("--pipeline-rank", type=click.IntRange(min=0), default=0, envvar="RANK", show_default=True,
              help="This process's stage in a pipeline over processes (torchrun's RANK).")
@click.option("--pipeline-world-size", type=click.IntRange(min=1), default=1, envvar="WORLD_SIZE",
              show_default=True, help="Processes in the pipeline, one stage each (torchrun's WORLD_SIZE).")
@click.option("--master-addr", default="127.0.0.1", envvar="MASTER_ADDR", show_default=True,
              help="Rank 0's host (torchrun's MASTER_ADDR).")
@click.option("--master-port", type=click.IntRange(1, 65535), default=29500, envvar="MASTER_PORT",
              show_default=True, help="Rank 0's port for the first test; test k uses this port + k - 1 (under "
                   "torchrun, MASTER_PORT + k).")
@click.option("--pipeline-timeout", type=click.FloatRange(min=0, min_open=True), default=120.0,
              show_default=True, help="Seconds to wait for the other pipeline ranks to join, or to answer a step.")
def bench(models, n_prompt, n_gen, threads, ubatch, repetitions, fmt, dtype, measure_bw, no_warmup, cache_mib,
          cache_policy, prefetch, mmap, repack, trace_routing, gpus, devices, tensor_split, vram_budget, n_cpu_moe, miss_path,
          h2d_bw, vram_bw, **ranks):
    """Measure prompt processing (ppN) and generation (tgN) speed, llama-bench style.

    Integer options take comma lists and ranges: -p 128,512  -t 1-2  -p 64-512*2  -n 0-128+32.
    Results go to stdout, progress to stderr. Besides t/s, tg tests report the weight bandwidth they
    reached (GB/s) and the fraction of the host-RAM bound (bandwidth / weight bytes per token);
    --expert-cache-mib sweeps add the cache size and its hit rate over the timed runs. With a placement
    (--gpus, --devices, ...) each test runs as `moerun run` places it and also reports the share of misses
    computed on the CPU, host-to-GPU GB/s, each stage's counters and the estimate for that placement.
    Over processes (--ep-world-size N, --pipeline-world-size N, or torchrun) every rank runs the same command
    with its own rank; rank 0 prints the results, and expert-parallel tests add the milliseconds a step spent
    in the all-gathers (link ms).
    """
    import psutil

    from moerun.bench import DEFAULT_UBATCH, run_bench
    from moerun.builtin import model_path
    from moerun.cli_generate import gpu_devices
    from moerun.placement.devices import parse_size
    from moerun.placement.planner import parse_device

    placement = {}
    try:
        if gpus and devices:
            raise click.UsageError("give --gpus or --devices, not both")
        if gpus or devices:
            placement["devices"] = gpu_devices(gpus) if gpus else tuple(parse_device(d) for d in devices.split(","))
        if tensor_split:
            placement["tensor_split"] = tuple(float(x) for x in tensor_split.split(","))
        if vram_budget:
            placement["vram_budget"] = tuple(parse_size(v) for v in vram_budget.split(","))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if n_cpu_moe or miss_path != "auto" or h2d_bw or vram_bw or tensor_split or vram_budget:
        if "devices" not in placement:
            raise click.UsageError("--tensor-split, --vram-budget, --n-cpu-moe, --miss-path, --h2d-bw and --vram-bw "
                                   "place the model on devices: give --gpus or --devices too")
        placement.update(n_cpu_moe=n_cpu_moe, miss_path=miss_path, h2d_gbps=h2d_bw, vram_gbps=vram_bw)

    placement.update(_ranks(ranks))
    models = [str(model_path(m)) for m in models]
    threads = threads or [psutil.cpu_count(logical=False) or 1]
    if any(t < 1 for t in threads) or any(u < 1 for u in (ubatch or [])):
        raise click.BadParameter("thread counts and ubatch sizes must be at least 1")
    if placement:
        from moerun.config import RuntimeConfig

        try:
            RuntimeConfig(model=models[0], **placement)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    if placement.get("ep_rank") or placement.get("pipeline_rank"):
        from moerun.bench import expand_cases, placed_config
        from moerun.bench_ranks import serve_tests

        cases = expand_cases(models, n_prompt if n_prompt is not None else [512],
                             n_gen if n_gen is not None else [128], ubatch or [DEFAULT_UBATCH], threads,
                             cache_mib or [None])
        return serve_tests(cases, placement, lambda case, p: placed_config(
            case, p, dtype, cache_policy, mmap, repack, prefetch and case.cache_mib is not None))
    run_bench(models, n_prompt if n_prompt is not None else [512], n_gen if n_gen is not None else [128],
              threads, ubatch or [DEFAULT_UBATCH], reps=repetitions, dtype=dtype, measure_bw=measure_bw,
              warmup=not no_warmup, fmt=fmt, log=lambda s: click.echo(f"bench: {s}", err=True),
              cache_mib=cache_mib or [None], cache_policy=cache_policy, mmap=mmap, repack=repack,
              trace_routing=trace_routing, placement=placement or None, prefetch=prefetch)
