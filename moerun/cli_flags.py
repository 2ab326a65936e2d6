"""llama.cpp's flags on moerun's commands: the table of the ones moerun accepts and what each means here
(LLAMA_FLAGS, the source of README's table), the declarations of those moerun has no setting of its own for,
and the check that reads a multi-letter short flag (-ngl, -fa, -sys) whole, as llama.cpp does, instead of as
click's cluster of one-letter flags (`-ngl 99` read as `-n gl`)."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import click

GENERATE = ("run", "chat", "serve")
ALL = ("run", "chat", "serve", "bench", "estimate", "inspect", "trace")
HUB = ("run", "chat", "serve", "bench", "estimate", "inspect")
UNTIL_END = 2**31 - 1  # -n -1 / -n -2: max_tokens no generation reaches (it ends with the text or the context)


@dataclass(frozen=True)
class LlamaFlag:
    """One of llama.cpp's flags as moerun reads it. names: its spellings, llama.cpp's (each an option of every
    command in `commands`); value: what follows it ("" for a switch); meaning: what it does here (README's
    table); note: the line printed when it is given and changes nothing here ("" when it always acts)."""

    names: tuple[str, ...]
    value: str
    commands: tuple[str, ...]
    meaning: str
    note: str = ""


LLAMA_FLAGS: tuple[LlamaFlag, ...] = (
    LlamaFlag(("-h", "--help"), "", ALL, "usage and every option"),
    LlamaFlag(("-m", "--model"), "FNAME", GENERATE, "a GGUF file or a Hugging Face folder (default: the built-in "
              "model)"),
    LlamaFlag(("-hf", "-hfr", "--hf-repo"), "REPO[:QUANT]", HUB, "a model on the Hugging Face Hub, downloaded into "
              "its cache: the GGUF of that quant (default Q4_K_M, else Q8_0), split files whole, or a safetensors "
              "model"),
    LlamaFlag(("-hff", "--hf-file"), "FILE", HUB, "that file of the -hf repository"),
    LlamaFlag(("-c", "--ctx-size"), "N", (*GENERATE, "estimate"), "context size in tokens"),
    LlamaFlag(("-n", "--predict", "--n-predict"), "N", GENERATE, "tokens to generate at most; -1: until the "
              "text ends, -2: until the context is full (either way it ends when the context is full: no "
              "context shift here)"),
    LlamaFlag(("-b", "--batch-size"), "N", GENERATE, "prompt tokens per step at most: caps -ub, as llama.cpp "
              "caps its micro-batch by its batch"),
    LlamaFlag(("-ub", "--ubatch-size"), "N", (*GENERATE, "bench"), "prompt tokens per step (the prefill "
              "chunk)"),
    LlamaFlag(("-t", "--threads"), "N", (*GENERATE, "bench", "estimate"), "CPU threads"),
    LlamaFlag(("-ngl", "--n-gpu-layers", "--gpu-layers"), "N", GENERATE, "layers whose dense weights go to the "
              "GPU: 0 keeps them on the CPU; any other N (or all, auto, -1) puts the model on every GPU found, "
              "the routed experts in RAM behind each GPU's expert cache",
              "no GPU here: every layer runs on the CPU, as on a CPU build of llama.cpp"),
    LlamaFlag(("-dev", "--device"), "DEV[,DEV]", GENERATE, "the devices: none or CPU (the CPU), CUDA0, "
              "CUDA0,CUDA1 (one stage per GPU, layers in order), and moerun's own cuda:0, standin:0"),
    LlamaFlag(("-ts", "--tensor-split"), "N,N", GENERATE, "share of the layers per stage"),
    LlamaFlag(("-cmoe", "--cpu-moe"), "", GENERATE, "every layer's routed experts stay on the CPU (with GPUs)"),
    LlamaFlag(("-ncmoe", "--n-cpu-moe"), "N", GENERATE, "the routed experts of the first N layers stay on the "
              "CPU (with GPUs)"),
    LlamaFlag(("-ot", "--override-tensor"), "PATTERN=BUFTYPE", GENERATE, "tensors matching PATTERN (GGUF "
              "names) are placed on BUFTYPE: CPU, CUDA0, ..."),
    LlamaFlag(("-fa", "--flash-attn"), "on|off|auto", GENERATE, "accepted; attention here is always fused "
              "(one SDPA call per prompt chunk, fused kernels in decode steps), so on, off and auto run the same",
              "attention here is always fused (SDPA in prompts, fused kernels in decode steps); -fa changes "
              "nothing"),
    LlamaFlag(("--mlock",), "", GENERATE, "lock the loaded weights (the whole process) in RAM with mlockall; "
              "one warning when the locked-memory limit (RLIMIT_MEMLOCK) refuses"),
    LlamaFlag(("--mmap", "--no-mmap"), "", (*GENERATE, "bench"), "routed experts stay in the file's memory map, "
              "or are copied to RAM (default: RAM when they fit)"),
    LlamaFlag(("--warmup", "--no-warmup"), "", GENERATE, "accepted; moerun runs no warm-up pass (as with "
              "--no-warmup)", "moerun runs no warm-up pass; the first request's timings include first touches "
              "of the weights"),
    LlamaFlag(("-ctk", "--cache-type-k"), "TYPE", (*GENERATE, "estimate"), "KV cache type of the keys"),
    LlamaFlag(("-ctv", "--cache-type-v"), "TYPE", (*GENERATE, "estimate"), "KV cache type of the values"),
    LlamaFlag(("-md", "--model-draft"), "FNAME", GENERATE, "speculative decoding with this draft model"),
    LlamaFlag(("--draft-max", "--draft", "--draft-n"), "N", GENERATE, "tokens to draft per step at most"),
    LlamaFlag(("--draft-min", "--draft-n-min"), "N", GENERATE, "drafts shorter than this are not verified"),
    LlamaFlag(("--draft-p-min",), "P", GENERATE, "the draft model stops below this probability"),
    LlamaFlag(("-s", "--seed"), "N", GENERATE, "sampling seed; -1 picks one"),
    LlamaFlag(("--temp",), "T", GENERATE, "temperature; 0 is greedy"),
    LlamaFlag(("--top-k",), "N", GENERATE, "top-k sampling; 0 disables"),
    LlamaFlag(("--top-p",), "P", GENERATE, "top-p sampling; 1.0 disables"),
    LlamaFlag(("--min-p",), "P", GENERATE, "min-p sampling; 0.0 disables"),
    LlamaFlag(("--repeat-penalty",), "X", GENERATE, "repetition penalty; 1.0 disables"),
    LlamaFlag(("--repeat-last-n",), "N", GENERATE, "the penalties' window; -1: all tokens"),
    LlamaFlag(("--presence-penalty",), "X", GENERATE, "presence penalty"),
    LlamaFlag(("--frequency-penalty",), "X", GENERATE, "frequency penalty"),
    LlamaFlag(("--ignore-eos",), "", GENERATE, "generate past end-of-sequence tokens"),
    LlamaFlag(("-p", "--prompt"), "TEXT", ("run",), "the prompt"),
    LlamaFlag(("-f", "--file"), "FNAME", ("run",), "read the prompt from a file"),
    LlamaFlag(("--no-display-prompt",), "", ("run",), "do not echo the prompt"),
    LlamaFlag(("-sys", "--system-prompt"), "TEXT", ("run", "chat"), "system prompt; `run` then sends -p as one "
              "user turn in the chat template after it"),
    LlamaFlag(("--jinja",), "", GENERATE, "accepted; chat templates are always Jinja here"),
    LlamaFlag(("--chat-template",), "NAME|TEMPLATE", GENERATE, "a built-in chat template by name, or the "
              "template's text"),
    LlamaFlag(("--chat-template-file",), "FNAME", GENERATE, "the chat template from a Jinja file"),
    LlamaFlag(("--reasoning-format",), "FORMAT", ("chat", "serve"), "reasoning apart from the answer (auto, "
              "deepseek) or left in it (none)"),
    LlamaFlag(("--host",), "HOST", ("serve",), "address to listen on"),
    LlamaFlag(("--port",), "PORT", ("serve",), "port to listen on"),
    LlamaFlag(("-np", "--parallel"), "N", ("serve",), "requests decoding together (slots)"),
    LlamaFlag(("-a", "--alias"), "NAME", ("serve",), "the model's name in the API"),
    LlamaFlag(("--api-key",), "KEY", ("serve",), "clients must send this bearer key"),
    LlamaFlag(("--slot-save-path",), "PATH", ("serve",), "folder for the slots' save and restore files"),
)


def flag(name: str) -> LlamaFlag:
    """LLAMA_FLAGS' entry that spells `name`."""
    return next(f for f in LLAMA_FLAGS if name in f.names)


