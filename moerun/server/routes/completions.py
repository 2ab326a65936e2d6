"""OpenAI's chat completions and (text) completions, at /v1/... and without the /v1 prefix."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from starlette.concurrency import run_in_threadpool

from moerun.server.chat import chat_prompt, output_grammar, tool_syntax
from moerun.server.errors import APIError
from moerun.server.generation import generate
from moerun.server.protocol import ChatRequest, CompletionRequest
from moerun.server.tools import parse_request

if TYPE_CHECKING:
    from moerun.server.state import Server


def add_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat(body: ChatRequest, http: HTTPRequest):
        ready = server.require()
        server.check_model(body.model)
        body.refuse_unsupported()
        reasoning = body.reasoning_format_or(server.cfg.reasoning_format)
        tools = parse_request(body.tools, body.tool_choice, body.parallel_tool_calls)
        calls = tool_syntax(ready, tools)
        harmony = calls is not None and calls[0].body == "harmony"  # its reasoning parser reads the calls
        prompt, split = await run_in_threadpool(chat_prompt, ready, body.messages, body.template_kwargs(),
                                                reasoning, calls[1].tools if calls else None, harmony)
        if harmony and split is None:
            raise APIError(400, "gpt-oss's tool calls are read with its reasoning: not with reasoning_format "
                                "'none'", param="reasoning_format")
        grammar = await run_in_threadpool(output_grammar, ready, body, calls)
        return await generate(server, http, body, prompt, "chat", split, grammar, calls)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        ready = server.require()
        server.check_model(body.model)
        body.refuse_unsupported()
        p = body.single_prompt()
        prompt = await run_in_threadpool(ready.runtime.engine.tokenizer.encode, p) if isinstance(p, str) else list(p)
        return await generate(server, http, body, prompt, "text")
