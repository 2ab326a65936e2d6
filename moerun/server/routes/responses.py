"""OpenAI's Responses API: POST /v1/responses (whole or streamed), GET and DELETE /v1/responses/{id}. A request is
converted to a chat request (moerun.server.convert.responses) and generated as chat completions are."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from moerun.server.chat import start_chat
from moerun.server.convert.responses import (
    Conversion,
    Output,
    ResponsesRequest,
    ResponseStore,
    Stored,
    finished,
    now,
)
from moerun.server.generation import event_stream, sse

if TYPE_CHECKING:
    from moerun.server.generation import Generation
    from moerun.server.state import Server


def add_routes(app: FastAPI, server: Server) -> None:
    store = ResponseStore(server.cfg.responses_max)

    def reasoning_tokens(output: Output) -> int:
        text = output.reasoning_text()
        return len(server.require().runtime.engine.tokenizer.encode(text, add_special=False)) if text else 0

    def keep(conv: Conversion, output: Output, response: dict) -> None:
        if conv.body.store is not False:
            store.put(response["id"], Stored(response, conv.messages + [output.assistant()]))

    @app.post("/v1/responses")
    @app.post("/responses")
    async def create(body: ResponsesRequest, http: HTTPRequest):
        history = [] if body.previous_response_id is None else store.get(body.previous_response_id).messages
        conv = Conversion.of(body, history)
        gen = await start_chat(server, conv.chat)
        rid, model, created = "resp_" + gen.id, gen.reply.model, now()
        if body.stream:
            return event_stream(_events(gen, conv, rid, model, created, reasoning_tokens, keep), gen.id)
        answer = await gen.whole(http)
        if answer is None:
            return JSONResponse({}, status_code=499)  # nobody is listening
        output = Output(rid)
        choice = answer["choices"][0]
        output.message(choice["message"])
        reason = "length" if choice["finish_reason"] == "length" else "stop"
        response = finished(conv, rid, model, created, output, answer["usage"], reason, reasoning_tokens(output))
        keep(conv, output, response)
        return JSONResponse(response, headers=gen.headers())

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str):
        return store.get(response_id, param="response_id").response

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str):
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


async def _events(gen: Generation, conv: Conversion, rid: str, model: str, created: int, reasoning_tokens,
                  keep) -> AsyncIterator[str]:
    """The documented event sequence: response.created, response.in_progress, each item's added / delta / done
    events, then response.completed (response.incomplete when max_output_tokens cut it); a failure is an error
    event and response.failed."""
    seq = 0

    def out(name: str, data: dict) -> str:
        nonlocal seq
        seq += 1
        return sse({"type": name, "sequence_number": seq - 1, **data}, event=name)

    output, reason, use = Output(rid), None, None
    chunks = gen.chunks()
    try:
        start = conv.envelope(rid, model, created, "in_progress")
        yield out("response.created", {"response": start})
        yield out("response.in_progress", {"response": start})
        async for chunk in chunks:
            if "error" in chunk:
                err = chunk["error"]
                yield out("error", {"code": err.get("type"), "message": err["message"], "param": err.get("param")})
                failed = {**conv.envelope(rid, model, created, "failed"), "output": output.items,
                          "error": {"code": "server_error", "message": err["message"]}}
                yield out("response.failed", {"response": failed})
                return
            for name, data in output.chunk(chunk):
                yield out(name, data)
            for choice in chunk.get("choices", ()):
                reason = choice.get("finish_reason") or reason
            use = chunk.get("usage") or use
        for name, data in output.close():
            yield out(name, data)
        final = "length" if reason == "length" else "stop"
        response = finished(conv, rid, model, created, output, use, final, reasoning_tokens(output))
        keep(conv, output, response)
        yield out("response.incomplete" if final == "length" else "response.completed", {"response": response})
    finally:
        await chunks.aclose()
