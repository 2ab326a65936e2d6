"""Anthropic's Messages API: POST /v1/messages (whole or streamed) and /v1/messages/count_tokens, answered as
chat requests (moerun.server.convert.messages converts both ways; errors come in Anthropic's shape, as
errors.shape_for decides)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from moerun.server.chat import chat_prompt, start_chat, tool_syntax
from moerun.server.convert import messages as convert
from moerun.server.generation import Generation, event_stream, sse
from moerun.server.protocol import ChatRequest
from moerun.server.tools import parse_request

if TYPE_CHECKING:
    from moerun.server.state import Server


def add_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/messages")
    async def messages(body: convert.MessagesRequest, http: HTTPRequest):
        gen = await start_chat(server, convert.to_chat(body))
        if body.stream:
            return event_stream(_events(gen), gen.id)
        out = await gen.whole(http)
        if out is None:
            return JSONResponse({}, status_code=499)  # nobody is listening
        return JSONResponse(convert.to_message(out, gen.stop_word), headers=gen.headers())

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: convert.CountTokensRequest):
        return {"input_tokens": await prompt_tokens(server, convert.to_chat(body))}


async def prompt_tokens(server: Server, body: ChatRequest) -> int:
    """The number of tokens in the prompt start_chat makes of `body` (template, messages and tools)."""
    ready = server.require()
    server.check_model(body.model)
    calls = tool_syntax(ready, parse_request(body.tools, body.tool_choice, body.parallel_tool_calls))
    ids, _ = await run_in_threadpool(chat_prompt, ready, body.messages, body.template_kwargs(), "none",
                                     calls[1].tools if calls else None)
    return len(ids)


async def _events(gen: Generation) -> AsyncIterator[str]:
    """The generation's chunks as Anthropic's named events; an error event ends them."""
    stream, chunks = convert.MessageStream(len(gen.reqs[0].prompt)), gen.chunks()
    try:
        async for chunk in chunks:
            for name, data in stream.feed(chunk, gen.stop_word):
                yield sse(data, event=name)
            if "error" in chunk:
                return
    finally:
        await chunks.aclose()
