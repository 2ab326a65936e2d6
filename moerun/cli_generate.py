"""`moerun run` and `moerun chat`: generate text from the command line, llama.cpp style."""

from __future__ import annotations

import json
import sys
from importlib import resources
from pathlib import Path

import click

from moerun.errors import MoerunError

DEFAULT_MODEL = "default-qwen3moe.gguf"


def default_model_path() -> Path:
    path = Path(str(resources.files("moerun") / "data" / DEFAULT_MODEL))
    if not path.is_file():
        raise MoerunError(f"the built-in default model is missing ({path}); pass a model with -m")
    return path


def model_options(f):
    opts = [
        click.option("-m", "--model", type=click.Path(path_type=Path), default=None,
                     help="GGUF file or Hugging Face folder (default: the built-in model)."),
        click.option("-c", "--ctx-size", type=click.IntRange(min=16), default=None,
                     help="Context size in tokens (default: the model's, at most 4096)."),
        click.option("-ub", "--ubatch", type=click.IntRange(min=1), default=512, show_default=True,
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
        click.option("--cache-policy", type=click.Choice(["lru", "lfu", "lfru"]), default="lru", show_default=True,
                     help="Expert cache eviction policy."),
        click.option("--cache-prefill", type=click.Choice(["bypass", "cache"]), default="bypass", show_default=True,
                     help="Prefill misses: compute at home without evicting (bypass), or page in (cache)."),
        click.option("--mmap/--no-mmap", "use_mmap", default=None,
                     help="Routed experts stay in the file's memory map (--mmap) or are copied to RAM "
                          "(--no-mmap). Default: RAM when the model takes under 70% of the available memory "
                          "and no expert cache is asked for."),
        click.option("--trace-routing", type=click.Path(path_type=Path), default=None,
                     help="Record every routing decision (JSON Lines) for `moerun trace simulate`."),
        click.option("-v", "--verbose", is_flag=True, help="Per-layer expert-cache figures."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def sampling_options(f):
    opts = [
        click.option("-n", "--n-predict", "max_tokens", type=click.IntRange(min=1), default=128, show_default=True,
                     help="Tokens to generate at most."),
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


def _sampling(kw: dict):
    from moerun.config import SamplingParams

    names = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
             "presence_penalty", "frequency_penalty", "ignore_eos")
    seed = kw.pop("seed")
    try:
        return SamplingParams(**{n: kw.pop(n) for n in names}, stop=tuple(kw.pop("stop")),
                              seed=None if seed < 0 else seed)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _cache(loaded, mib: float | None, slots: int | None, policy: str, prefill: str):
    """Attach an expert cache when asked for; -> the cache, or None."""
    from moerun.experts.cache import ExpertCache
    from moerun.model.moe import CachedExperts

    if mib is None and slots is None:
        return None
    if mib is not None and slots is not None:
        raise click.UsageError("give --expert-cache-mib or --expert-cache-slots, not both")
    store = loaded.model.store
    if slots is None:
        per_layer = max((store.expert_bytes(layer) for layer in store.layers), default=1)
        slots = int(mib * 2**20 // (per_layer * max(len(store.layers), 1)))
        if slots == 0:
            click.echo(f"warning: {mib} MiB holds no expert per layer ({per_layer / 2**20:.2f} MiB each); "
                       "every expert is read from its home tier", err=True)
    cache = ExpertCache(store, slots=slots, policy=policy, prefill=prefill)
    loaded.model.experts = CachedExperts(cache)
    return cache


def _engine(model: Path | None, ctx_size: int | None, ubatch: int, threads: int | None, dtype: str,
            expert_cache_mib=None, expert_cache_slots=None, cache_policy="lru", cache_prefill="bypass",
            use_mmap=None):
    import psutil
    import torch

    from moerun.engine.engine import Engine
    from moerun.loading import load_model
    from moerun.text import Tokenizer

    torch.set_num_threads(threads or psutil.cpu_count(logical=False) or 1)
    cached = expert_cache_mib is not None or expert_cache_slots is not None
    home = {None: "mmap" if cached else "auto", True: "mmap", False: "ram"}[use_mmap]
    loaded = load_model(model or default_model_path(), dtype=getattr(torch, dtype), home=home)
    tok = Tokenizer.from_model_file(loaded.file)
    ctx = ctx_size or min(4096, loaded.arch.spec.context_length)
    cache = _cache(loaded, expert_cache_mib, expert_cache_slots, cache_policy, cache_prefill)
    return Engine(loaded.model, tok, ctx_size=ctx, ubatch=ubatch, expert_cache=cache)


class _RouteRecorder:
    """Writes the model's routing decisions to a trace; `request` numbers the requests (chat turns)."""

    def __init__(self, path: Path, spec):
        from moerun.experts.trace import TraceHeader, TraceWriter

        if path.exists():
            raise MoerunError(f"{path} already exists; choose another --trace-routing file")
        self.writer = TraceWriter(path, TraceHeader.from_spec(spec))
        self.request = 0

    def __call__(self, layer, phase, pos, ids, w):
        self.writer.write_step(layer=layer, phase=phase, request_ids=[self.request] * len(pos),
                               positions=pos.tolist(), experts=ids, weights=w)


def _trace(eng, path: Path | None):
    if path is None:
        return None
    rec = _RouteRecorder(path, eng.model.spec)
    eng.model.on_route = rec
    return rec


def _log(eng, timings, verbose: bool) -> None:
    """llama.cpp's timing lines, then the expert cache's (its figures since the last report)."""
    lines = timings.log_lines()
    if eng.expert_cache is not None:
        stats = eng.expert_cache.stats
        lines.append(stats.summary_line())
        if verbose:
            lines += stats.per_layer_lines()
        stats.reset()
    for line in lines:
        click.echo(line, err=True)


@click.command()
@model_options
@sampling_options
@click.option("-p", "--prompt", default=None, help="Prompt text.")
@click.option("-f", "--file", "prompt_file", type=click.File("r", encoding="utf-8"), default=None,
              help="Read the prompt from a file.")
@click.option("--no-display-prompt", is_flag=True, help="Do not echo the prompt before the generated text.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the text and timings.")
def run(model, ctx_size, ubatch, threads, dtype, expert_cache_mib, expert_cache_slots, cache_policy, cache_prefill,
        use_mmap, trace_routing, verbose, prompt, prompt_file, no_display_prompt, as_json, **kw):
    """Complete a prompt, streaming the text to stdout; timings go to stderr."""
    params = _sampling(kw)
    if prompt_file is not None:
        prompt = prompt_file.read()
    if not prompt:
        raise click.UsageError("give a prompt with -p or -f")
    eng = _engine(model, ctx_size, ubatch, threads, dtype, expert_cache_mib, expert_cache_slots, cache_policy,
                  cache_prefill, use_mmap)
    tracer = _trace(eng, trace_routing)
    ids = eng.tokenizer.encode(prompt)
    gen = eng.generate(ids, params)
    if as_json:
        gen.run()
        out = {"prompt": prompt, "text": gen.text, "tokens": gen.tokens, "finish_reason": gen.finish_reason,
               "seed": gen.sampler.seed, "timings": gen.timings.to_dict()}
        if eng.expert_cache is not None:
            out["expert_cache"] = eng.expert_cache.stats.to_dict()
        click.echo(json.dumps(out))
        if tracer is not None:
            tracer.writer.close()
        return
    if not no_display_prompt:
        click.echo(prompt, nl=False)
    for piece in gen:
        click.echo(piece, nl=False)
        sys.stdout.flush()
    click.echo()
    sys.stdout.flush()
    _log(eng, gen.timings, verbose)
    if tracer is not None:
        tracer.writer.close()


@click.command()
@model_options
@sampling_options
@click.option("--system", default=None, help="System prompt.")
def chat(model, ctx_size, ubatch, threads, dtype, expert_cache_mib, expert_cache_slots, cache_policy, cache_prefill,
         use_mmap, trace_routing, verbose, system, **kw):
    """Interactive chat with the model's chat template. Ctrl-C stops a reply, Ctrl-D exits."""
    from moerun.text import ChatTemplate

    params = _sampling(kw)
    eng = _engine(model, ctx_size, ubatch, threads, dtype, expert_cache_mib, expert_cache_slots, cache_policy,
                  cache_prefill, use_mmap)
    tracer = _trace(eng, trace_routing)
    template = ChatTemplate.for_tokenizer(eng.tokenizer)
    seq = eng.new_sequence()
    messages = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            click.echo()
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        ids = eng.tokenizer.encode(template.render(messages, add_generation_prompt=True), add_special=False)
        try:
            gen = eng.generate(ids, params, seq)
            reply = []
            try:
                for piece in gen:
                    reply.append(piece)
                    click.echo(piece, nl=False)
                    sys.stdout.flush()
            except KeyboardInterrupt:
                click.echo(" [interrupted]", nl=False)
            click.echo()
            sys.stdout.flush()
        except MoerunError as e:  # e.g. the conversation outgrew the context: say so, keep the session
            click.echo(f"error: {e}", err=True)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": "".join(reply)})
        _log(eng, gen.timings, verbose)
        if tracer is not None:
            tracer.request += 1
    if tracer is not None:
        tracer.writer.close()
