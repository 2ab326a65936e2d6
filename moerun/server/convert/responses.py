"""OpenAI's Responses API over chat completions: a request's input items to chat messages, the chat answer (whole
or chunk by chunk) to output items and the documented stream events, and the responses kept for
`previous_response_id`.

    input items                      chat messages
    message (input_text parts)   ->  {"role": "user" | "system" | "assistant", "content": text}
    function_call                ->  the assistant message's tool_calls
    function_call_output         ->  {"role": "tool", "tool_call_id": ..., "content": output}
    reasoning                    ->  the next assistant message's reasoning_content

    chat answer                      output items
    reasoning_content            ->  reasoning {content: [reasoning_text]}
    content                      ->  message {content: [output_text]}
    tool_calls                   ->  function_call {call_id, name, arguments}
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moerun.server.errors import APIError
from moerun.server.protocol import ChatRequest

# sampling fields beside the API's own, passed on as chat completions take them (llama-server's and OpenAI chat's)
PASSED = ("seed", "top_k", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty", "stop")
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


class ResponsesRequest(BaseModel):
    """The request fields moerun serves; others clients send (metadata, user, include, truncation, ...) are
    ignored, and those that would change the answer but are not served are refused (`refuse_unsupported`)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[Any] = ""
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name, why in (("background", "background responses"), ("conversation", "conversations"),
                          ("prompt", "stored prompts")):
            if extra.get(name):
                raise APIError(400, f"{name}: {why} are not supported", param=name)
        if extra.get("top_logprobs"):
            raise APIError(400, "top_logprobs is not supported by /v1/responses (use /v1/chat/completions)",
                           param="top_logprobs")


def _text(content: Any, where: str) -> str:
    """A message's content (a string, or a list of text parts) as text; other parts are a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of content parts", param=f"{where}.content")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise APIError(400, f"{where}.content[{j}]: content of type {kind!r} is not supported (text only)",
                           param=f"{where}.content[{j}]")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise APIError(400, f"{where}.content[{j}] has no text", param=f"{where}.content[{j}]")
        out.append(text)
    return "".join(out)


def _output_text(output: Any, where: str) -> str:
    """A function_call_output's output (a string, or text parts) as text."""
    return output if isinstance(output, str) else _text(output, where.replace(".content", ""))


def input_messages(items: str | list[Any], history: list[dict]) -> list[dict]:
    """The request's input as chat messages after `history` (a stored conversation's); a function_call_output for a
    call no function_call made is a 400."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    known = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    out: list[dict] = []
    reasoning = None

    def assistant() -> dict:
        """The assistant message function calls join: the last one, when it is the last message."""
        nonlocal reasoning
        if not (out and out[-1]["role"] == "assistant"):
            out.append({"role": "assistant", "content": ""})
        if reasoning is not None:
            out[-1]["reasoning_content"], reasoning = reasoning, None
        return out[-1]

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise APIError(400, f"{where}.role {item.get('role')!r} is not one of {', '.join(ROLES)}",
                               param=f"{where}.role")
            text = _text(item.get("content"), where)
            if role == "assistant":
                m = assistant()
                m["content"] += text
            else:
                out.append({"role": role, "content": text})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "")
            if not (isinstance(call_id, str) and call_id and isinstance(name, str) and name and isinstance(args, str)):
                raise APIError(400, f"{where}: a function_call needs call_id, name and arguments (a JSON string)",
                               param=where)
            known.add(call_id)
            m = assistant()
            m.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in known:
                raise APIError(400, f"{where}: no function_call has call_id {call_id!r}", param=f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _output_text(item.get("output", ""), f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict)) or None
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                                f"function_call_output, reasoning)", param=f"{where}.type")
    return out


def chat_tools(tools: list[Any] | None) -> list[dict] | None:
    """Function tools in chat completions' shape; other tool types (web_search, file_search, ...) are a 400."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise APIError(400, f"tools[{i}]: tools of type {kind!r} are not supported (function)",
                           param=f"tools[{i}].type")
        f = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": f})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """tool_choice in chat completions' shape."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
                   param="tool_choice")


