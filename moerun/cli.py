"""The `moerun` command line (click)."""

from __future__ import annotations

import atexit
import gc
import json
import sys
from typing import NoReturn

import click

from moerun.cli_bench import bench
from moerun.cli_estimate import estimate
from moerun.cli_flags import check_clusters, hub_options
from moerun.cli_generate import chat, run
from moerun.cli_serve import serve
from moerun.errors import MoerunError
from moerun.experts.simulate_cli import trace


def _exit_now(code) -> NoReturn:
    """End the process as the interpreter would, but without its teardown: non-daemon threads are joined and
    the exit functions run (as at any exit), stdout and stderr flushed, and then the modules and the objects
    torch made (some 170,000) are left to the operating system instead of being freed one by one."""
    import os
    import threading

    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    getattr(threading, "_shutdown", lambda: None)()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0 if code is None else code)


class _Group(click.Group):
    """Turns moerun's own errors into one line on stderr and exit status 1, never a traceback; reads a
    subcommand's multi-letter short flags whole, as llama.cpp does (moerun.cli_flags.check_clusters)."""

    def main(self, args=None, **kwargs):
        """As click's; a process run from the command line (args None: sys.argv) then ends through _exit_now."""
        if args is not None:  # called from Python (tests, CliRunner): returns or raises as click does
            return super().main(args, **kwargs)
        try:
            return super().main(**kwargs)
        except SystemExit as e:
            _exit_now(e.code)

    def resolve_command(self, ctx, args):
        name, cmd, rest = super().resolve_command(ctx, args)
        if cmd is not None and not cmd.context_settings.get("ignore_unknown_options"):
            check_clusters(cmd, click.Context(cmd, info_name=name, parent=ctx), rest)
        return name, cmd, rest

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MoerunError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moerun")
def main():
    """moerun: run Mixture-of-Experts models larger than your GPU."""
    # Start-up makes ~3 x 10^5 objects that live as long as the process (torch's modules, the tokenizer's, the
    # model's; load_model then freezes them): at Python's default young threshold (700) torch's import alone runs
    # ~400 collections. 20,000 keeps collecting, ~30 times less often (0.19 s less a start on 2 cores).
    gc.set_threshold(20_000, 20, 50)


main.add_command(run)
main.add_command(chat)
main.add_command(trace)
main.add_command(bench)
main.add_command(estimate)
main.add_command(serve)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def _fmt_count(n: float) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


@main.command()
@hub_options(required=True)
@click.argument("model", type=click.Path(), required=False)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(model: str, as_json: bool):
    """Describe MODEL (GGUF file or Hugging Face folder; `default`: the built-in model) without loading its
    weights."""
    from moerun.arch import resolve
    from moerun.arch.summary import sequence_bytes, summarize
    from moerun.builtin import model_path
    from moerun.formats import open_model

    model = model_path(model)
    with open_model(model) as mf:
        arch = resolve(mf)
        s = summarize(arch)
        qtypes = sorted({src.records[0].qtype.name for src in arch.sources.values()})
    spec = arch.spec
    seq = sequence_bytes(spec, KV_DTYPE_BYTES)
    kinds = list(spec.layer_kinds or ("full",) * spec.n_layers)
    info = {
        "path": str(model), "format": mf.format, "family": spec.family, "layers": spec.n_layers,
        "moe_layers": sum(spec.moe_layers), "experts": spec.n_experts, "experts_used": spec.n_experts_used,
        "shared_experts": 1 if spec.shared_ffn else 0, "hidden": spec.hidden, "expert_ffn": spec.expert_ffn,
        "shared_ffn": spec.shared_ffn, "dense_ffn": spec.dense_ffn, "heads": spec.n_heads,
        "kv_heads": spec.n_kv_heads, "head_dim": spec.head_dim, "vocab": spec.vocab,
        "context_length": spec.context_length, "attention": spec.attention, "layer_kinds": kinds,
        "linear_layers": seq.linear_layers, "linear_attention": _linear_info(spec) if spec.hybrid else None,
        "kv_dtype": "float32", **seq.to_dict(), "qtypes": qtypes, **s.to_dict(),
    }
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"model            {model} ({mf.format})")
    click.echo(f"family           {spec.family}")
    mix = f"; {seq.linear_layers} linear attention, {spec.n_layers - seq.linear_layers} full attention" \
        if spec.hybrid else ""
    click.echo(f"layers           {spec.n_layers} ({sum(spec.moe_layers)} MoE{mix})")
    click.echo(f"experts          {spec.n_experts} routed, {spec.n_experts_used} active per token, "
               f"{info['shared_experts']} shared")
    click.echo(f"hidden           {spec.hidden}  (expert FFN {spec.expert_ffn}, shared FFN {spec.shared_ffn})")
    if spec.attention == "mla":
        q = f"q latent {spec.q_lora_rank}, " if spec.q_lora_rank else ""
        click.echo(f"attention        {spec.n_heads} heads x {spec.head_dim} / {spec.v_head_dim}, MLA: {q}KV "
                   f"latent {spec.kv_lora_rank} + RoPE {spec.qk_rope_dim} cached, RoPE {spec.rope_style} "
                   f"theta {spec.rope_theta:g}{_attention_extras(spec)}")
    else:
        click.echo(f"attention        {spec.n_heads} heads / {spec.n_kv_heads} KV heads x {spec.head_dim}, "
                   f"RoPE {spec.rope_style} theta {spec.rope_theta:g}{_attention_extras(spec)}")
    if spec.hybrid:
        click.echo(f"linear attention gated DeltaNet on {seq.linear_layers} of {spec.n_layers} layers: "
                   f"{spec.ssm_k_heads} key heads x {spec.ssm_k_dim}, "
                   f"{spec.ssm_v_heads} value heads x {spec.ssm_v_dim}, conv kernel {spec.ssm_conv}")
    click.echo(f"KV cache         {_kv_line(seq)}")
    click.echo(f"vocab            {spec.vocab}, context {spec.context_length}")
    click.echo(f"parameters       {_fmt_count(s.total_params)} total ({s.total_params}), "
               f"{_fmt_count(s.active_params)} active per token ({s.active_params})")
    click.echo(f"size             {_fmt_bytes(s.total_bytes)}; weights read per token "
               f"{_fmt_bytes(s.bytes_per_token)}")
    click.echo("bytes by tensor class:")
    for cls, by_q in sorted(s.by_class.items()):
        parts = ", ".join(f"{q} {_fmt_bytes(b)}" for q, b in sorted(by_q.items()))
        click.echo(f"  {cls:<16} {_fmt_bytes(sum(by_q.values())):>12}   ({parts})")


KV_DTYPE_BYTES = 4  # inspect's KV figures: float32, the default --dtype (bfloat16 halves KV, not the state)


def _attention_extras(spec) -> str:
    """Partial rotary, YaRN, sliding windows, sinks and the output gate, where the model has them."""
    out = ""
    if spec.attention == "gqa" and spec.rotary_dim < spec.head_dim:
        out += f" on {spec.rotary_dim} of {spec.head_dim} dims"
    if spec.yarn is not None:
        out += f", YaRN x{spec.yarn.factor:g} over {spec.yarn.original_context}"
    n = sum(spec.sliding(i) for i in range(spec.n_layers))
    if n:
        out += f"; window {spec.sliding_window} on {n} of {spec.n_layers} layers"
    if spec.hybrid:
        full = sum(not spec.linear(i) for i in range(spec.n_layers))
        out += f"; full attention on {full} of {spec.n_layers} layers"
    return out + ("; sinks" if spec.attn_sinks else "") + ("; output gate" if spec.attn_gate else "")


def _linear_info(spec) -> dict:
    """The linear-attention (gated DeltaNet) layers' shape, for --json."""
    return {"key_heads": spec.ssm_k_heads, "value_heads": spec.ssm_v_heads, "key_dim": spec.ssm_k_dim,
            "value_dim": spec.ssm_v_dim, "conv_kernel": spec.ssm_conv, "conv_dim": spec.ssm_conv_dim,
            "value_order": spec.ssm_v_order, "state_bytes_per_layer": spec.state_layout(
                next(i for i in range(spec.n_layers) if spec.linear(i))).elems() * 4}


def _layers(n: int) -> str:
    return f"{n} layer" + "s" * (n != 1)


def _kv_line(seq) -> str:
    """What one sequence holds: KV per token (float32), windows' rings and recurrent state per sequence."""
    parts = [f"{_fmt_bytes(seq.kv_per_token)} per token over {_layers(seq.kv_layers)} (float32)"] \
        if seq.kv_layers else []
    if seq.window_layers:
        parts.append(f"{_fmt_bytes(seq.window_bytes)} per sequence in the windows of "
                     f"{_layers(seq.window_layers)}")
    if seq.linear_layers:
        parts.append(f"recurrent state {_fmt_bytes(seq.state_bytes)} per sequence over "
                     f"{_layers(seq.linear_layers)} (float32, fixed)")
    return "; ".join(parts)


_PASSTHROUGH = {"ignore_unknown_options": True, "help_option_names": []}


@main.command("make-model", context_settings=_PASSTHROUGH, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def make_model(args):
    """Write a synthetic model with random weights (GGUF or safetensors). See `moerun make-model --help`."""
    from moerun.tools.make_model import main as tool_main

    sys.exit(tool_main(list(args), prog="moerun make-model"))


@main.command("convert", context_settings=_PASSTHROUGH, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def convert(args):
    """Convert a Hugging Face MoE checkpoint to GGUF. See `moerun convert --help`."""
    from moerun.tools.convert import main as tool_main

    sys.exit(tool_main(list(args), prog="moerun convert"))
