"""OpenAI's request and response shapes, the part moerun serves, and their mapping onto SamplingParams.

Requests may carry fields moerun does not know (clients send `user`, `metadata`, ...): they are ignored.
Fields that would change the answer and are not implemented (logit_bias, echo, ...) are refused with a 400
rather than silently dropped. Log probabilities are the model's, before any sampling step (penalties,
temperature, truncation): log_softmax of the logits, as OpenAI defines them.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from moerun.config import REASONING_FORMATS, DraftParams, SamplingParams
from moerun.server.errors import APIError

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat completions (its legacy completions: 5)
MAX_CHOICES = 16  # n: choices of one request, sampled from one prefill


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    # OpenAI's ranges: outside them its API answers 400 naming the field, and so does this server (the
    # validation handler puts the field in `param`); llama.cpp's samplers, and `moerun run`, take any value
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    n: int | None = None
    cache_prompt: bool | None = None  # llama-server's: reuse a slot's KV cache for a shared prefix
    logit_bias: dict[str, float] | None = None
    lora: Any = None  # llama-server's adapters: none can be loaded, and none by a request

    def refuse_unsupported(self) -> None:
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise APIError(400, f"n={self.n}: choices per request must be 1..{MAX_CHOICES}", param="n")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if self.lora:
            raise APIError(400, "LoRA adapters are not supported", param="lora")


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_format: str | None = None  # llama-server's: where the reasoning goes (REASONING_FORMATS)
    reasoning_effort: str | None = None  # OpenAI's; given to the chat template (gpt-oss's "Reasoning: high")

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's extra variables: chat_template_kwargs, and reasoning_effort when given."""
        extra = {} if self.reasoning_effort is None else {"reasoning_effort": self.reasoning_effort}
        return {**extra, **(self.chat_template_kwargs or {})}

    def reasoning_format_or(self, default: str) -> str:
        """The request's reasoning format, else the server's."""
        fmt = default if self.reasoning_format is None else self.reasoning_format
        if fmt not in REASONING_FORMATS:
            raise APIError(400, f"reasoning_format {fmt!r} is not one of {', '.join(REASONING_FORMATS)}",
                           param="reasoning_format")
        return fmt

    def top_n(self) -> int | None:
        """Alternatives per token to report (0: the chosen token's log probability only); None: no logprobs."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        self.top_n()
        self.output_schema()

    def output_schema(self) -> tuple[bool, dict | None]:
        """What response_format asks for: (constrained, schema) — (False, None) for text, (True, None) for any
        JSON object (json_object), (True, schema) for json_schema."""
        rf = self.response_format
        kind = "text" if rf is None else rf.get("type", "text")
        if kind == "text":
            return False, None
        if kind == "json_object":
            return True, None
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise APIError(400, "response_format json_schema needs {'json_schema': {'name': ..., 'schema': "
                                    "{...}}}", param="response_format")
            return True, spec.get("schema", {})
        raise APIError(400, f"response_format {kind!r} is not supported (text, json_object, json_schema)",
                       param="response_format")


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # legacy: that many alternatives per token

    def top_n(self) -> int | None:
        return self.logprobs

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise APIError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of > 1 is not supported", param="best_of")

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"{len(p)} prompts in one request: send one prompt per request", param="prompt")
            p = p[0]
        if isinstance(p, list) and not p:
            raise APIError(400, "the prompt is empty", param="prompt")
        return p


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    content: str | None = None  # llama-server's name
    prompt: str | None = None  # vLLM's
    messages: list[dict[str, Any]] | None = None
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    tokens: list[int]


_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_last_n",
                    "presence_penalty", "frequency_penalty", "ignore_eos")


def sampling_params(req: _Sampling, defaults: SamplingParams, max_tokens: int) -> SamplingParams:
    """The request's fields over the server's defaults. seed -1 means a random one (llama-server)."""
    changes: dict[str, Any] = {name: v for name in _SAMPLING_FIELDS if (v := getattr(req, name)) is not None}
    if req.seed is not None:
        changes["seed"] = None if req.seed == -1 else req.seed
    if req.stop is not None:
        changes["stop"] = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    changes["max_tokens"] = max_tokens
    try:
        return defaults.replace(**changes)
    except ValueError as e:
        raise APIError(400, str(e)) from None


# llama-server's per-request draft settings (dotted keys of the body) -> DraftParams' fields
DRAFT_KEYS = {"speculative.n_max": "draft_max", "speculative.n_min": "draft_min", "speculative.p_min": "draft_p_min"}


def draft_params(req: _Sampling, defaults: DraftParams) -> DraftParams | None:
    """The request's draft settings over the server's (None: the server's own)."""
    extra = req.model_extra or {}
    changes = {field: extra[key] for key, field in DRAFT_KEYS.items() if key in extra}
    if not changes:
        return None
    if "draft_max" in changes and "draft_min" not in changes:
        changes["draft_min"] = min(defaults.draft_min, changes["draft_max"]) if isinstance(changes["draft_max"], int) \
            else defaults.draft_min
    try:
        return defaults.replace(**changes)
    except ValueError as e:
        key = next((k for k, f in DRAFT_KEYS.items() if f in str(e)), None)
        raise APIError(400, str(e), param=key) from None


ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's


def message_texts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for the chat template: content parts joined into text; anything but text refused, and any role
    but OpenAI's."""
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise APIError(400, f"messages[{i}] has no role", param=f"messages[{i}].role")
        if role not in ROLES:
            raise APIError(400, f"messages[{i}].role {role!r} is not one of {', '.join(map(repr, ROLES))}",
                           param=f"messages[{i}].role")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise APIError(400, f"messages[{i}]: content of type {kind!r} is not supported (text only)",
                                   param=f"messages[{i}].content")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts",
                           param=f"messages[{i}].content")
        m = {**m, "content": content}
        if m.get("tool_calls"):
            m = {**m, "content": content or "", "tool_calls": _template_calls(m["tool_calls"], i)}
        out.append(m)
    return out


