"""llama-server's own routes beside the OpenAI ones: GET /props (the server's settings) and POST /apply-template
(chat messages to the prompt text the chat template makes of them)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from moerun.server.chat import chat_text

if TYPE_CHECKING:
    from moerun.server.state import Server


class ApplyTemplateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    messages: list[dict[str, Any]]
    chat_template_kwargs: dict[str, Any] | None = None


def add_routes(app: FastAPI, server: Server) -> None:
    @app.get("/props")
    async def props():
        """llama-server's /props: the default generation settings, slots, context, chat template and model."""
        ready = server.require()
        eng, cfg = ready.runtime.engine, server.cfg
        params = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg.defaults).items()}
        params["n_predict"] = -1 if cfg.n_predict is None else cfg.n_predict
        return {"default_generation_settings": {"n_ctx": eng.ctx_size, "params": params},
                "total_slots": cfg.parallel, "n_ctx": eng.ctx_size, "model_alias": cfg.model_names[0],
                "model_path": cfg.model_path, "chat_template": None if ready.template is None else
                ready.template.source, "modalities": {"vision": False, "audio": False}}

    @app.post("/apply-template")
    async def apply_template(body: ApplyTemplateRequest):
        """llama-server's /apply-template: {"messages": [...]} -> {"prompt": the text the template makes, with
        the generation prompt}."""
        ready = server.require()
        return {"prompt": await run_in_threadpool(chat_text, ready, body.messages, body.chat_template_kwargs)}
