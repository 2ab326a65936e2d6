"""The HTTP side of `moerun serve`: OpenAI-compatible routes over the scheduler's engine loop.

    app = create_app(ServerConfig(model_names=("my-model",)), load=lambda: build(RuntimeConfig(...)))
    uvicorn.run(app)

The app answers at once; the model loads on a thread meanwhile (/health says 503 "Loading model", then
200). Here: the app, its guard (API key, body size), its error handlers and its routes, whose families live
in moerun.server.routes; what they share is moerun.server.state's Server, and a request's generation is
moerun.server.generation's.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI

from moerun.config import ServerConfig
from moerun.server.errors import Guard, install_handlers
from moerun.server.routes import (
    completions,
    info,
    live,
    llama,
    messages,
    responses,
    slots,
    tokens,
    webui,
    workers,
)
from moerun.server.state import Server

if TYPE_CHECKING:
    from moerun.runtime import Runtime

OPEN_PATHS = frozenset({"/health", "/v1/health"})  # answered without the API key


def create_app(cfg: ServerConfig, load: Callable[[], Runtime],
               on_load_error: Callable[[BaseException], None] | None = None,
               trace_routing: Path | None = None) -> FastAPI:
    """trace_routing: a new file to record every routing decision in (moerun.server.trace)."""
    server = Server(cfg, load, on_load_error, trace_routing)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start_loading()
        yield
        server.stop()

    app = FastAPI(title="moerun", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(Guard, api_key=cfg.api_key, max_body_bytes=cfg.max_body_bytes,
                       open_paths=OPEN_PATHS | webui.open_paths(cfg))
    install_handlers(app)
    for family in (info, completions, messages, responses, tokens, slots, llama, live, webui, workers):
        family.add_routes(app, server)
    return app
