"""llama-server's /tokenize (text, or chat messages through the template) and /detokenize."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from moerun.server.chat import chat_prompt
from moerun.server.errors import APIError
from moerun.server.protocol import DetokenizeRequest, TokenizeRequest

if TYPE_CHECKING:
    from moerun.server.state import Server


def add_routes(app: FastAPI, server: Server) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        ready = server.require()
        server.check_model(getattr(body, "model", None))
        tok = ready.runtime.engine.tokenizer
        if body.messages is not None:
            ids, _ = await run_in_threadpool(chat_prompt, ready, body.messages, None)
        else:
            text = body.content if body.content is not None else body.prompt
            if text is None:
                raise APIError(400, "give 'content' (or 'prompt', or 'messages') to tokenize", param="content")
            ids = await run_in_threadpool(tok.encode, text, body.add_special)
        tokens: list[Any] = [{"id": i, "piece": tok.token_to_piece(i)} for i in ids] if body.with_pieces else ids
        return {"tokens": tokens, "count": len(ids), "max_model_len": ready.runtime.engine.ctx_size}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        ready = server.require()
        vocab = ready.runtime.engine.model.spec.vocab
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}", param="tokens")
        return {"content": ready.runtime.engine.tokenizer.decode(body.tokens)}