def _template_calls(calls: Any, i: int) -> list[dict]:
    """An assistant message's tool_calls for the chat template: arguments as an object (OpenAI sends JSON text;
    templates iterate or re-serialise the object)."""
    if not isinstance(calls, list):
        raise APIError(400, f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise APIError(400, f"messages[{i}].tool_calls[{j}] has no function name",
                           param=f"messages[{i}].tool_calls[{j}]")
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON",
                               param=f"messages[{i}].tool_calls[{j}].function.arguments") from None
        out.append({**c, "type": "function", "function": {**f, "arguments": args}})
    return out


def usage(n_prompt: int, n_out: int, cached: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _token(tok: Any, token_id: int, logprob: float) -> dict:
    raw = tok.token_to_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(tok: Any, entries) -> dict:
    """OpenAI's chat `logprobs` for the generated tokens: each token's text, log probability, UTF-8 bytes and
    its top alternatives. entries: (token id, log probability, ((id, log probability), ...)) per token."""
    return {"content": [{**_token(tok, t, lp), "top_logprobs": [_token(tok, i, x) for i, x in top]}
                        for t, lp, top in entries], "refusal": None}


def text_logprobs(tok: Any, entries, offset: int = 0) -> dict:
    """The legacy completions' `logprobs`: tokens, their log probabilities, the top alternatives as {token:
    logprob} and each token's offset in the text (from `offset`, where an earlier chunk ended)."""
    tokens = [tok.token_to_bytes(t).decode("utf-8", errors="replace") for t, _, _ in entries]
    offsets = []
    for piece in tokens:
        offsets.append(offset)
        offset += len(piece)
    tops = [{tok.token_to_bytes(i).decode("utf-8", errors="replace"): x for i, x in top} for _, _, top in entries]
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries], "top_logprobs": tops,
            "text_offset": offsets}