def note(text: str) -> None:
    """One note line on stderr."""
    click.echo(f"note: {text}", err=True)


def readme_table() -> list[str]:
    """README's table of llama.cpp's flags, its header and rows, from LLAMA_FLAGS."""
    rows = ["| llama.cpp flag | commands | here |", "|---|---|---|"]
    for f in LLAMA_FLAGS:
        names = ", ".join(f"`{n}`" for n in f.names)
        value = f" `{f.value}`".replace("|", "\\|") if f.value else ""
        commands = "every command" if f.commands == ALL else ", ".join(f"`{c}`" for c in f.commands)
        rows.append(f"| {names}{value} | {commands} | {f.meaning.replace('|', chr(92) + '|')} |")
    return rows


# -- reading multi-letter short flags whole ----------------------------------------------------------------

_MULTI = re.compile(r"-[A-Za-z]{2}.*")


def _misread(name: str, opts: dict[str, click.Option]) -> bool:
    """Whether click would read `name` (-ngl) as a cluster of one-letter flags other than the user meant: a
    letter that is no flag of the command, or one that takes a value and would take the letters after it (-n gl).
    Switches followed by one flag with its value apart or attached as a number (-vp x, -vn5) read as written."""
    for k, c in enumerate(name[1:], 1):
        o = opts.get(f"-{c}")
        if o is None:
            return True
        if not (o.is_flag or o.count):
            rest = name[k + 1:]
            return bool(rest) and rest[0].isalpha()
    return False


