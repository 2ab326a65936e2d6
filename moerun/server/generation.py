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


class Generation:
    """A submitted request (one engine Request per choice): its answer whole (`whole`, OpenAI's object) or as
    stream chunks (`chunks`, dicts; a failure ends them with an error body). The routes of other APIs convert
    these (moerun.server.convert); `respond` answers them as OpenAI's JSON or server-sent events."""

    def __init__(self, server: Server, reqs: list[Request], events: _Events, reply: Reply, stream: bool,
                 include_usage: bool, split: Split | None, calls: Calls | None):
        self.server, self.reqs, self.events, self.reply = server, reqs, events, reply
        self.stream, self.include_usage, self.split, self.calls = stream, include_usage, split, calls
        self.last: list[Event | None] = [None] * len(reqs)  # each choice's last event, once it came

    @property
    def id(self) -> str:
        return self.reqs[0].id

    @property
    def stop_word(self) -> str | None:
        """The stop string that ended the first choice (None: another reason, or not ended yet)."""
        return None if self.last[0] is None else self.last[0].stop_word

    def headers(self) -> dict[str, str]:
        """A whole answer's headers: the request's id, and x-moerun-prefix-hit, the prompt tokens the first choice
        found in the KV cache (timings' cache_n) for a client or router to log. A stream's headers go out before
        its prompt runs: its last chunk's timings carry cache_n."""
        return {"X-Request-Id": self.id, "x-moerun-prefix-hit": str(self.reqs[0].timings.cache_n)}

    def finals(self) -> tuple[dict, dict]:
        """usage and timings, once every choice ended."""
        req = self.reqs[0]
        timings = {**req.timings.to_dict(), "expert_cache_hits": req.cache_hits,
                   "expert_cache_queries": req.cache_queries}
        return usage(len(req.prompt), sum(len(r.tokens) for r in self.reqs), req.timings.cache_n), timings

    def cancel(self) -> None:
        for r in self.reqs:
            r.cancel()
        if self.server.ready is not None:
            self.server.ready.scheduler.wake()

    def _failure(self, ev: Event) -> APIError:
        """503 when the server cannot answer any more (shutting down, a process of its model gone), else 500."""
        lost = self.server.ready is not None and self.server.ready.scheduler.peer_lost
        return APIError(503 if self.server.stopping or lost else 500, f"generation failed: {ev.error}")

    async def whole(self, http: HTTPRequest) -> dict | None:
        """The answer (a failure raises APIError); None when the client went away first (the request is
        cancelled)."""
        async def collect() -> list[str]:
            texts: list[list[str]] = [[] for _ in self.reqs]
            while any(e is None for e in self.last):
                i, ev = await self.events.queue.get()
                texts[i].append(ev.text)
                if ev.finish_reason is not None:
                    self.last[i] = ev
            return ["".join(t) for t in texts]

        work, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(_disconnected(http))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not work.done():
            work.cancel()
            self.cancel()
            return None
        texts = work.result()
        failed = next((ev for ev in self.last if ev.finish_reason == "error"), None)
        if failed is not None:
            raise self._failure(failed)
        use, timings = self.finals()
        choices = [whole_choice(self.reply, i, r.id, text, ev.finish_reason, self.split, self.calls,
                                r.logprobs if r.top_logprobs is not None else None)
                   for i, (r, text, ev) in enumerate(zip(self.reqs, texts, self.last))]
        return self.reply.whole(choices, use, timings)

    async def chunks(self) -> AsyncIterator[dict]:
        """The answer's stream chunks; after a failure, its error body (OpenAI's {"error": ...}) is the last. Closing
        the iterator early (the client went away) cancels the request."""
        streams = [ChoiceStream(self.reply, i, r.id, self.split, self.calls, r.top_logprobs is not None)
                   for i, r in enumerate(self.reqs)]
        finished, last = False, None
        try:
            for chunk in self.reply.first_chunks(len(self.reqs)):
                yield chunk
            while any(e is None for e in self.last):
                i, ev = await self.events.queue.get()
                if ev.finish_reason is None:
                    for chunk in streams[i].feed(ev):
                        yield chunk
                    continue
                self.last[i] = ev
                if ev.finish_reason == "error":
                    finished = True
                    self.cancel()
                    yield self._failure(ev).body()
                    return
                chunks, reason = streams[i].finish(ev)
                for chunk in chunks:
                    yield chunk
                if last is not None:
                    yield last
                last = self.reply.finish_chunk(reason, i)
            finished = True
            use, timings = self.finals()
            for chunk in self.reply.final_chunks(last, use, timings, self.include_usage):
                yield chunk
        finally:
            if not finished:  # the client went away (the response was cancelled) or the server is stopping
                self.cancel()


async def start(server: Server, body: ChatRequest | CompletionRequest, prompt: list[int], kind: str,
                split: Split | None = None, grammar: str | None = None, calls: Calls | None = None) -> Generation:
    """The request submitted to the scheduler (kind: "chat" or "text", the objects answered). split: for chat
    completions whose reasoning is told apart, a new ReasoningParser; grammar: what the output must follow
    (moerun.engine.grammar); calls: the template's tool-call syntax and the request's tools, when the answer's
    calls are read back."""
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
    reply = Reply(kind, reqs[0].id, model,
                  tokenizer=eng.tokenizer if reqs[0].top_logprobs is not None else None)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return Generation(server, reqs, events, reply, body.stream, include_usage, split, calls)


async def respond(gen: Generation, http: HTTPRequest) -> JSONResponse | StreamingResponse:
    """OpenAI's answer: the whole object as JSON, or its chunks as server-sent events ending with [DONE]."""
    if gen.stream:
        return event_stream(_openai_events(gen), gen.id)
    out = await gen.whole(http)
    if out is None:
        return JSONResponse({}, status_code=499)  # nobody is listening
    return JSONResponse(out, headers=gen.headers())


async def generate(server: Server, http: HTTPRequest, body: ChatRequest | CompletionRequest, prompt: list[int],
                   kind: str, split: Split | None = None, grammar: str | None = None, calls: Calls | None = None):
    """`start`, then `respond`."""
    return await respond(await start(server, body, prompt, kind, split, grammar, calls), http)


async def _openai_events(gen: Generation) -> AsyncIterator[str]:
    chunks = gen.chunks()
    try:
        async for chunk in chunks:
            yield sse(chunk)
            if "error" in chunk:
                return
        yield "data: [DONE]\n\n"
    finally:
        await chunks.aclose()


def event_stream(events: AsyncIterator[str], request_id: str) -> StreamingResponse:
    """Server-sent events, unbuffered."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                      "X-Request-Id": request_id})


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


def sse(obj: dict, event: str | None = None) -> str:
    """One server-sent event (`event`: its name, for APIs that name theirs)."""
    head = "" if event is None else f"event: {event}\n"
    return f"{head}data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _disconnected(http: HTTPRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass
