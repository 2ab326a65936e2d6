"""The HTTP side of `moerun serve`: OpenAI-compatible routes over the scheduler's engine loop.

    app = create_app(ServerConfig(model_names=("my-model",)), load=lambda: build(RuntimeConfig(...)))
    uvicorn.run(app)

The app answers at once; the model loads on a thread meanwhile (/health says 503 "Loading model", then
200). Handlers tokenize, submit a scheduler Request and await its events, which the engine thread hands
over with `call_soon_threadsafe`. A client that goes away cancels its request: the engine drops it at the
next step and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from moerun.config import ServerConfig
from moerun.errors import MoerunError
from moerun.server.answers import ChoiceStream, whole_choice
from moerun.server.errors import APIError, Guard, install_handlers
from moerun.server.metrics import Telemetry, ThroughputLog
from moerun.server.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Reply,
    TokenizeRequest,
    draft_params,
    message_texts,
    sampling_params,
    usage,
)
from moerun.server.tools import ToolRequest, forced_grammar, parse_request

if TYPE_CHECKING:  # torch and the model load on the loader thread, after the port answers
    from moerun.engine.scheduler import EngineLoop, Event, Request, Scheduler
    from moerun.runtime import Runtime
    from moerun.server.answers import Calls
    from moerun.server.trace import ServeRouteRecorder
    from moerun.text import ChatTemplate
    from moerun.text.reasoning import ReasoningParser

    Split = Callable[[], ReasoningParser]  # a new parser for one request's output

log = logging.getLogger("moerun.server")


@dataclass
class Ready:
    runtime: Runtime
    scheduler: Scheduler
    loop: EngineLoop
    template: ChatTemplate | None
    template_error: str | None


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


class Server:
    """What the routes share: the configuration, then the loaded model and its engine loop."""

    def __init__(self, cfg: ServerConfig, load: Callable[[], Runtime],
                 on_load_error: Callable[[BaseException], None] | None = None,
                 trace_routing: Path | None = None):
        self.cfg, self._load_fn, self.on_load_error = cfg, load, on_load_error
        self.trace_routing = trace_routing
        self.tracer: ServeRouteRecorder | None = None
        self.ready: Ready | None = None
        self.load_error: BaseException | None = None
        self.telemetry = Telemetry(self.snapshot, device=lambda: self.ready.runtime.engine.device_label
                                   if self.ready else "cpu")
        self.throughput = ThroughputLog(self.snapshot, cfg.log_interval)
        self._stopping = False

    def snapshot(self):
        return self.ready.scheduler.snapshot() if self.ready is not None else None

    def start_loading(self) -> None:
        threading.Thread(target=self._load, name="moerun-load", daemon=True).start()

    def _load(self) -> None:
        try:
            from moerun.engine.scheduler import EngineLoop, Scheduler
            from moerun.text import ChatTemplate, ChatTemplateError

            t0 = time.perf_counter()
            rt = self._load_fn()
            for w in rt.warnings:
                log.warning(w)
            eng, cfg = rt.engine, self.cfg
            sched = Scheduler(eng, parallel=cfg.parallel, max_queue=cfg.max_queue, observer=self.telemetry)
            template = error = None
            try:
                template = ChatTemplate.for_tokenizer(eng.tokenizer)
            except ChatTemplateError as e:
                error = str(e)
                log.warning("chat completions are off: %s", e)
            else:
                _say_reasoning(template, eng.tokenizer, cfg.reasoning_format)
            if self.trace_routing is not None:
                from moerun.server.trace import ServeRouteRecorder

                self.tracer = ServeRouteRecorder(self.trace_routing, eng.model.spec, sched)
                eng.model.on_route = self.tracer
            loop = EngineLoop(sched, after_step=self.throughput.tick)
            if self._stopping:
                return
            loop.start()
            self.ready = Ready(rt, sched, loop, template, error)
            kv = eng.pool.nbytes
            trace = "" if self.tracer is None else f", routing trace to {self.trace_routing}"
            log.info("model loaded in %.2f s: %s, context %d tokens x %d slots (KV cache %.1f MiB), %s%s",
                     time.perf_counter() - t0, self.cfg.model_names[0], eng.ctx_size, cfg.parallel, kv / 2**20,
                     cache_summary(rt), trace)
        except BaseException as e:  # reported; then the server stops
            self.load_error = e
            log.error("loading the model failed: %s", e, exc_info=not isinstance(e, MoerunError))
            if self.on_load_error is not None:
                self.on_load_error(e)

    def begin_shutdown(self) -> None:
        """Requests in flight end now with an error event, so their connections close and shutdown need not
        wait for them."""
        self._stopping = True
        if self.ready is not None:
            self.ready.loop.request_stop()

    def stop(self) -> None:
        self._stopping = True
        if self.ready is not None:
            self.ready.loop.stop()
            cache = self.ready.runtime.cache
            if cache is not None:
                cache.close()
        if self.tracer is not None:
            self.tracer.writer.close()

    def require(self) -> Ready:
        if self.ready is None:
            raise APIError(503, "Loading model", "unavailable_error")
        return self.ready

    def check_model(self, name: str | None) -> str:
        names = self.cfg.model_names
        if name is not None and name not in names:
            raise APIError(404, f"the model '{name}' does not exist (this server has: {', '.join(names)})",
                           param="model")
        return names[0]

    # -- generation -----------------------------------------------------------------------------------

    async def generate(self, http: HTTPRequest, body: ChatRequest | CompletionRequest, prompt: list[int],
                       kind: str, split: Split | None = None, grammar: str | None = None,
                       calls: Calls | None = None):
        """split: for chat completions whose reasoning is told apart, a new ReasoningParser; grammar: what the
        output must follow (moerun.engine.grammar); calls: the template's tool-call syntax and the request's
        tools, when the answer's calls are read back."""
        from moerun.engine.kv_cache import ContextOverflowError
        from moerun.engine.scheduler import ModelUnavailableError, QueueFullError
        from moerun.engine.scheduler import Request as EngineRequest

        ready, model = self.require(), self.check_model(body.model)
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
        requested = _max_tokens(body, self.cfg.n_predict, n_ctx, len(prompt))
        params = sampling_params(body, self.cfg.defaults, requested)
        events = _Events(asyncio.get_running_loop())
        cache_prompt = self.cfg.cache_prompt if body.cache_prompt is None else body.cache_prompt
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
            return StreamingResponse(self._sse(reqs, events, reply, include_usage, split, calls),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                              "X-Request-Id": req.id})
        return await self._whole(http, reqs, events, reply, split, calls)

    def _finals(self, reqs: list[Request]) -> tuple[dict, dict]:
        req = reqs[0]
        timings = {**req.timings.to_dict(), "expert_cache_hits": req.cache_hits,
                   "expert_cache_queries": req.cache_queries}
        return usage(len(req.prompt), sum(len(r.tokens) for r in reqs), req.timings.cache_n), timings

    def _cancel(self, reqs: list[Request]) -> None:
        for r in reqs:
            r.cancel()
        if self.ready is not None:
            self.ready.scheduler.wake()

    async def _whole(self, http: HTTPRequest, reqs: list[Request], events: _Events, reply: Reply,
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
            self._cancel(reqs)
            return JSONResponse({}, status_code=499)  # nobody is listening
        results = work.result()
        failed = next((ev for _, ev in results if ev.finish_reason == "error"), None)
        if failed is not None:
            raise APIError(503 if self._stopping else 500, f"generation failed: {failed.error}")
        use, timings = self._finals(reqs)
        choices = [whole_choice(reply, i, r.id, text, ev.finish_reason, split, calls,
                                r.logprobs if r.top_logprobs is not None else None)
                   for i, (r, (text, ev)) in enumerate(zip(reqs, results))]
        return JSONResponse(reply.whole(choices, use, timings), headers={"X-Request-Id": reqs[0].id})

    async def _sse(self, reqs: list[Request], events: _Events, reply: Reply, include_usage: bool,
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
                    self._cancel(reqs)
                    yield _sse(APIError(503 if self._stopping else 500, f"generation failed: {ev.error}").body())
                    return
                chunks, reason = streams[i].finish(ev)
                for chunk in chunks:
                    yield _sse(chunk)
                done[i] = True
                if last is not None:
                    yield _sse(last)
                last = reply.finish_chunk(reason, i)
            finished = True
            use, timings = self._finals(reqs)
            for chunk in reply.final_chunks(last, use, timings, include_usage):
                yield _sse(chunk)
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (the response was cancelled) or the server is stopping
                self._cancel(reqs)


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


def cache_summary(rt: Runtime) -> str:
    """The expert cache in the "model loaded" line: its size and slots per MoE layer."""
    stages = [st for st in rt.stages if st.cache is not None]
    if not stages:
        return "no expert cache"
    slots = sorted({st.cache.slots(layer) for st in stages for layer in st.cache.store.layers
                    if st.layers[0] <= layer < st.layers[1]})
    per_layer = str(slots[0]) if len(slots) == 1 else f"{slots[0]}-{slots[-1]}"
    mib = sum(st.cache.nbytes for st in stages) / 2**20
    return f"expert cache {mib:.1f} MiB ({per_layer} slots per layer)"


def _usable_syntax(template: ChatTemplate, tokenizer: Any, fmt: str):
    """The reasoning syntax of `template` under format `fmt`, when the tokenizer writes all its markers out
    (a marker that is a control token decoding leaves out could not be seen); else None."""
    from moerun.text.reasoning import syntax_for

    syntax = None if template.is_fallback else syntax_for(template.source, fmt)
    return syntax if syntax is not None and all(map(tokenizer.renders, syntax.markers)) else None


def _say_reasoning(template: ChatTemplate, tokenizer: Any, fmt: str) -> None:
    from moerun.text.reasoning import syntax_for

    syntax = None if template.is_fallback else syntax_for(template.source)
    if syntax is None:
        return
    if _usable_syntax(template, tokenizer, "auto") is None:
        log.warning("the chat template writes %s reasoning, but the tokenizer leaves some of its markers out "
                    "of the text: the reasoning stays in the content", syntax.name)
    elif fmt != "none":
        log.info("chat completions return the model's %s reasoning as reasoning_content "
                 "(--reasoning-format %s)", syntax.name, fmt)


def _max_tokens(body: ChatRequest | CompletionRequest, n_predict: int | None, n_ctx: int, n_prompt: int) -> int:
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


SLOT_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


def slot_file(folder: Path | None, name: str | None) -> Path:
    """The file a slot action names: a plain file name inside --slot-save-path (no folders, no '..')."""
    if folder is None:
        raise APIError(400, "slot files are off: start the server with --slot-save-path DIR", param="action")
    if not isinstance(name, str) or not SLOT_FILE.fullmatch(name) or ".." in name:
        raise APIError(400, "filename must be a plain file name (letters, digits, '.', '_', '-'; no folders)",
                       param="filename")
    return Path(folder) / name


async def _filename(http: HTTPRequest, given: str | None) -> str | None:
    """llama-server takes {"filename": ...} in the body; a query parameter works too."""
    if given is not None:
        return given
    raw = await http.body()
    if not raw.strip():
        return None
    try:
        body = json.loads(raw)
    except json.JSONDecodeError:
        raise APIError(400, "the body is not valid JSON") from None
    return body.get("filename") if isinstance(body, dict) else None


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _disconnected(http: HTTPRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


def create_app(cfg: ServerConfig, load: Callable[[], Runtime],
               on_load_error: Callable[[BaseException], None] | None = None,
               trace_routing: Path | None = None) -> FastAPI:
    """trace_routing: a new file to record every routing decision in (moerun.server.trace)."""
    server = Server(cfg, load, on_load_error, trace_routing)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start_loading()
        yield
        server.stop()

    app = FastAPI(title="moerun", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(Guard, api_key=cfg.api_key, max_body_bytes=cfg.max_body_bytes,
                       open_paths=frozenset({"/health", "/v1/health"}))
    install_handlers(app)
    _routes(app, server)
    return app


def _routes(app: FastAPI, server: Server) -> None:
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
        """Any name a request may give (the aliases too); another is 404 with param "model", as OpenAI's."""
        server.check_model(model)
        return model_object(model)

    def chat_prompt(ready: Ready, messages: list[dict], kwargs: dict | None, reasoning: str = "none",
                    tools: list[dict] | None = None, keep: bool = False) -> tuple[list[int], Split | None]:
        """The chat template applied (with the request's tools), then tokenized (the template writes BOS itself
        when the model wants it); and, when the template writes reasoning the `reasoning` format tells apart,
        the parser's factory."""
        from moerun.text import ChatTemplateError
        from moerun.text.reasoning import ReasoningParser

        if ready.template is None:
            raise APIError(501, f"this model's chat template cannot be used: {ready.template_error}")
        messages, tok = message_texts(messages), ready.runtime.engine.tokenizer
        syntax = _usable_syntax(ready.template, tok, reasoning)
        kwargs = {**(kwargs or {}), **({"tools": tools} if tools else {})}
        try:
            text = ready.template.render(messages, add_generation_prompt=True, **kwargs)
            prime = "" if syntax is None else ready.template.generation_prompt(messages, **kwargs)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None
        split = None if syntax is None else functools.partial(ReasoningParser, syntax, prime, keep=keep)
        return tok.encode(text, add_special=False), split

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
        return await server.generate(http, body, prompt, "chat", split, grammar, calls)

    def tool_syntax(ready: Ready, tools: ToolRequest | None) -> Calls | None:
        """The template's tool-call syntax with the request's tools (None without tools, or tool_choice none);
        a template that writes no calls moerun reads is a 400."""
        from moerun.text.toolcalls import syntax_for

        if tools is None or tools.choice == "none":
            return None
        syntax = None if ready.template is None or ready.template.is_fallback else syntax_for(ready.template.source)
        if syntax is None:
            raise APIError(400, "this model's chat template renders no tool calls in a format moerun reads "
                                "(Qwen, Hermes, Mistral, DeepSeek, GLM)", param="tools")
        return syntax, tools

    def output_grammar(ready: Ready, body: ChatRequest, calls: Calls | None = None) -> str | None:
        """response_format, or the calls tool_choice forces, as a grammar the sampler enforces; a schema it cannot
        enforce is a 400 naming why."""
        from moerun.engine.grammar import GrammarError

        constrained, schema = body.output_schema()
        forced = None if calls is None else forced_grammar(*calls)
        if constrained and forced is not None:
            raise APIError(400, "response_format and a forced tool_choice cannot both constrain the answer",
                           param="response_format")
        if not constrained and forced is None:
            return None
        try:
            if forced is not None:
                return ready.runtime.engine.grammars.lark(forced)
            return ready.runtime.engine.grammars.json_schema(schema)
        except ImportError:
            raise APIError(501, "structured output needs the llguidance package (pip install llguidance)",
                           param="response_format") from None
        except GrammarError as e:
            if forced is not None:
                raise APIError(400, f"tools: a function's parameters cannot be enforced: {e}", param="tools") \
                    from None
            raise APIError(400, f"response_format: the schema cannot be enforced: {e}", param="response_format") \
                from None

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        ready = server.require()
        server.check_model(body.model)
        body.refuse_unsupported()
        p = body.single_prompt()
        prompt = await run_in_threadpool(ready.runtime.engine.tokenizer.encode, p) if isinstance(p, str) else list(p)
        return await server.generate(http, body, prompt, "text")

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

    @app.get("/metrics")
    async def metrics():
        server.require()
        return PlainTextResponse(server.telemetry.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/slots")
    async def slots():
        ready = server.require()
        n_ctx = ready.runtime.engine.ctx_size
        return [{"id": s.index, "is_processing": s.req is not None, "n_ctx": n_ctx, "n_tokens": s.kv.length,
                 "n_blocks": len(s.kv.blocks), "id_task": None if s.req is None else s.req.id}
                for s in ready.scheduler.slots]

    @app.post("/slots/{index}")
    async def slot_action(index: int, action: str, http: HTTPRequest, filename: str | None = None):
        """llama-server's slot actions: `erase` (free an idle slot's KV cache), `save` and `restore` (its cache
        to and from a file named by `filename`, in the body or the query, inside --slot-save-path)."""
        from moerun.engine import slotfile
        from moerun.engine.scheduler import ModelUnavailableError, SlotBusyError

        ready = server.require()
        if action not in ("erase", "save", "restore"):
            raise APIError(400, f"action {action!r} is not supported (erase, save, restore)", param="action")
        if action == "erase":
            op, path = ready.scheduler.erase, None
        else:
            path = slot_file(server.cfg.slot_save_path, await _filename(http, filename))
            if action == "restore" and not path.is_file():
                raise APIError(404, f"no slot file {path.name!r}", param="filename")
            ctx = ready.runtime.engine.ctx_size

            def op(i):
                return ready.scheduler.slot_op(i, (lambda s: slotfile.save(s.seq, path)) if action == "save"
                                               else (lambda s: slotfile.restore(s.seq, path, ctx)))
        t0 = time.perf_counter()
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(op(index)), timeout=600)
        except IndexError as e:
            raise APIError(404, str(e)) from None
        except SlotBusyError as e:
            raise APIError(409, str(e)) from None
        except ModelUnavailableError as e:
            raise APIError(503, str(e), "unavailable_error") from None
        except slotfile.SlotFileError as e:
            raise APIError(400, str(e), param="filename") from None
        except OSError as e:
            raise APIError(500, f"the slot file could not be written or read: {e.strerror}") from None
        ms = {"save_ms" if action == "save" else "restore_ms": round((time.perf_counter() - t0) * 1e3, 3)}
        if action == "erase":
            return {"id_slot": index, "n_erased": result}
        n, nbytes = result
        if action == "save":
            return {"id_slot": index, "filename": path.name, "n_saved": n, "n_written": nbytes, "timings": ms}
        return {"id_slot": index, "filename": path.name, "n_restored": n, "n_read": nbytes, "timings": ms}