def check_clusters(cmd: click.Command, ctx: click.Context, args: list[str]) -> None:
    """Refuse, by its own name, a multi-letter short flag `cmd` does not declare (-tb; -ngl where not taken)
    that click would misread as a cluster of one-letter flags (-n gl): llama.cpp reads `-ngl` as one flag. The
    ones a command declares (-ngl, -fa, -sys) click reads whole."""
    opts: dict[str, click.Option] = {}
    for p in cmd.get_params(ctx):
        if isinstance(p, click.Option):
            opts.update(dict.fromkeys((*p.opts, *p.secondary_opts), p))
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            return
        name = arg.split("=", 1)[0]
        p = opts.get(name)
        if p is not None:
            if "=" not in arg and not p.is_flag and not p.count:
                optional = getattr(p, "_flag_needs_value", False)
                if not optional or (i < len(args) and not args[i].startswith("-")):
                    i += 1  # its value, which may look like a flag (-p -x, -n -1)
            continue
        if _MULTI.fullmatch(arg) and _misread(name, opts):
            raise click.NoSuchOption(name, ctx=ctx)


# -- the flags moerun has no setting of its own for ------------------------------------------------------------


class GpuLayers(click.ParamType):
    """-ngl's value: a number of layers, or all / auto (-1)."""

    name = "N|all|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        if str(value).lower() in ("all", "auto"):
            return -1
        try:
            n = int(value)
        except ValueError:
            self.fail(f"{value!r} is not a number of layers, all or auto", param, ctx)
        if n < -1:
            self.fail(f"{n}: give 0 or more layers, or -1 (all)", param, ctx)
        return n


def llama_options(f):
    """llama.cpp's -ngl, -fa, -b, -cmoe, --mlock and --warmup/--no-warmup (run, chat, serve)."""
    opts = [
        click.option("-ngl", "--n-gpu-layers", "--gpu-layers", "n_gpu_layers", type=GpuLayers(), default=None, metavar="N",
                     help="llama.cpp's: layers whose dense weights go to the GPU. 0: none; any other N (or all, "
                          "auto, -1): the model on every GPU found (one stage each), its routed experts in RAM "
                          "behind each GPU's expert cache. With no GPU: a note, and the CPU runs it."),
        click.option("-fa", "--flash-attn", type=click.Choice(["on", "off", "auto"]), is_flag=False,
                     flag_value="on", default=None,
                     help="llama.cpp's; accepted: attention here is always fused (SDPA in prompts, fused kernels "
                          "in decode steps)."),
        click.option("-b", "--batch-size", type=click.IntRange(min=1), default=None,
                     help="llama.cpp's logical batch: prompt tokens per step at most (caps -ub)."),
        click.option("-cmoe", "--cpu-moe", is_flag=True,
                     help="llama.cpp's: every layer's routed experts stay on the CPU (with GPUs)."),
        click.option("--mlock", is_flag=True,
                     help="Lock the loaded weights in RAM (mlockall); a warning when the locked-memory limit "
                          "(RLIMIT_MEMLOCK, ulimit -l) refuses."),
        click.option("--warmup/--no-warmup", default=None,
                     help="llama.cpp's; accepted: moerun runs no warm-up pass."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def apply_llama_flags(kw: dict) -> None:
    """Pops -ngl, -fa, -b, -cmoe and --warmup out of kw and folds them into moerun's own settings there (-b
    caps -ub, -cmoe is --n-cpu-moe over every layer, -ngl chooses the devices), with a note for each that
    changes nothing here. --mlock stays in kw (a RuntimeConfig field)."""
    fa, batch, cpu_moe, warmup = (kw.pop(k) for k in ("flash_attn", "batch_size", "cpu_moe", "warmup"))
    if fa in ("on", "off"):
        note(f"-fa {fa}: {flag('-fa').note}")
    if warmup:
        note(f"--warmup: {flag('--warmup').note}")
    if batch is not None:
        kw["ubatch"] = min(kw["ubatch"], batch)
    if cpu_moe:
        kw["n_cpu_moe"] = UNTIL_END


def device_flag(device: str | None, devices: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """-dev's value (llama.cpp's none, CPU, CUDA0 or CUDA0,CUDA1; moerun's cpu, cuda:0, standin:0) -> (device,
    stage devices)."""
    from moerun.placement.planner import parse_device

    if device is None:
        return "cpu", devices
    try:
        named = tuple("cpu" if d.strip().lower() == "none" else parse_device(d) for d in device.split(","))
    except ValueError as e:
        raise click.UsageError(f"-dev {device}: {e}") from None
    if len(named) == 1:
        return named[0], devices
    if devices:
        raise click.UsageError("give -dev/--device or --devices, not both")
    return "cpu", named


def find_gpus() -> tuple[str, ...]:
    """Every CUDA device, in PCI bus order."""
    from moerun import device

    device.set_pci_order()
    return tuple(f"cuda:{i}" for i in range(device.cuda_count()))


def _model_layers(model: str | None) -> int | None:
    from moerun.arch import resolve
    from moerun.builtin import model_path
    from moerun.formats import open_model

    try:
        with open_model(model_path(model)) as mf:
            return resolve(mf).spec.n_layers
    except Exception:  # noqa: BLE001 - the build that follows says what is wrong with the model
        return None


def gpu_layers(ngl: int | None, device: str, devices: tuple[str, ...], device_given: bool,
               model: str | None) -> tuple[str, tuple[str, ...]]:
    """-ngl applied to the devices chosen so far -> (device, stage devices). 0 keeps the CPU (refused next to
    GPUs named); N > 0 or -1 takes the GPUs named, else every GPU found, else runs on the CPU with a note. A
    GPU stage holds the dense weights of all its layers: an N below the model's layers says so."""
    if ngl is None:
        return device, devices
    placed = devices or (device,)
    on_gpu = any(d != "cpu" for d in placed)
    if ngl == 0:
        if on_gpu:
            raise click.UsageError(f"-ngl 0 keeps every layer on the CPU, but {', '.join(placed)} is named: "
                                   "drop one of them")
        return device, devices
    if not on_gpu:
        if device_given:  # -dev none / CPU: llama.cpp too offloads nothing
            return device, devices
        gpus = find_gpus()
        if not gpus:
            note(f"-ngl {ngl}: {flag('-ngl').note}")
            return device, devices
        device, devices = "cpu", gpus
    n = _model_layers(model) if ngl > 0 else None
    if n is not None and ngl < n:
        note(f"-ngl {ngl}: a GPU stage holds the dense weights of all its layers, so all {n} go to the GPU "
             "(the routed experts stay in RAM behind its expert cache; -ncmoe and -ot keep experts on the CPU)")
    return device, devices


# -- models on the Hugging Face Hub ----------------------------------------------------------------------------


def hub_model(model: str | None, hf_repo: str | None = None, hf_file: str | None = None,
              progress: bool = False) -> str | None:
    """The local path of `-m MODEL` / `-hf REPO[:QUANT]` / `--hf-file FILE`: a hub reference downloaded (or found
    in the cache) by moerun.hub, which is imported only for one; anything else unchanged."""
    if hf_repo is None and hf_file is None and not (isinstance(model, str) and model.startswith("hf://")):
        return model
    from moerun.hub import resolve

    return resolve(model, hf_repo, hf_file, progress=progress)


def hub_options(param: str = "model", required: bool = False, progress: bool = False):
    """llama.cpp's -hf/-hfr/--hf-repo REPO[:QUANT] and -hff/--hf-file FILE on a command whose model is the
    parameter `param` (`models`: bench's repeatable -m, which the hub's model joins); the command receives local
    paths. required: the command needs a model (-m, MODEL or -hf). With them, --no-progress: the download's
    bars (and, with `progress`, the command's own: it receives `progress`, whether bars are drawn) are shown
    only on a terminal, and never with it."""

    def decorate(f):
        @functools.wraps(f)
        def command(*args, **kw):
            from moerun.progress import shown

            repo, file, bars = kw.pop("hf_repo"), kw.pop("hf_file"), shown(kw.pop("no_progress"))
            if param == "models":
                kw[param] = (*(hub_model(m, progress=bars) for m in kw[param]),
                             *([hub_model(None, repo, file, bars)] * bool(repo or file)))
            else:
                kw[param] = hub_model(kw[param], repo, file, bars)
            if required and not kw[param]:
                raise click.UsageError(f"give {'-m MODEL' if param == 'models' else 'MODEL'} or -hf REPO[:QUANT]")
            if progress:
                kw["progress"] = bars
            return f(*args, **kw)

        command = click.option("--no-progress", is_flag=True,
                               help="No progress bars (downloads, loading, probes); they show only on a "
                                    "terminal anyway.")(command)
        command = click.option("-hff", "--hf-file", "hf_file", default=None, metavar="FILE",
                               help="llama.cpp's: that file of the -hf repository.")(command)
        return click.option("-hf", "-hfr", "--hf-repo", "hf_repo", default=None, metavar="REPO[:QUANT]",
                            help="llama.cpp's: a model on the Hugging Face Hub, downloaded into its cache (a GGUF "
                                 "of that quant, default Q4_K_M, else Q8_0; or a safetensors model); -m "
                                 "hf://REPO[:QUANT] too.")(command)

    return decorate
