"""`moerun run` and `moerun chat`: generate text from the command line, llama.cpp style."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import click

from moerun.cli_flags import UNTIL_END, apply_llama_flags, device_flag, gpu_layers, hub_options, llama_options
from moerun.config import CACHE_POLICIES, DEFAULT_CACHE_POLICY, KV_CACHE_TYPES, REASONING_FORMATS
from moerun.errors import MoerunError


def model_options(f):
    opts = [
        click.option("-m", "--model", type=click.Path(), default=None,
                     help="GGUF file or Hugging Face folder, or hf://REPO[:QUANT] on the hub (default: the built-in "
                          "model)."),
        click.option("-c", "--ctx-size", type=click.IntRange(min=16), default=None,
                     help="Context size in tokens (default: the model's, at most 4096)."),
        click.option("-ub", "--ubatch", "--ubatch-size", "ubatch", type=click.IntRange(min=1), default=512,
                     show_default=True,
                     help="Prefill chunk size in tokens."),
        click.option("-t", "--threads", type=click.IntRange(min=1), default=None,
                     help="CPU threads (default: physical cores)."),
        click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
                     help="Compute precision."),
        click.option("--expert-cache-mib", type=click.FloatRange(min=0), default=None,
                     help="Expert cache size in MiB, split evenly over the MoE layers (default: no cache; "
                          "experts are read where they are stored)."),
        click.option("--expert-cache-slots", type=click.IntRange(min=0), default=None,
                     help="Expert cache slots per MoE layer (instead of --expert-cache-mib)."),
        click.option("--expert-cache-plan", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="Expert cache slots per layer from a file (`moerun trace simulate --write-plan`)."),
        click.option("--expert-cache-trace", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="A routing trace (--trace-routing): the slots --expert-cache-mib or --expert-cache-slots "
                          "give are re-shared over the layers for the most hits on it."),
        click.option("--cache-policy", type=click.Choice(CACHE_POLICIES), default=DEFAULT_CACHE_POLICY, show_default=True,
                     help="Expert cache eviction policy."),
        click.option("--cache-prefill", type=click.Choice(["bypass", "cache"]), default="bypass", show_default=True,
                     help="Prefill misses: compute at home without evicting (bypass), or page in (cache)."),
        click.option("--prefetch/--no-prefetch", default=False, show_default=True,
                     help="Decode steps guess the next layer's experts (its router on the current hidden state) "
                          "and page them into the expert cache on a background thread."),
        click.option("--mmap/--no-mmap", "use_mmap", default=None,
                     help="Routed experts stay in the file's memory map (--mmap) or are copied to RAM "
                          "(--no-mmap). Default: RAM when the model takes under 70% of the available memory "
                          "and no expert cache is asked for."),
        click.option("--repack/--no-repack", "repack", default=True, show_default=True,
                     help="Rewrite Q3_K, Q4_K, Q5_K, Q6_K, Q8_0, MXFP4, IQ4_XS, Q5_0, Q5_1 and IQ4_NL weights held in RAM "
                          "into the CPU kernels' interleaved layout at load (faster; llama.cpp's repack; on NEON Q3_K, "
                          "Q6_K, IQ4_XS and IQ4_NL stay as stored). Experts in the file's map are read as stored."),
        click.option("-dev", "--device", default=None,
                     help="Compute device: cpu, cuda:N, or standin:N (the CPU standing in for a GPU: the GPU "
                          "code path with the host as its device, for testing placements without one); "
                          "llama.cpp's none, CPU, CUDA0, or CUDA0,CUDA1 (one stage per GPU). Default: cpu."),
        click.option("--gpus", default=None,
                     help="CUDA devices in PCI bus order, one stage each, e.g. 0,1 (llama.cpp's meaning; "
                          "the same as --devices cuda:0,cuda:1)."),
        click.option("--devices", default=None,
                     help="One stage per device, in layer order, in this process, e.g. cpu,cpu or "
                          "cuda:0,cuda:1 (a device named twice holds two stages)."),
        click.option("--miss-path", type=click.Choice(["auto", "fetch", "home"]), default="auto",
                     show_default=True,
                     help="GPU stages: an expert-cache miss is paged in to the GPU (fetch), computed by the CPU "
                          "where it lives (home), or whichever the cost model says is faster (auto)."),
        click.option("--h2d-bw", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="Host-to-GPU copy bandwidth in GB/s for the cost model (default: measured)."),
        click.option("--vram-bw", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="GPU memory bandwidth in GB/s for the cost model (default: NVML's figure)."),
        click.option("-ts", "--tensor-split", default=None,
                     help="Share of the layers per stage, e.g. 3,1 (llama.cpp's meaning; default: equal on CPUs)."),
        click.option("--pipeline-rank", type=click.IntRange(min=0), default=0, envvar="RANK", show_default=True,
                     help="This process's stage in a pipeline over processes (torchrun's RANK)."),
        click.option("--pipeline-world-size", type=click.IntRange(min=1), default=1, envvar="WORLD_SIZE",
                     show_default=True, help="Processes in the pipeline, one stage each (torchrun's WORLD_SIZE)."),
        click.option("--master-addr", default="127.0.0.1", envvar="MASTER_ADDR", show_default=True,
                     help="Rank 0's host (torchrun's MASTER_ADDR)."),
        click.option("--master-port", type=click.IntRange(1, 65535), default=29500, envvar="MASTER_PORT",
                     show_default=True, help="Rank 0's port (torchrun's MASTER_PORT)."),
        click.option("--pipeline-timeout", type=click.FloatRange(min=0, min_open=True), default=120.0,
                     show_default=True, help="Seconds to wait for the other ranks to join, or to answer a step."),
        click.option("--expert-parallel", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Ranks sharing each MoE layer's routed experts, each behind its own cache: devices of "
                          "this process (--devices, one per rank; else N times --device), or processes "
                          "(--ep-world-size; under torchrun, N = WORLD_SIZE makes its processes the ranks)."),
        click.option("--ep-rank", type=click.IntRange(min=0), default=0, show_default=True,
                     help="This process's rank in expert parallelism over processes (0 runs the command)."),
        click.option("--ep-world-size", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Processes in expert parallelism, one rank each, joined at --master-addr:--master-port."),
        click.option("--ep-timeout", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
                     help="Seconds to wait for the other expert-parallel ranks to join, or to answer a step."),
        click.option("--expert-split", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="Which rank owns which expert, per layer (a JSON split file; default: contiguous "
                          "ranges)."),
        click.option("--ram-budget", default=None, help="Host RAM moerun may use, e.g. 12GiB (default: available)."),
        click.option("--vram-budget", default=None,
                     help="GPU memory moerun may use per device, e.g. 6GiB or 6GiB,20GiB (default: free memory)."),
        click.option("-ncmoe", "--n-cpu-moe", type=click.IntRange(min=0), default=0,
                     help="llama.cpp's flag: routed experts of the first N layers stay on the CPU (with GPUs)."),
        click.option("-ot", "--override-tensor", multiple=True,
                     help="llama.cpp's REGEX=DEVICE placement override, matched on GGUF tensor names."),
        click.option("--print-plan", is_flag=True, help="Print the placement plan to stderr before running."),
        click.option("--trace-routing", type=click.Path(path_type=Path), default=None,
                     help="Record every routing decision (JSON Lines) for `moerun trace simulate`."),
        click.option("-v", "--verbose", is_flag=True, help="Per-layer expert-cache figures."),
        click.option("-md", "--model-draft", "--spec-draft-model", "model_draft", type=click.Path(exists=True, path_type=Path), default=None,
                     help="Speculative decoding with this draft model (GGUF or HF folder sharing the model's "
                          "vocabulary; loaded into RAM, run on the CPU)."),
        click.option("--lookup-ngram", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Speculative decoding by prompt lookup: drafts are what followed the latest earlier match "
                          "of the last N tokens (N down to 1) in the prompt and the text so far; 0 is off."),
        click.option("--draft-max", "--draft", "--draft-n", "--spec-draft-n-max", "draft_max", type=click.IntRange(min=0), default=16,
                     show_default=True, help="Tokens to draft per step at most (moerun verifies at most 15)."),
        click.option("--draft-min", "--draft-n-min", "--spec-draft-n-min", "draft_min", type=click.IntRange(min=0), default=0,
                     show_default=True, help="Drafts shorter than this are not verified."),
        click.option("--draft-p-min", "--spec-draft-p-min", "draft_p_min", type=click.FloatRange(0, 1), default=0.75, show_default=True,
                     help="The draft model stops where its most likely token is less likely than this."),
        click.option("-ctk", "--cache-type-k", type=click.Choice(KV_CACHE_TYPES), default=None,
                     help="KV cache type of the keys (llama.cpp's): f32, f16, bf16, or q8_0 / q4_0 blocks of 32 "
                          "values (default: the compute dtype; the fused C decode path reads and writes f32, f16 "
                          "and q8_0 (q8_0 when head_dim is a multiple of 32); bf16 and q4_0 decode through torch)."),
        click.option("-ctv", "--cache-type-v", type=click.Choice(KV_CACHE_TYPES), default=None,
                     help="KV cache type of the values (as -ctk)."),
        click.option("--draft-adaptive/--no-draft-adaptive", default=True, show_default=True,
                     help="Choose each step's draft length from the acceptance so far and the measured cost of "
                          "verifying it (up to --draft-max), or always draft up to --draft-max."),
    ]
    f = llama_options(f)
    for o in reversed(opts):
        f = o(f)
    return f


def _n_predict(ctx, param, value):
    """-n: llama.cpp's -1 (until the text ends) and -2 (until the context is full) -> a count no generation
    reaches (it ends with the text or the context: no context shift here)."""
    if value == 0:
        raise click.BadParameter("0 generates nothing: give 1 or more, -1 (until the text ends) or -2 (until "
                                 "the context is full)")
    return UNTIL_END if value < 0 else value


def sampling_options(f):
    opts = [
        click.option("-n", "--n-predict", "--predict", "max_tokens", type=click.IntRange(min=-2), default=128,
                     show_default=True, callback=_n_predict,
                     help="Tokens to generate at most; -1: until the text ends, -2: until the context is full."),
        click.option("--temp", "temperature", type=float, default=0.8, show_default=True,
                     help="Temperature; 0 is greedy."),
        click.option("--top-k", type=int, default=40, show_default=True, help="0 disables."),
        click.option("--top-p", type=float, default=0.95, show_default=True, help="1.0 disables."),
        click.option("--min-p", type=float, default=0.05, show_default=True, help="0.0 disables."),
        click.option("--repeat-penalty", type=float, default=1.0, show_default=True, help="1.0 disables."),
        click.option("--repeat-last-n", type=int, default=64, show_default=True,
                     help="Penalty window; -1 all tokens."),
        click.option("--presence-penalty", type=float, default=0.0, show_default=True),
        click.option("--frequency-penalty", type=float, default=0.0, show_default=True),
        click.option("-s", "--seed", type=int, default=-1, show_default=True, help="-1 picks a random seed."),
        click.option("--stop", multiple=True, help="Stop string (repeatable); not included in the output."),
        click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-sequence tokens."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def chat_template_options(f):
    """llama.cpp's --chat-template, --chat-template-file and --jinja."""
    opts = [
        click.option("--chat-template", default=None, metavar="NAME|TEMPLATE",
                     help="Chat template instead of the model's: a built-in one by name (qwen3, qwen3.5, glm-4.6, "
                          "deepseek-v3.1, mistral, mistral-small-3.2, gpt-oss, chatml, ...), or the template's "
                          "Jinja text itself."),
        click.option("--chat-template-file", default=None, metavar="FILE",
                     help="Chat template instead of the model's, read from a Jinja file."),
        click.option("--jinja", is_flag=True,
                     help="Accepted for llama.cpp's command lines; does nothing: templates are always Jinja here."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def chat_template_source(kw: dict) -> str | None:
    """Pops the chat template options out of kw -> the template they choose, checked (None: the model's)."""
    from moerun.text.templates import chat_template_override

    kw.pop("jinja")
    return chat_template_override(kw.pop("chat_template"), kw.pop("chat_template_file"))


def sampling_params(kw: dict, with_max_tokens: bool = True):
    """Pops the sampling options out of kw -> SamplingParams (serve takes max_tokens per request)."""
    from moerun.config import SamplingParams

    names = ("max_tokens",) * with_max_tokens + (
        "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
        "frequency_penalty", "ignore_eos")
    seed = kw.pop("seed")
    try:
        return SamplingParams(**{n: kw.pop(n) for n in names}, stop=tuple(kw.pop("stop")),
                              seed=None if seed < 0 else seed)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


RUNTIME_OPTIONS = ("model", "ctx_size", "ubatch", "threads", "dtype", "expert_cache_mib", "expert_cache_slots",
                   "expert_cache_plan", "expert_cache_trace",
                   "cache_policy", "cache_prefill", "prefetch", "use_mmap", "repack", "device", "gpus", "ram_budget",
                   "vram_budget", "n_cpu_moe", "override_tensor", "print_plan", "devices", "tensor_split",
                   "pipeline_rank", "pipeline_world_size", "master_addr", "master_port", "pipeline_timeout",
                   "miss_path", "h2d_bw", "vram_bw", "model_draft", "lookup_ngram", "draft_max", "draft_min",
                   "draft_p_min", "draft_adaptive", "cache_type_k", "cache_type_v", "n_gpu_layers", "mlock",
                   "expert_parallel", "ep_rank", "ep_world_size", "ep_timeout", "expert_split", "progress")


def gpu_devices(gpus: str) -> tuple[str, ...]:
    """llama.cpp's --gpus 0,1 -> ('cuda:0', 'cuda:1'), numbered in PCI bus order (set before CUDA starts)."""
    from moerun import device

    device.set_pci_order()
    try:
        return tuple(f"cuda:{int(i)}" for i in gpus.split(","))
    except ValueError:
        raise click.UsageError(f"--gpus {gpus}: give CUDA device numbers, e.g. 0,1") from None


def _split_list(text: str | None, convert, flag: str) -> tuple | None:
    if text is None:
        return None
    try:
        return tuple(convert(x) for x in text.split(","))
    except ValueError as e:
        raise click.UsageError(f"{flag} {text}: {e}") from None


def runtime_config(kw: dict):
    """Pops the model and placement options out of kw; -> (RuntimeConfig, whether to print the plan).

    On a pipeline or expert-parallel rank other than 0 it does not return: the process serves its stage or its
    experts until rank 0 stops it, then exits (the other ranks run no command of their own; rank 0 runs run, chat
    or serve)."""
    from moerun.config import DraftParams, RuntimeConfig
    from moerun.placement.devices import parse_size
    from moerun.placement.planner import parse_device, parse_override

    apply_llama_flags(kw)
    o = {name: kw.pop(name) for name in RUNTIME_OPTIONS}
    devices = _split_list(o["devices"], parse_device, "--devices") or ()
    if o["gpus"] is not None:
        if devices:
            raise click.UsageError("give --gpus or --devices, not both")
        devices = gpu_devices(o["gpus"])
    device, devices = device_flag(o["device"], devices)
    device, devices = gpu_layers(o["n_gpu_layers"], device, devices, o["device"] is not None,
                                 None if o["model"] is None else str(o["model"]))
    if o["expert_parallel"] > 1 and os.environ.get("WORLD_SIZE") == str(o["expert_parallel"]) and \
            o["ep_world_size"] == 1:  # torchrun's processes are the expert-parallel ranks, not pipeline stages
        o["ep_rank"], o["ep_world_size"] = o["pipeline_rank"], o["pipeline_world_size"]
        o["pipeline_rank"], o["pipeline_world_size"] = 0, 1
    try:
        overrides = tuple(pair for spec in o["override_tensor"] for pair in parse_override(spec))
        cfg = RuntimeConfig(
            model=None if o["model"] is None else str(o["model"]), device=device, ctx_size=o["ctx_size"],
            ubatch=o["ubatch"], threads=o["threads"], dtype=o["dtype"],
            ram_budget=None if o["ram_budget"] is None else parse_size(o["ram_budget"]),
            vram_budget=_split_list(o["vram_budget"], parse_size, "--vram-budget"),
            expert_cache_mib=o["expert_cache_mib"], expert_cache_slots=o["expert_cache_slots"],
            expert_cache_plan=o["expert_cache_plan"], expert_cache_trace=o["expert_cache_trace"],
            cache_policy=o["cache_policy"], cache_prefill=o["cache_prefill"], prefetch=o["prefetch"],
            mmap=o["use_mmap"], repack=o["repack"], mlock=o["mlock"],
            n_cpu_moe=o["n_cpu_moe"], override_tensor=overrides,
            devices=devices,
            tensor_split=_split_list(o["tensor_split"], float, "--tensor-split"),
            pipeline_rank=o["pipeline_rank"], pipeline_world_size=o["pipeline_world_size"],
            master_addr=o["master_addr"], master_port=o["master_port"], pipeline_timeout=o["pipeline_timeout"],
            expert_parallel=o["expert_parallel"], ep_rank=o["ep_rank"], ep_world_size=o["ep_world_size"],
            ep_timeout=o["ep_timeout"], expert_split=o["expert_split"],
            miss_path=o["miss_path"], h2d_gbps=o["h2d_bw"], vram_gbps=o["vram_bw"],
            model_draft=None if o["model_draft"] is None else str(o["model_draft"]),
            cache_type_k=o["cache_type_k"], cache_type_v=o["cache_type_v"],
            draft=DraftParams(draft_max=o["draft_max"], draft_min=o["draft_min"], draft_p_min=o["draft_p_min"],
                              lookup_ngram=o["lookup_ngram"], adaptive=o["draft_adaptive"]),
            progress=o["progress"])
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if cfg.pipeline_rank > 0 or cfg.ep_rank > 0:
        from moerun.runtime import serve_worker

        serve_worker(cfg)
        sys.exit(0)
    return cfg, o["print_plan"]


def _runtime(kw: dict):
    """Pops the model and placement options out of kw; -> the built Runtime (plan printed when asked)."""
    return _build(*runtime_config(kw))


def _build(cfg, print_plan: bool):
    from moerun.builtin import model_path
    from moerun.weights.preload import weights_ahead

    ahead = weights_ahead(model_path(cfg.model), cfg.repack) if cfg.copies_whole_model else None  # read as torch imports
    from moerun.runtime import build

    rt = build(cfg, ahead)
    if print_plan:
        click.echo(rt.plan.table(), err=True)
    for w in rt.warnings:
        click.echo(f"warning: {w}", err=True)
    return rt


def _trace(eng, path: Path | None):
    if path is None:
        return None
    from moerun.experts.trace import RouteRecorder

    rec = RouteRecorder(path, eng.model.spec)
    eng.model.on_route = rec
    return rec


def _log(rt, timings, verbose: bool, gen=None) -> None:
    """llama.cpp's timing lines (and the draft lengths chosen, with drafts), then the expert cache's (its figures
    since the last report): one line per stage when there are several, then their total; a lone stage on a
    device (GPU) names it."""
    from moerun.experts.stats import CacheStats

    lines = timings.log_lines()
    if gen is not None and gen.spec is not None:
        lines.append(gen.spec.lengths_line())
    stages = rt.stage_stats(reset=True)
    if stages:
        total = sum((s for _, s in stages), CacheStats())
        named = len(stages) > 1 or not stages[0][0].startswith("stage 0 (cpu")
        if named:
            lines += [s.summary_line().replace("expert cache:", f"expert cache, {label}:", 1) for label, s in stages]
        if len(stages) > 1 or not named:
            lines.append(total.summary_line())
        if verbose:
            lines += total.per_layer_lines()
    for line in lines:
        click.echo(line, err=True)


def _cache_json(rt) -> dict:
    """The expert cache's figures for --json: the total, and per stage when there are several."""
    from moerun.experts.stats import CacheStats

    stages = rt.stage_stats()
    if not stages:
        return {}
    out = {"expert_cache": sum((s for _, s in stages), CacheStats()).to_dict()}
    if len(stages) > 1:
        out["expert_cache_stages"] = [{"stage": label, **s.to_dict()} for label, s in stages]
    return out


@click.command()
@hub_options(progress=True)
@model_options
@sampling_options
@click.option("-p", "--prompt", default=None, help="Prompt text.")
@click.option("-f", "--file", "prompt_file", type=click.File("r", encoding="utf-8"), default=None,
              help="Read the prompt from a file.")
@click.option("--no-display-prompt", is_flag=True, help="Do not echo the prompt before the generated text.")
@click.option("-sys", "--system-prompt", "system", default=None,
              help="System prompt: the prompt becomes one user message after it, in the chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the text and timings.")
@chat_template_options
def run(prompt, prompt_file, no_display_prompt, system, as_json, trace_routing, verbose, **kw):
    """Complete a prompt, streaming the text to stdout; timings go to stderr. With -sys, --chat-template or
    --chat-template-file the prompt is one user message in the chat template (a single chat turn after the
    system prompt, the reply shown as written); without them it is completed as given."""
    params = sampling_params(kw)
    template_source = chat_template_source(kw)
    cfg, print_plan = runtime_config(kw)  # a pipeline rank other than 0 serves its stage here, and exits
    if prompt_file is not None:
        prompt = prompt_file.read()
    if not prompt:
        raise click.UsageError("give a prompt with -p or -f")
    rt = _build(cfg, print_plan)
    eng = rt.engine
    tracer = _trace(eng, trace_routing)
    if template_source is None and system is None:
        ids = eng.tokenizer.encode(prompt)
    else:
        from moerun.text import ChatTemplate

        template = ChatTemplate.for_tokenizer(eng.tokenizer, source=template_source)
        turns = [{"role": "system", "content": system}] * (system is not None)
        prompt = template.render([*turns, {"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = eng.tokenizer.encode(prompt, add_special=False)
    if len(ids) >= eng.ctx_size:
        rt.close()
        raise MoerunError(f"the prompt has {len(ids)} tokens but the context size is {eng.ctx_size}: give a "
                          "larger -c or a shorter prompt")
    gen = eng.generate(ids, params)
    if as_json:
        gen.run()
        out = {"prompt": prompt, "text": gen.text, "tokens": gen.tokens, "finish_reason": gen.finish_reason,
               "seed": gen.sampler.seed, "timings": gen.timings.to_dict(), **_cache_json(rt)}
        click.echo(json.dumps(out))
        if tracer is not None:
            tracer.writer.close()
        rt.close()
        return
    if not no_display_prompt:
        click.echo(prompt, nl=False)
    try:
        for piece in gen:
            click.echo(piece, nl=False)
            sys.stdout.flush()
    finally:  # the text's line ends even when an error or Ctrl-C cuts it short
        click.echo()
        sys.stdout.flush()
    _log(rt, gen.timings, verbose, gen)
    if tracer is not None:
        tracer.writer.close()
    rt.close()


def reasoning_format_option(f):
    return click.option("--reasoning-format", type=click.Choice(REASONING_FORMATS), default="auto",
                        show_default=True,
                        help="A chat model's reasoning (gpt-oss's analysis channel, <think>...</think>): "
                             "told apart from the answer (auto, deepseek), or left in it as the model wrote "
                             "it (none).")(f)


class _CtrlC:
    """Ctrl-C during a reply, as a flag the reply's loop reads after each piece (llama.cpp's chat does the same). The
    handler is moerun's own for the reply's time: a process started with SIGINT ignored (a shell's background job
    without job control, nohup) gets no KeyboardInterrupt from Python, and its reply ran on to the end of the context.
    Outside replies the disposition it started with stands (by default Ctrl-C at the prompt ends the chat)."""

    def __init__(self):
        self.hit = False

    def _on(self, signum, frame) -> None:
        self.hit = True

    def __enter__(self):
        self._old = signal.signal(signal.SIGINT, self._on)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._old)


class ReplyDisplay:
    """One reply on the terminal, llama-cli style: the answer on stdout; the reasoning, unless hidden, on
    stderr (dim on a terminal), ended by a line break before the answer goes on. `raw`: the text as the model
    wrote it, reasoning markers and all, on stdout. Either way the reply is kept with its reasoning apart."""

    def __init__(self, show_reasoning: bool, raw: bool):
        self.show, self.raw = show_reasoning, raw
        self.dim = sys.stderr.isatty()
        self.in_reasoning = False
        self.content, self.reasoning = [], []

    def __call__(self, text: str, pieces: list[tuple[str, str]]) -> None:
        """`text` as generated, `pieces` its (kind, text) parts."""
        for kind, part in pieces:
            (self.reasoning if kind == "reasoning" else self.content).append(part)
            if self.raw:
                continue
            if kind == "reasoning" and self.show:
                click.echo(f"\x1b[2m{part}\x1b[0m" if self.dim else part, nl=False, err=True)
                sys.stderr.flush()
                self.in_reasoning = True
            elif kind == "content":
                self.end_reasoning()
                click.echo(part, nl=False)
        if self.raw:
            click.echo(text, nl=False)
        sys.stdout.flush()

    def end_reasoning(self) -> None:
        if self.in_reasoning:
            click.echo(err=True)
            self.in_reasoning = False

    def message(self) -> dict:
        """The reply as the conversation keeps it (the template decides whether past reasoning is shown)."""
        reasoning = "".join(self.reasoning)
        return {"role": "assistant", "content": "".join(self.content),
                **({"reasoning_content": reasoning} if reasoning else {})}


@click.command()
@hub_options(progress=True)
@model_options
@sampling_options
@click.option("-sys", "--system-prompt", "--system", "system", default=None, help="System prompt.")
@reasoning_format_option
@click.option("--show-reasoning/--hide-reasoning", default=True, show_default=True,
              help="Show the model's reasoning (dim, on stderr) before its answer, or hide it.")
@chat_template_options
def chat(system, reasoning_format, show_reasoning, trace_routing, verbose, **kw):
    """Interactive chat with the model's chat template (or --chat-template's). Ctrl-C stops a reply, Ctrl-D
    exits, /clear forgets the conversation. When it outgrows the context (-c), its oldest turns are dropped;
    the system prompt stays.
    A reasoning model's reasoning is shown apart from its answer (--reasoning-format none: as written), and
    the conversation keeps the two apart, as the chat template wants them back."""
    from moerun.text import ChatTemplate
    from moerun.text.conversation import Conversation
    from moerun.text.reasoning import ReasoningParser, syntax_for

    params = sampling_params(kw)
    template_source = chat_template_source(kw)
    rt = _runtime(kw)
    eng = rt.engine
    tracer = _trace(eng, trace_routing)
    template = ChatTemplate.for_tokenizer(eng.tokenizer, source=template_source)
    syntax = None if template.is_fallback else syntax_for(template.source)
    if syntax is not None and not all(map(eng.tokenizer.renders, syntax.markers)):
        syntax = None
    seq = eng.new_sequence()
    conv = Conversation(system or None)
    # room kept for the reply when turns must go: -n tokens, at most half the context (llama.cpp's context
    # shift frees half of it too), so a long chat does not leave each reply a few tokens
    reserve = min(params.max_tokens, eng.ctx_size // 2)
    interactive, said_dropping = sys.stdin.isatty(), False

    def prompt(messages: list[dict]) -> list[int]:
        return eng.tokenizer.encode(template.render(messages, add_generation_prompt=True), add_special=False)

    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            if interactive:  # the shell's prompt starts on a line of its own
                click.echo()
            break
        except KeyboardInterrupt:
            click.echo()
            break
        if not line.strip():
            continue
        if line.strip() == "/clear":
            conv.clear()
            seq.free()
            click.echo("(the conversation is cleared)", err=True)
            continue
        before = list(conv.turns)
        conv.turns.append({"role": "user", "content": line})
        try:
            ids, dropped = conv.fit(prompt, eng.ctx_size - reserve)
            if dropped and len(ids) < eng.ctx_size and not said_dropping:
                stays = ", the system prompt stays" if conv.system else ""
                click.echo(f"note: the conversation outgrew the context (-c {eng.ctx_size}): its oldest turns "
                           f"are dropped{stays} (/clear starts afresh)", err=True)
                said_dropping = True
            gen = eng.generate(ids, params, seq)
            show = ReplyDisplay(show_reasoning, raw=reasoning_format == "none")
            parser = None if syntax is None else \
                ReasoningParser(syntax, template.generation_prompt(conv.messages))
            with _CtrlC() as ctrl_c:
                for piece in gen:
                    show(piece, [("content", piece)] if parser is None else parser.feed(piece))
                    if ctrl_c.hit:
                        break
            if ctrl_c.hit:
                show.end_reasoning()
                click.echo(" [interrupted]", nl=False)
            show("", [] if parser is None else parser.flush())
            show.end_reasoning()
            click.echo()
            sys.stdout.flush()
        except MoerunError as e:  # e.g. this message alone outgrows the context: say so, keep the history
            click.echo(f"error: {e}", err=True)
            conv.turns = before
            continue
        conv.turns.append(show.message())
        _log(rt, gen.timings, verbose, gen)
        if tracer is not None:
            tracer.request += 1
    if tracer is not None:
        tracer.writer.close()
    rt.close()
