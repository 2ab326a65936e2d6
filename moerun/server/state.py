"""What the routes share: the server's configuration, then the loaded model and its engine loop.

The model loads on a thread (`Server.start_loading`) while the app already answers: until it is ready,
`Server.require` is a 503 "Loading model"; a load that fails is kept in `load_error` (/health says 500). A model
split over processes that loses one (PeerLostError) is kept in `fatal`: /health and requests are 503, and the
server stops.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from moerun.config import ServerConfig
from moerun.errors import MoerunError
from moerun.server.chat import say_reasoning
from moerun.server.errors import APIError
from moerun.server.metrics import Telemetry, ThroughputLog
from moerun.server.ready import Ready

if TYPE_CHECKING:  # torch and the model load on the loader thread, after the port answers
    from moerun.runtime import Runtime
    from moerun.server.trace import ServeRouteRecorder

log = logging.getLogger("moerun.server")


class Server:
    """What the routes share: the configuration, then the loaded model and its engine loop. on_load_error: called
    when the server must stop, with why: its model failed to load, or lost a process it runs across."""

    def __init__(self, cfg: ServerConfig, load: Callable[[], Runtime],
                 on_load_error: Callable[[BaseException], None] | None = None,
                 trace_routing: Path | None = None):
        self.cfg, self._load_fn, self.on_load_error = cfg, load, on_load_error
        self.trace_routing = trace_routing
        self.tracer: ServeRouteRecorder | None = None
        self.ready: Ready | None = None
        self.load_error: BaseException | None = None
        self.fatal: MoerunError | None = None  # a process the model runs across is gone: the server stops
        self.telemetry = Telemetry(self.snapshot, device=lambda: self.ready.runtime.engine.device_label
                                   if self.ready else "cpu")
        self.throughput = ThroughputLog(self.snapshot, cfg.log_interval)
        self.stopping = False  # shutdown has begun: a generation that fails now is a 503, not a 500
        self._named_other = False  # a request named another model: said once in the log

    def snapshot(self):
        return self.ready.scheduler.snapshot() if self.ready is not None else None

    def start_loading(self) -> None:
        threading.Thread(target=self._load, name="moerun-load", daemon=True).start()

    def _load(self) -> None:
        try:
            from moerun.engine.scheduler import EngineLoop, Scheduler
            from moerun.text import ChatTemplate, ChatTemplateError

            t0 = time.perf_counter()
            rt = self._load_fn()
            for w in rt.warnings:
                log.warning(w)
            eng, cfg = rt.engine, self.cfg
            sched = Scheduler(eng, parallel=cfg.parallel, max_queue=cfg.max_queue, observer=self.telemetry)
            template = error = None
            try:
                template = ChatTemplate.for_tokenizer(eng.tokenizer, source=cfg.chat_template)
            except ChatTemplateError as e:
                error = str(e)
                log.warning("chat completions are off: %s", e)
            else:
                say_reasoning(template, eng.tokenizer, cfg.reasoning_format)
            if self.trace_routing is not None:
                from moerun.server.trace import ServeRouteRecorder

                self.tracer = ServeRouteRecorder(self.trace_routing, eng.model.spec, sched)
                eng.model.on_route = self.tracer
            loop = EngineLoop(sched, after_step=lambda: self._after_step(sched))
            if self.stopping:
                return
            loop.start()
            self.ready = Ready(rt, sched, loop, template, error)
            kv = eng.pool.nbytes
            trace = "" if self.tracer is None else f", routing trace to {self.trace_routing}"
            log.info("model loaded in %.2f s: %s, context %d tokens x %d slots (KV cache %.1f MiB), %s%s",
                     time.perf_counter() - t0, self.cfg.model_names[0], eng.ctx_size, cfg.parallel, kv / 2**20,
                     cache_summary(rt), trace)
        except BaseException as e:  # reported; then the server stops
            self.load_error = e
            log.error("loading the model failed: %s", e, exc_info=not isinstance(e, MoerunError))
            if self.on_load_error is not None:
                self.on_load_error(e)

    def _after_step(self, sched) -> None:
        self.throughput.tick()
        if sched.peer_lost and self.fatal is None:
            self.fatal = MoerunError(f"the model cannot be used any more: {sched.fault}")
            log.error("%s; stopping the server", self.fatal)
            if self.on_load_error is not None:
                self.on_load_error(self.fatal)

    def begin_shutdown(self) -> None:
        """Requests in flight end now with an error event, so their connections close and shutdown need not
        wait for them."""
        self.stopping = True
        if self.ready is not None:
            self.ready.loop.request_stop()

    def stop(self) -> None:
        self.stopping = True
        if self.ready is not None:
            self.ready.loop.stop()
            self.ready.runtime.close()  # caches' workers, other ranks: uvicorn re-raises SIGTERM, no exit functions run
        if self.tracer is not None:
            self.tracer.writer.close()

    def require(self) -> Ready:
        if self.ready is None:
            raise APIError(503, "Loading model", "unavailable_error")
        return self.ready

    def check_model(self, name: str | None, strict: bool | None = None) -> str:
        """The served name for a request's "model". Another name is answered by the one model served, as
        llama-server does (clients send their own defaults, such as gpt-4o-mini), with a log line the first time;
        with strict (default: --strict-model-name) it is a 404."""
        names = self.cfg.model_names
        if name is not None and name not in names:
            if self.cfg.strict_model_name if strict is None else strict:
                raise APIError(404, f"the model '{name}' does not exist (this server has: {', '.join(names)})",
                               param="model")
            if not self._named_other:
                self._named_other = True
                log.info("a request named the model %r: %s answers every model name (--strict-model-name: 404)",
                         name[:80], names[0])
        return names[0]


def cache_summary(rt: Runtime) -> str:
    """The expert cache in the "model loaded" line: its size and slots per MoE layer."""
    stages = [st for st in rt.stages if st.cache is not None]
    if not stages:
        return "no expert cache"
    slots = sorted({st.cache.slots(layer) for st in stages for layer in st.cache.store.layers
                    if st.layers[0] <= layer < st.layers[1]})
    per_layer = str(slots[0]) if len(slots) == 1 else f"{slots[0]}-{slots[-1]}"
    mib = sum(st.cache.nbytes for st in stages) / 2**20
    return f"expert cache {mib:.1f} MiB ({per_layer} slots per layer)"
