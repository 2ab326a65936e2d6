"""`moerun serve`: an OpenAI-compatible HTTP server with continuous batching (llama-server's flags)."""

from __future__ import annotations

import dataclasses
import errno
import logging
import socket
import sys
from pathlib import Path

import click

from moerun.builtin import model_path
from moerun.cli_flags import UNTIL_END, hub_options
from moerun.cli_generate import (
    chat_template_options,
    chat_template_source,
    model_options,
    reasoning_format_option,
    runtime_config,
    sampling_options,
    sampling_params,
)
from moerun.errors import MoerunError
from moerun.weights.preload import weights_ahead


def _serve_sampling_options(f):
    """run/chat's sampling flags as the defaults for requests; -n is llama-server's (-1, -2: until the context
    is full or the model ends)."""
    f = sampling_options(f)
    for p in f.__click_params__:
        if p.name == "max_tokens":
            p.default = -1
            p.help = ("Tokens to generate at most for requests that set no max_tokens; -1 or -2: until the text "
                      "ends or the context is full.")
    return f


def check_slots_fit(plan, parallel: int) -> None:
    """The planner sizes the KV cache for one context; serve holds `parallel` of them. Under an explicit
    --ram-budget that they overflow, say what fits instead of overrunning the budget. A slot holds its
    context's attention KV (ctx x kv_bytes_per_token) and, for a hybrid model, the linear layers' recurrent
    state (live and checkpoint: state_bytes_per_seq), which a shorter context does not shrink."""
    from moerun.placement.devices import format_size

    one = plan.context_bytes()
    rest = plan.ram_bytes - one  # dense weights, expert cache, experts in RAM
    need = rest + parallel * one
    if need <= plan.ram_budget:
        return
    room = plan.ram_budget - rest
    fits = [f"-np {room // one} with -c {plan.ctx_size}"] if room >= one else []
    per_slot = (room // parallel - plan.state_bytes_per_seq) // max(plan.kv_bytes_per_token, 1) \
        if room > 0 else 0
    if per_slot >= 16:
        fits.append(f"-np {parallel} with -c {per_slot}")
    fit = "; it fits " + " or ".join(fits) if fits else "; no context fits: give a larger --ram-budget"
    what = "of KV cache and recurrent state" if plan.state_bytes_per_seq else "of KV cache"
    raise MoerunError(f"-np {parallel} slots of {plan.ctx_size} tokens need {format_size(parallel * one)} "
                      f"{what}, "
                      f"{format_size(need)} in all with the weights and expert cache, but --ram-budget is "
                      f"{format_size(plan.ram_budget)}{fit}")


def listen(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to host:port, one per address the host resolves to (as uvicorn's own binding makes them),
    for uvicorn to serve on: a port in use is one clear error before the model loads, not uvicorn's startup
    failure after it."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise MoerunError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(addresses):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # "::" next to "0.0.0.0"
            sock.bind(address)
    except OSError as e:
        for sock in socks:
            sock.close()
        why = ("the port is in use (another server?); choose another --port" if e.errno == errno.EADDRINUSE
               else e.strerror or str(e))
        raise MoerunError(f"cannot listen on {host}:{port}: {why}") from None
    return socks


def preflight(rcfg, parallel: int) -> None:
    """Plan the placement from the model's metadata before the server starts, so that a model that cannot be
    read or placed (or slots that overflow --ram-budget) ends in one line, not in the server's log."""
    from moerun.runtime import plan_for

    try:
        the_plan = plan_for(rcfg)
    except (OSError, ValueError) as e:  # what the readers raise beyond their own errors
        raise MoerunError(f"cannot read {model_path(rcfg.model)}: {e}") from None
    if rcfg.ram_budget is not None:
        check_slots_fit(the_plan, parallel)


@click.command()
@hub_options(progress=True)
@model_options
@_serve_sampling_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True)
@click.option("--api-key", envvar="MOERUN_API_KEY", default=None,
              help="Clients must send 'Authorization: Bearer KEY' (/health stays open). Also MOERUN_API_KEY.")
@click.option("-np", "--parallel", type=click.IntRange(min=1), default=4, show_default=True,
              help="Requests decoding together (slots); each may use the whole context.")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests waiting for a slot; one more is answered 503.")
@click.option("-a", "--alias", multiple=True,
              help="Model name for /v1/models and requests (repeatable; default: the model file's name).")
@click.option("--strict-model-name", is_flag=True,
              help="A request naming another model than the served one (or an alias) is 404; by default the one "
                   "model answers any name, as llama-server does.")
@click.option("--responses-max", type=click.IntRange(min=0), default=1000, show_default=True,
              help="Responses /v1/responses keeps for previous_response_id (the most recently used; 0: none).")
@click.option("--load-form", type=click.Choice(["object", "array"]), default="object", show_default=True,
              help="/get_load's shape for a router's power_of_two: object (vllm-router) or array (sglang-router).")
@click.option("--max-body-size", default="16MiB", show_default=True, help="Largest request body, e.g. 1MiB.")
@click.option("--cache-prompt/--no-cache-prompt", default=True, show_default=True,
              help="Slots keep their KV cache after a request, so a request sharing a prefix skips it.")
@click.option("--log-interval", type=click.FloatRange(min=0), default=5.0, show_default=True,
              help="Seconds between throughput lines while busy (0: none).")
@click.option("--slot-save-path", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for /slots/{id}?action=save|restore files (llama-server's; without it, none).")
@click.option("--webui/--no-webui", default=True, show_default=True,
              help="GET / serves the web page: chat, and a live view of the experts, cache and placement.")
@reasoning_format_option
@chat_template_options
def serve(host, port, api_key, parallel, max_queue, alias, strict_model_name, responses_max, load_form, max_body_size,
          cache_prompt, log_interval, slot_save_path, webui, reasoning_format, trace_routing, verbose, **kw):
    """OpenAI-compatible server: /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages (Anthropic's),
    /v1/models, llama-server's /completion, /props, /apply-template, /health, /metrics."""
    max_tokens = kw.pop("max_tokens")
    defaults = sampling_params(kw, with_max_tokens=False)
    template = chat_template_source(kw)
    rcfg, print_plan = runtime_config(kw)
    rcfg = dataclasses.replace(rcfg, kv_contexts=parallel)  # a GPU's plan holds -np contexts of KV
    model = model_path(rcfg.model)
    ahead = weights_ahead(model, rcfg.repack) if rcfg.copies_whole_model else None  # read while the modules import
    import uvicorn

    from moerun.config import ServerConfig
    from moerun.placement.devices import parse_size
    from moerun.server.app import create_app

    names = tuple(alias) or (model.name,)
    try:
        cfg = ServerConfig(model_names=names, host=host, port=port, api_key=api_key, parallel=parallel,
                           max_queue=max_queue, max_body_bytes=parse_size(max_body_size),
                           n_predict=None if max_tokens == UNTIL_END else max_tokens, defaults=defaults,
                           cache_prompt=cache_prompt, log_interval=log_interval,
                           reasoning_format=reasoning_format, slot_save_path=slot_save_path,
                           strict_model_name=strict_model_name, model_path=str(model), chat_template=template,
                           responses_max=responses_max, load_form=load_form, webui=webui)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if trace_routing is not None and trace_routing.exists():
        raise MoerunError(f"{trace_routing} already exists; choose another --trace-routing file")
    socks = listen(host, port)
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S", force=True)
    log = logging.getLogger("moerun.server")
    if not cfg.loopback and cfg.api_key is None:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the model", host)
    try:
        preflight(rcfg, parallel)
    except BaseException:
        if ahead is not None:
            ahead.close()
        for sock in socks:
            sock.close()
        raise

    def load():
        from moerun.runtime import build

        rt = build(rcfg, ahead)
        if print_plan:
            log.info("placement plan:\n%s", rt.plan.table())
        return rt

    class Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame):  # Ctrl-C / SIGTERM: end the streams in flight, then uvicorn's shutdown
            app.state.server.begin_shutdown()
            super().handle_exit(sig, frame)

    def stop_on_error(e: BaseException) -> None:
        uv.should_exit = True

    app = create_app(cfg, load, on_load_error=stop_on_error, trace_routing=trace_routing)
    uv = Uvicorn(uvicorn.Config(app, host=host, port=port, log_config=None, timeout_graceful_shutdown=5,
                                timeout_keep_alive=30))
    log.info("moerun serve: http://%s:%d (OpenAI API under /v1%s), loading %s", host, port,
             "; the web page at /" if webui else "", model)
    uv.run(sockets=socks)
    error = app.state.server.load_error or app.state.server.fatal
    if error is not None:
        raise error if isinstance(error, MoerunError) else MoerunError(f"loading the model failed: {error}")
    if not uv.started:
        sys.exit(1)