class Reply:
    """The response objects of one request: whole, or as stream chunks (chat or text completion); with a
    tokenizer, the chunks and the answer carry the tokens' log probabilities given to them."""

    def __init__(self, kind: str, request_id: str, model: str, tokenizer: Any = None):
        self.chat = kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request_id
        self.model, self.created = model, int(time.time())
        self.tok, self._offset = tokenizer, {}

    def _logprobs(self, entries, index: int = 0) -> dict | None:
        if self.tok is None or entries is None:
            return None
        if self.chat:
            return chat_logprobs(self.tok, entries)
        out = text_logprobs(self.tok, entries, self._offset.get(index, 0))
        self._offset[index] = self._offset.get(index, 0) + sum(map(len, out["tokens"]))
        return out

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        obj = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": "moerun", "choices": choices}

    def _choice(self, text: str | None, finish_reason: str | None, delta: bool, role: bool = False,
                field: str = "content", logprobs=None, index: int = 0) -> dict:
        lp = self._logprobs(logprobs, index)
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
        body = {"role": "assistant"} if role else {}
        if text is not None:
            body[field] = text
        return {"index": index, ("delta" if delta else "message"): body, "logprobs": lp,
                "finish_reason": finish_reason}

    def whole_choice(self, text: str, finish_reason: str, reasoning: str = "", logprobs=None,
                     tool_calls: list[dict] | None = None, index: int = 0) -> dict:
        """One choice of the answer; the model's reasoning, when it was told apart, as the message's
        reasoning_content; logprobs: every generated token's entry (chat_logprobs), when asked for; tool_calls:
        the calls it made (then finish_reason "tool_calls", but "length" when max_tokens stopped it, and no content
        when it wrote none beside them)."""
        if tool_calls and finish_reason != "length":
            finish_reason = "tool_calls"
        choice = self._choice(text if text.strip() or not tool_calls else None, finish_reason, delta=False,
                              role=True, logprobs=logprobs, index=index)
        if reasoning:
            choice["message"]["reasoning_content"] = reasoning
        if tool_calls:
            choice["message"]["tool_calls"] = tool_calls
        return choice

    def whole(self, choices: list[dict], use: dict, timings: dict) -> dict:
        return {**self._envelope(choices, chunk=False), "usage": use, "timings": timings}

    def first_chunks(self, n: int = 1) -> list[dict]:
        """Chat streams open with the assistant's role (OpenAI's first chunk), one per choice."""
        return [self._envelope([self._choice("", None, delta=True, role=True, index=i)], chunk=True)
                for i in range(n)] if self.chat else []

    def chunk(self, text: str, kind: str = "content", logprobs=None, index: int = 0) -> dict:
        """A delta of the answer (kind "content") or of the reasoning ("reasoning": reasoning_content), with the
        entries of the tokens it carries when logprobs were asked for."""
        field = "reasoning_content" if kind == "reasoning" else "content"
        return self._envelope([self._choice(text, None, delta=True, field=field, logprobs=logprobs, index=index)],
                              chunk=True)

    def tool_chunk(self, delta: dict, index: int = 0) -> dict:
        """A stream chunk of one tool call's part (moerun.server.tools.stream_deltas)."""
        return self._envelope([{"index": index, "delta": {"tool_calls": [delta]}, "logprobs": None,
                                "finish_reason": None}], chunk=True)

    def finish_chunk(self, finish_reason: str, index: int = 0) -> dict:
        return self._envelope([self._choice(None if self.chat else "", finish_reason, delta=True, index=index)],
                              chunk=True)

    def final_chunks(self, last: dict, use: dict, timings: dict, include_usage: bool) -> list[dict]:
        """The last finish chunk, then usage and timings: on it (llama-server), or on one more chunk with no
        choices when the client asked for stream_options.include_usage (OpenAI)."""
        if not include_usage:
            return [{**last, "usage": use, "timings": timings}]
        return [last, {**self._envelope([], chunk=True), "usage": use, "timings": timings}]
