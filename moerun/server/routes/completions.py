"""OpenAI's chat completions and (text) completions, at /v1/... and without the /v1 prefix."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from starlette.concurrency import run_in_threadpool

from moerun.server.chat import start_chat
from moerun.server.generation import generate, respond
from moerun.server.protocol import ChatRequest, CompletionRequest

if TYPE_CHECKING:
    from moerun.server.state import Server


def add_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat(body: ChatRequest, http: HTTPRequest):
        return await respond(await start_chat(server, body), http)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        ready = server.require()
        server.check_model(body.model)
        body.refuse_unsupported()
        p = body.single_prompt()
        prompt = await run_in_threadpool(ready.runtime.engine.tokenizer.encode, p) if isinstance(p, str) else list(p)
        return await generate(server, http, body, prompt, "text")
