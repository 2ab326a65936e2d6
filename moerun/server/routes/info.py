"""The server's state: /health (open without the API key), the models (OpenAI's objects with llama-server's
`meta`) and the Prometheus /metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from moerun.server.errors import APIError

if TYPE_CHECKING:
    from moerun.server.state import Server

def add_routes(app: FastAPI, server: Server) -> None:
    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        if server.load_error is not None:
            return APIError(500, f"loading the model failed: {server.load_error}").response()
        fault = server.require().scheduler.fault
        if fault is not None:
            return APIError(503, f"the model cannot be used any more: {fault}; restart the server",
                            "unavailable_error").response()
        return {"status": "ok"}

    def model_object(name: str) -> dict:
        """OpenAI's model object, with llama-server's `meta`."""
        eng = server.require().runtime.engine
        meta = {"n_ctx": eng.ctx_size, "n_vocab": eng.model.spec.vocab, "n_parallel": server.cfg.parallel,
                "family": eng.model.spec.family, "n_experts": eng.model.spec.n_experts}
        return {"id": name, "object": "model", "created": 0, "owned_by": "moerun", "meta": meta}

    @app.get("/v1/models")
    @app.get("/models")
    async def models():
        return {"object": "list", "data": [model_object(name) for name in server.cfg.model_names[:1]]}

    @app.get("/v1/models/{model:path}")
    @app.get("/models/{model:path}")
    async def model(model: str):
        """The served names (the aliases too); another is 404 with param "model", as OpenAI's."""
        server.check_model(model, strict=True)
        return model_object(model)

    @app.get("/metrics")
    async def metrics():
        server.require()
        return PlainTextResponse(server.telemetry.render(), media_type=CONTENT_TYPE_LATEST)