def response_format(text: dict | None) -> dict | None:
    """text.format in chat completions' response_format shape."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object", param="text.format")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return fmt


@dataclass
class Conversion:
    """One Responses request as a chat request: `messages` is the conversation (without the instructions, which
    a continued response does not carry over)."""

    body: ResponsesRequest
    messages: list[dict]
    chat: ChatRequest

    @classmethod
    def of(cls, body: ResponsesRequest, history: list[dict]) -> Conversion:
        body.refuse_unsupported()
        messages = history + input_messages(body.input, history)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        effort = (body.reasoning or {}).get("effort")
        fields = {"model": body.model, "messages": system + messages, "tools": chat_tools(body.tools),
                  "tool_choice": chat_tool_choice(body.tool_choice), "parallel_tool_calls": body.parallel_tool_calls,
                  "response_format": response_format(body.text), "max_tokens": body.max_output_tokens,
                  "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream,
                  "reasoning_format": "auto", "reasoning_effort": effort,
                  **{k: v for k in PASSED if (v := (body.model_extra or {}).get(k)) is not None}}
        if not fields["messages"]:
            raise APIError(400, "input is empty (and there are no instructions)", param="input")
        try:
            chat = ChatRequest(**{k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            raise APIError(400, f"invalid request: {e.errors()[0].get('msg')}") from None
        return cls(body, messages, chat)

    def envelope(self, response_id: str, model: str, created: int, status: str) -> dict:
        """The response object without output and usage (response.created's)."""
        b = self.body
        return {"id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
                "output": [], "error": None, "incomplete_details": None, "instructions": b.instructions,
                "max_output_tokens": b.max_output_tokens, "metadata": b.metadata or {},
                "parallel_tool_calls": b.parallel_tool_calls is not False,
                "previous_response_id": b.previous_response_id, "reasoning": b.reasoning or {"effort": None},
                "store": b.store is not False, "temperature": b.temperature, "top_p": b.top_p,
                "text": b.text or {"format": {"type": "text"}}, "tool_choice": b.tool_choice or "auto",
                "tools": b.tools or [], "truncation": "disabled", "usage": None}


def usage(chat_usage: dict, reasoning_tokens: int) -> dict:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": chat_usage["prompt_tokens"] + chat_usage["completion_tokens"]}


class Output:
    """The output items of one response, built piece by piece (stream deltas, or a whole answer's fields in
    order); each step returns the stream events it makes, (name, data) without sequence numbers."""

    def __init__(self, response_id: str):
        self.rid, self.items, self.open = response_id, [], None
        self.calls: list[dict] = []  # the answer's tool calls, in chat completions' shape

    def _item_id(self, prefix: str) -> str:
        return f"{prefix}_{self.rid.removeprefix('resp_')}_{len(self.items)}"

    def _start(self, kind: str, item: dict) -> list[tuple[str, dict]]:
        events = self.close()
        self.items.append(item)
        self.open = kind
        events.append(("response.output_item.added", {"output_index": len(self.items) - 1,
                                                      "item": {**item, "status": "in_progress"}}))
        return events

    def _at(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def text(self, delta: str) -> list[tuple[str, dict]]:
        events = []
        if self.open != "message":
            events = self._start("message", {"type": "message", "id": self._item_id("msg"), "role": "assistant",
                                             "content": [], "status": "completed"})
            events[-1][1]["item"]["content"] = []
            self.items[-1]["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            events.append(("response.content_part.added", {**self._at(), "content_index": 0,
                                                           "part": {"type": "output_text", "text": "",
                                                                    "annotations": [], "logprobs": []}}))
        self.items[-1]["content"][0]["text"] += delta
        return events + [("response.output_text.delta", {**self._at(), "content_index": 0, "delta": delta,
                                                         "logprobs": []})]

    def reasoning(self, delta: str) -> list[tuple[str, dict]]:
        events = []
        if self.open != "reasoning":
            events = self._start("reasoning", {"type": "reasoning", "id": self._item_id("rs"), "summary": [],
                                               "content": [{"type": "reasoning_text", "text": ""}]})
            events[-1][1]["item"]["content"] = []
        self.items[-1]["content"][0]["text"] += delta
        return events + [("response.reasoning_text.delta", {**self._at(), "content_index": 0, "delta": delta})]

    def call(self, call_id: str, name: str) -> list[tuple[str, dict]]:
        self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}})
        return self._start("function_call", {"type": "function_call", "id": self._item_id("fc"), "call_id": call_id,
                                             "name": name, "arguments": "", "status": "completed"})

    def arguments(self, delta: str) -> list[tuple[str, dict]]:
        self.items[-1]["arguments"] += delta
        self.calls[-1]["function"]["arguments"] += delta
        return [("response.function_call_arguments.delta", {**self._at(), "delta": delta})]

    def close(self) -> list[tuple[str, dict]]:
        """The open item's done events."""
        if self.open is None:
            return []
        item, at, kind = self.items[-1], self._at(), self.open
        self.open = None
        if kind == "message":
            part = item["content"][0]
            events = [("response.output_text.done", {**at, "content_index": 0, "text": part["text"], "logprobs": []}),
                      ("response.content_part.done", {**at, "content_index": 0, "part": part})]
        elif kind == "reasoning":
            events = [("response.reasoning_text.done", {**at, "content_index": 0,
                                                        "text": item["content"][0]["text"]})]
        else:
            events = [("response.function_call_arguments.done", {**at, "name": item["name"],
                                                                 "arguments": item["arguments"]})]
        return events + [("response.output_item.done", {"output_index": at["output_index"], "item": item})]

    def chunk(self, chunk: dict) -> list[tuple[str, dict]]:
        """A chat completion chunk's deltas."""
        events = []
        for choice in chunk.get("choices", ())[:1]:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self.reasoning(delta["reasoning_content"])
            if delta.get("content"):
                events += self.text(delta["content"])
            for call in delta.get("tool_calls") or ():
                f = call.get("function") or {}
                if call.get("id"):
                    events += self.call(call["id"], f.get("name", ""))
                if f.get("arguments"):
                    events += self.arguments(f["arguments"])
        return events

    def message(self, message: dict) -> None:
        """A whole chat answer's message, in the order a stream gives its parts."""
        if message.get("reasoning_content"):
            self.reasoning(message["reasoning_content"])
        if message.get("content"):
            self.text(message["content"])
        for call in message.get("tool_calls") or ():
            self.call(call["id"], call["function"]["name"])
            self.arguments(call["function"]["arguments"])
        self.close()

    def reasoning_text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")

    def assistant(self) -> dict:
        """The answer as the chat message a continued response's conversation holds."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        m: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning_text():
            m["reasoning_content"] = self.reasoning_text()
        if self.calls:
            m["tool_calls"] = [json.loads(json.dumps(c)) for c in self.calls]
        return m


def finished(conv: Conversion, response_id: str, model: str, created: int, output: Output, chat_usage: dict,
             finish_reason: str, reasoning_tokens: int) -> dict:
    """The response object once the answer ended: "incomplete" when max_output_tokens (or the context) cut it."""
    status = "incomplete" if finish_reason == "length" else "completed"
    out = conv.envelope(response_id, model, created, status)
    out["output"], out["usage"] = output.items, usage(chat_usage, reasoning_tokens)
    if status == "incomplete":
        out["incomplete_details"] = {"reason": "max_output_tokens"}
    return out


@dataclass
class Stored:
    response: dict
    messages: list[dict]  # the conversation, the answer included, without instructions


@dataclass
class ResponseStore:
    """Responses kept for previous_response_id and GET /v1/responses/{id}: the `limit` most recently used
    (--responses-max); evicted ones are remembered by id (so an error can say the id was evicted, not unknown),
    up to ten times as many."""

    limit: int
    kept: OrderedDict = field(default_factory=OrderedDict)
    evicted: OrderedDict = field(default_factory=OrderedDict)

    def put(self, response_id: str, stored: Stored) -> None:
        if self.limit <= 0:
            return
        self.kept[response_id] = stored
        self.kept.move_to_end(response_id)
        while len(self.kept) > self.limit:
            old, _ = self.kept.popitem(last=False)
            self.evicted[old] = None
            while len(self.evicted) > 10 * self.limit:
                self.evicted.popitem(last=False)

    def get(self, response_id: str, param: str = "previous_response_id") -> Stored:
        stored = self.kept.get(response_id)
        if stored is not None:
            self.kept.move_to_end(response_id)
            return stored
        why = (f"was evicted: this server keeps the {self.limit} most recently used responses (--responses-max)"
               if response_id in self.evicted else "was not found")
        raise APIError(404, f"Previous response with id {response_id!r} {why}", "invalid_request_error",
                       param=param)

    def delete(self, response_id: str) -> None:
        self.get(response_id, param="response_id")
        del self.kept[response_id]


def now() -> int:
    return int(time.time())
