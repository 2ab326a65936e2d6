"""llama-server's own routes beside the OpenAI ones: GET /props (the server's settings), POST /apply-template
(chat messages to the prompt text the chat template makes of them) and POST /completion (its native completion:
n_predict, cache_prompt, a GBNF grammar or a json_schema, and its answer's fields: content, stop_type,
stopping_word, tokens_cached, timings; streamed as data lines ending with the one that says "stop": true)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from moerun.server.chat import chat_text
from moerun.server.errors import APIError
from moerun.server.generation import Generation, event_stream, sse, start
from moerun.server.protocol import CompletionRequest

if TYPE_CHECKING:
    from moerun.server.ready import Ready
    from moerun.server.state import Server

STOP_TYPES = {"length": "limit", "cancelled": "none"}  # "stop": "word" after a stop string, else "eos"


class ApplyTemplateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    messages: list[dict[str, Any]]
    chat_template_kwargs: dict[str, Any] | None = None


class LlamaCompletionRequest(CompletionRequest):
    """llama-server's /completion: its names (n_predict, n_probs, grammar, json_schema) beside the OpenAI ones."""

    prompt: str | list[int] | list[str] | list[list[int]] = ""
    n_predict: int | None = Field(None, ge=-1)
    n_probs: int | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.n_probs:
            raise APIError(400, "n_probs is not supported on /completion: use /v1/completions with logprobs",
                           param="n_probs")
        if self.grammar is not None and self.json_schema is not None:
            raise APIError(400, "grammar and json_schema cannot both constrain the answer", param="grammar")
        if self.n_predict is not None and self.max_tokens is None:
            self.max_tokens = None if self.n_predict < 0 else self.n_predict


def completion_grammar(ready: Ready, body: LlamaCompletionRequest) -> str | None:
    """The request's GBNF grammar (llama.cpp's, through llguidance's converter) or JSON schema, compiled."""
    from moerun.engine.grammar import GrammarError

    if body.grammar is None and body.json_schema is None:
        return None
    grammars, param = ready.runtime.engine.grammars, "grammar" if body.grammar is not None else "json_schema"
    try:
        if body.grammar is None:
            return grammars.json_schema(body.json_schema)
        from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

        try:
            return grammars.lark(gbnf_to_lark(body.grammar))
        except GbnfToLarkError as e:
            raise GrammarError(str(e)) from None
    except ImportError:
        raise APIError(501, "grammars need the llguidance package (pip install llguidance)", param=param) from None
    except GrammarError as e:
        raise APIError(400, f"{param}: cannot be enforced: {e}", param=param) from None


def native(gen: Generation, out: dict, prompt_text: str | None) -> dict:
    """A text completion (OpenAI's object, whole) in llama-server's /completion fields."""
    choice, use = out["choices"][0], out["usage"]
    reason = choice["finish_reason"]
    stop_type = STOP_TYPES.get(reason, "word" if gen.stop_word is not None else "eos")
    return {"index": 0, "content": choice["text"], "id_slot": -1, "stop": True, "model": out["model"],
            "tokens_predicted": use["completion_tokens"], "tokens_evaluated": use["prompt_tokens"],
            "tokens_cached": use["prompt_tokens_details"]["cached_tokens"], "prompt": prompt_text,
            "truncated": False, "stop_type": stop_type, "stopping_word": gen.stop_word or "",
            "timings": out["timings"], "generation_settings": {"n_predict": gen.reqs[0].params.max_tokens}}


async def _native_events(gen: Generation, prompt_text: str | None) -> AsyncIterator[str]:
    """llama-server's stream: {"content": ..., "stop": false} per piece, then the whole answer's fields with
    "stop": true (no [DONE])."""
    chunks, text = gen.chunks(), []
    try:
        async for chunk in chunks:
            if "error" in chunk:
                yield sse(chunk)
                return
            choice = chunk["choices"][0]
            if choice.get("text"):
                text.append(choice["text"])
                yield sse({"index": 0, "content": choice["text"], "stop": False, "id_slot": -1})
            if "usage" in chunk:
                whole = {**chunk, "choices": [{**choice, "text": "".join(text)}]}
                yield sse({**native(gen, whole, prompt_text), "content": ""})
    finally:
        await chunks.aclose()


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

    @app.post("/completion")
    async def completion(body: LlamaCompletionRequest, http: HTTPRequest):
        """llama-server's native completion."""
        ready = server.require()
        body.refuse_unsupported()
        p = body.single_prompt()
        tok = ready.runtime.engine.tokenizer
        prompt = await run_in_threadpool(tok.encode, p) if isinstance(p, str) else list(p)
        grammar = await run_in_threadpool(completion_grammar, ready, body)
        gen = await start(server, body, prompt, "text", grammar=grammar)
        text = p if isinstance(p, str) else None
        if body.stream:
            return event_stream(_native_events(gen, text), gen.id)
        out = await gen.whole(http)
        if out is None:
            return JSONResponse({}, status_code=499)  # nobody is listening
        return JSONResponse(native(gen, out, text), headers=gen.headers())
