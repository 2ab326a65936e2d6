"""A request's generation: its prompt submitted to the scheduler (one engine Request per choice), its events
awaited, and the answer returned whole (JSON) or streamed (server-sent events).

Handlers tokenize, then call `generate`; the engine thread hands the events over with
`call_soon_threadsafe`. A client that goes away cancels its request: the engine drops it at the next step
and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from moerun.errors import MoerunError
from moerun.server.answers import ChoiceStream, whole_choice
from moerun.server.errors import APIError
from moerun.server.protocol import ChatRequest, CompletionRequest, Reply, draft_params, sampling_params, usage

if TYPE_CHECKING:
    from moerun.engine.scheduler import Event, Request
    from moerun.server.answers import Calls
    from moerun.server.chat import Split
    from moerun.server.state import Server


class _Events:
    """One request's events, from the engine thread to the handler's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is going down
            pass

    def tagged(self, index: int, event: Event) -> None:
        """An event of choice `index` (the queue holds (index, event))."""
        self.emit((index, event))


async def generate(server: Server, http: HTTPRequest, body: ChatRequest | CompletionRequest, prompt: list[int],
                   kind: str, split: Split | None = None, grammar: str | None = None, calls: Calls | None = None):
    """split: for chat completions whose reasoning is told apart, a new ReasoningParser; grammar: what the
    output must follow (moerun.engine.grammar); calls: the template's tool-call syntax and the request's
    tools, when the answer's calls are read back."""
    from moerun.engine.kv_cache import ContextOverflowError
    from moerun.engine.scheduler import ModelUnavailableError, QueueFullError
    from moerun.engine.scheduler import Request as EngineRequest

    ready, model = server.require(), server.check_model(body.model)
    eng = ready.runtime.engine
    n_ctx = eng.ctx_size
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    if len(prompt) >= n_ctx:
        raise APIError(400, f"the request has {len(prompt)} prompt tokens but the context size is {n_ctx} "
                            f"(generation needs at least one free position; start the server with a larger "
                            f"-c/--ctx-size)", "exceed_context_size_error", n_prompt_tokens=len(prompt),
                       n_ctx=n_ctx)
    if any(not 0 <= t < eng.model.spec.vocab for t in prompt):
        raise APIError(400, f"prompt token ids must be in [0, {eng.model.spec.vocab})", param="prompt")
    requested = max_tokens(body, server.cfg.n_predict, n_ctx, len(prompt))
    params = sampling_params(body, server.cfg.defaults, requested)
    events = _Events(asyncio.get_running_loop())
    cache_prompt = server.cfg.cache_prompt if body.cache_prompt is None else body.cache_prompt
    n = body.n or 1
    draft = draft_params(body, eng.draft)
    reqs = [EngineRequest(prompt, _nth(params, i), emit=functools.partial(events.tagged, i),
                          cache_prompt=cache_prompt, top_logprobs=body.top_n(), grammar=grammar, draft=draft)
            for i in range(n)]
    if n > 1:  # the others start once the first's prompt is in the cache: they take its blocks
        reqs[0].on_prompt = functools.partial(_submit_rest, ready.scheduler, reqs[1:])
    try:
        ready.scheduler.submit(reqs[0])
    except (QueueFullError, ModelUnavailableError) as e:
        raise APIError(503, str(e), "unavailable_error") from None
    except ContextOverflowError as e:
        raise APIError(400, str(e), "exceed_context_size_error") from None
    req = reqs[0]
    reply = Reply(kind, req.id, model, tokenizer=eng.tokenizer if req.top_logprobs is not None else None)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_stream(server, reqs, events, reply, include_usage, split, calls),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                          "X-Request-Id": req.id})
    return await _whole(server, http, reqs, events, reply, split, calls)


def _finals(reqs: list[Request]) -> tuple[dict, dict]:
    req = reqs[0]
    timings = {**req.timings.to_dict(), "expert_cache_hits": req.cache_hits,
               "expert_cache_queries": req.cache_queries}
    return usage(len(req.prompt), sum(len(r.tokens) for r in reqs), req.timings.cache_n), timings


def _cancel(server: Server, reqs: list[Request]) -> None:
    for r in reqs:
        r.cancel()
    if server.ready is not None:
        server.ready.scheduler.wake()


async def _whole(server: Server, http: HTTPRequest, reqs: list[Request], events: _Events, reply: Reply,
                 split: Split | None, calls: Calls | None = None) -> JSONResponse:
    async def collect() -> list[tuple[str, Event]]:
        texts: list[list[str]] = [[] for _ in reqs]
        last: list[Event | None] = [None] * len(reqs)
        while any(e is None for e in last):
            i, ev = await events.queue.get()
            texts[i].append(ev.text)
            if ev.finish_reason is not None:
                last[i] = ev
        return [("".join(t), e) for t, e in zip(texts, last)]

    work, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(_disconnected(http))
    await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not work.done():
        work.cancel()
        _cancel(server, reqs)
        return JSONResponse({}, status_code=499)  # nobody is listening
    results = work.result()
    failed = next((ev for _, ev in results if ev.finish_reason == "error"), None)
    if failed is not None:
        raise APIError(503 if server.stopping else 500, f"generation failed: {failed.error}")
    use, timings = _finals(reqs)
    choices = [whole_choice(reply, i, r.id, text, ev.finish_reason, split, calls,
                            r.logprobs if r.top_logprobs is not None else None)
               for i, (r, (text, ev)) in enumerate(zip(reqs, results))]
    return JSONResponse(reply.whole(choices, use, timings), headers={"X-Request-Id": reqs[0].id})


async def _stream(server: Server, reqs: list[Request], events: _Events, reply: Reply, include_usage: bool,
                  split: Split | None, calls: Calls | None = None) -> AsyncIterator[str]:
    streams = [ChoiceStream(reply, i, r.id, split, calls, r.top_logprobs is not None) for i, r in enumerate(reqs)]
    done, finished, last = [False] * len(reqs), False, None
    try:
        for chunk in reply.first_chunks(len(reqs)):
            yield _sse(chunk)
        while not all(done):
            i, ev = await events.queue.get()
            if ev.finish_reason is None:
                for chunk in streams[i].feed(ev):
                    yield _sse(chunk)
                continue
            if ev.finish_reason == "error":
                finished = True
                _cancel(server, reqs)
                yield _sse(APIError(503 if server.stopping else 500, f"generation failed: {ev.error}").body())
                return
            chunks, reason = streams[i].finish(ev)
            for chunk in chunks:
                yield _sse(chunk)
            done[i] = True
            if last is not None:
                yield _sse(last)
            last = reply.finish_chunk(reason, i)
        finished = True
        use, timings = _finals(reqs)
        for chunk in reply.final_chunks(last, use, timings, include_usage):
            yield _sse(chunk)
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away (the response was cancelled) or the server is stopping
            _cancel(server, reqs)


def _nth(params, i: int):
    """Choice i's sampling: its own seed (the request's plus i) when the request gave one."""
    if i == 0 or params.seed is None or params.seed < 0:
        return params
    return dataclasses.replace(params, seed=params.seed + i)


def _submit_rest(scheduler, reqs: list[Request]) -> None:
    """On the engine thread, when the first choice's prompt is done: the other choices join (one that cannot
    ends with an error event)."""
    from moerun.engine.scheduler import Event

    for r in reqs:
        try:
            scheduler.submit(r)
        except MoerunError as e:
            r.emit(Event(finish_reason="error", error=str(e)))


def max_tokens(body: ChatRequest | CompletionRequest, n_predict: int | None, n_ctx: int, n_prompt: int) -> int:
    """The request's max_tokens (or max_completion_tokens), else the server's -n, else the rest of the context.
    More than the context is refused: it can never be generated (a prompt plus max_tokens past the context
    ends with finish_reason "length" when the context is full)."""
    for name in ("max_completion_tokens", "max_tokens"):
        n = getattr(body, name, None)
        if n is not None:
            if n > n_ctx:
                raise APIError(400, f"{name}={n} is more than the context size {n_ctx}: at most {n_ctx - n_prompt} "
                                    f"tokens can follow this prompt of {n_prompt}", param=name)
            return n
    return min(n_predict, n_ctx) if n_predict is not None else n_ctx - n_prompt


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _disconnected(http: HTTPRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass
