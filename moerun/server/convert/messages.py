"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) as a chat request and back.

A request becomes a ChatRequest (`to_chat`): `system` a system message; each message's content blocks OpenAI's
messages in order (text, an assistant's `thinking` as its reasoning_content, `tool_use` as its tool_calls,
each `tool_result` a "tool" message); `tools` functions whose parameters are their input_schema;
`tool_choice` auto/any/tool/none as auto/required/the named function/none; `thinking` the template's
enable_thinking. The chat answer becomes a Message (`to_message`), its chunks Anthropic's stream events
(`MessageStream`): a thinking block, a text block and a tool_use block per call, with Anthropic's stop
reasons.

Text blocks of one message (or of `system`) are joined with a newline. What the chat path cannot take (images,
documents, server tools, an assistant prefill) is a 400 naming the block, never silently dropped.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moerun.server.errors import APIError, anthropic_error
from moerun.server.protocol import ChatRequest

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}  # chat's -> Anthropic's
# thinking.type -> the template's enable_thinking (None: its default)
THINKING = {"enabled": True, "disabled": False, "adaptive": None, "between_tools": None}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # tool_choice.type -> chat's (and "tool")
BLOCKS = "text, tool_use, tool_result, thinking, redacted_thinking"  # the content blocks taken


class CountTokensRequest(BaseModel):
    """What a Messages request's prompt is made of: the body of /v1/messages/count_tokens."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """A /v1/messages request (fields moerun does not read, such as metadata, are ignored)."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None  # moerun's (Anthropic has none): the sampler's seed
    stream: bool = False
    output_config: dict[str, Any] | None = None  # its format: a JSON schema the answer follows


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def _texts(blocks: Any, where: str) -> str:
    """A string, or text blocks joined (anything else a 400)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad(f"{where} must be a string or a list of text blocks", where)
    out = []
    for j, b in enumerate(blocks):
        if not (isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise _bad(f"{where}[{j}]: blocks of type {kind!r} are not supported here (text only)",
                       f"{where}[{j}]")
        out.append(b["text"])
    return "\n".join(out)


def _kind(block: Any, where: str) -> str:
    """A content block's type, when it is one of those taken."""
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise _bad(f"{where} is not a content block (an object with a type)", where)
    if kind not in BLOCKS.split(", "):
        raise _bad(f"{where}: content blocks of type {kind!r} are not supported ({BLOCKS})", where)
    return kind


def _tool_result(block: dict, where: str, seen: set[str]) -> dict:
    """A tool_result block as a "tool" message; its tool_use_id must be an earlier tool_use's."""
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or call_id not in seen:
        raise _bad(f"{where}: tool_result for tool_use_id {call_id!r}, which no earlier tool_use in the "
                   f"conversation has", f"{where}.tool_use_id")
    content = block.get("content")
    text = "" if content is None else _texts(content, f"{where}.content")
    if block.get("is_error"):
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _user(blocks: list, where: str, seen: set[str]) -> list[dict]:
    """A user message: its tool results as "tool" messages and its text as user messages, in their order."""
    out, texts = [], []
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _kind(b, at)
        if kind == "text":
            texts.append(_texts([b], at))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append(_tool_result(b, at, seen))
        else:
            raise _bad(f"{at}: a user message cannot hold a {kind!r} block", at)
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool_use(block: dict, where: str) -> dict:
    """A tool_use block as a chat tool call (its input as JSON text)."""
    call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
        raise _bad(f"{where}: a tool_use block needs an id and a name", where)
    if not isinstance(args, dict):
        raise _bad(f"{where}.input must be an object", f"{where}.input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _assistant(blocks: list, where: str, seen: set[str]) -> list[dict]:
    """An assistant message: text as content, thinking as reasoning_content, tool_use blocks as tool_calls
    (redacted thinking is dropped: it cannot be read)."""
    texts, thoughts, calls = [], [], []
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _kind(b, at)
        if kind == "text":
            texts.append(_texts([b], at))
        elif kind == "thinking":
            if isinstance(b.get("thinking"), str):
                thoughts.append(b["thinking"])
        elif kind == "tool_use":
            calls.append(_tool_use(b, at))
            seen.add(calls[-1]["id"])
        elif kind == "tool_result":
            raise _bad(f"{at}: tool_result blocks go in user messages", at)
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return [message]


def chat_messages(system: str | list | None, messages: list[dict]) -> list[dict]:
    """The conversation as chat messages (module docstring)."""
    out = [] if system is None else [{"role": "system", "content": _texts(system, "system")}]
    seen: set[str] = set()
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role must be 'user' or 'assistant' (the system prompt is `system`)",
                       f"{where}.role")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise _bad(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
        out += (_user if role == "user" else _assistant)(blocks, where, seen)
    if messages[-1].get("role") == "assistant":
        raise _bad("the last message is the assistant's: prefilling the answer is not supported",
                   f"messages[{len(messages) - 1}]")
    return out


def chat_tools(tools: list | None) -> list[dict] | None:
    """Custom tools as chat functions (their input_schema the parameters); server tools are a 400."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise _bad(f"{where} must be an object", where)
        if t.get("type", "custom") != "custom":
            raise _bad(f"{where}: server tools ({t.get('type')!r}) are not supported, only custom tools with "
                       f"an input_schema", f"{where}.type")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise _bad(f"{where} has no name", f"{where}.name")
        if not isinstance(t.get("input_schema"), dict):
            raise _bad(f"{where}.input_schema must be a JSON schema object", f"{where}.input_schema")
        f = {"name": t["name"], "parameters": t["input_schema"]}
        if isinstance(t.get("description"), str):
            f["description"] = t["description"]
        out.append({"type": "function", "function": f})
    return out


def chat_tool_choice(choice: dict | None) -> dict[str, Any]:
    """tool_choice (and its disable_parallel_tool_use) as the chat request's tool_choice and
    parallel_tool_calls."""
    if choice is None:
        return {}
    kind = choice.get("type")
    parallel = {"parallel_tool_calls": False} if choice.get("disable_parallel_tool_use") else {}
    if kind in TOOL_CHOICES:
        return {"tool_choice": TOOL_CHOICES[kind], **parallel}
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice {'type': 'tool'} needs the tool's name", "tool_choice.name")
        return {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}, **parallel}
    raise _bad(f"tool_choice.type {kind!r} is not one of auto, any, tool, none", "tool_choice.type")


def _enable_thinking(thinking: dict | None) -> dict[str, Any]:
    if thinking is None:
        return {}
    kind = thinking.get("type")
    if kind not in THINKING:
        raise _bad(f"thinking.type {kind!r} is not one of {', '.join(THINKING)}", "thinking.type")
    return {} if THINKING[kind] is None else {"chat_template_kwargs": {"enable_thinking": THINKING[kind]}}


def _output_format(config: dict | None) -> dict[str, Any]:
    """output_config.format (structured output) as the chat request's response_format."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return {}
    schema = fmt.get("schema") if isinstance(fmt, dict) and fmt.get("type") == "json_schema" else None
    if not isinstance(schema, dict):
        raise _bad("output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                   "output_config.format")
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "output", "schema": schema}}}


def to_chat(req: CountTokensRequest) -> ChatRequest:
    """The chat request a Messages request (or a count_tokens one: its prompt only) is answered as; reasoning
    models' thinking is told apart (reasoning_format "auto") to become thinking blocks."""
    tools = chat_tools(req.tools)
    fields: dict[str, Any] = {"model": req.model, "messages": chat_messages(req.system, req.messages),
                              "tools": tools, **(chat_tool_choice(req.tool_choice) if tools else {}),
                              **_enable_thinking(req.thinking), "reasoning_format": "auto"}
    if isinstance(req, MessagesRequest):
        fields.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                      top_p=req.top_p, top_k=req.top_k, seed=req.seed, stream=req.stream,
                      **_output_format(req.output_config))
    try:
        return ChatRequest.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        raise _bad(f"invalid request: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None


def tool_use_id(call_id: str) -> str:
    """A chat tool call's id as Anthropic's ("toolu_...")."""
    return "toolu_" + call_id.removeprefix("call_")


def message_id(chat_id: str) -> str:
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def stop_fields(finish_reason: str | None, stop_word: str | None) -> dict:
    """stop_reason and stop_sequence: a stop string that ended the answer is "stop_sequence"."""
    if finish_reason == "stop" and stop_word:
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_word}
    return {"stop_reason": STOP_REASONS.get(finish_reason or "stop", "end_turn"), "stop_sequence": None}


def message_usage(use: dict) -> dict:
    """Anthropic's usage from chat's: input_tokens leaves out the prompt tokens read from the cache
    (cache_read_input_tokens), as Anthropic counts them; nothing is written to a cache on request."""
    cached = (use.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": use["prompt_tokens"] - cached, "output_tokens": use["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _tool_block(call: dict) -> dict:
    f = call["function"]
    return {"type": "tool_use", "id": tool_use_id(call["id"]), "name": f["name"],
            "input": json.loads(f["arguments"]) if f["arguments"].strip() else {}}


def to_message(chat: dict, stop_word: str | None = None) -> dict:
    """A whole chat.completion (its first choice) as Anthropic's Message; stop_word: the stop string that
    ended it (Generation.stop_word)."""
    choice = chat["choices"][0]
    msg = choice["message"]
    content: list[dict] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    content += [_tool_block(c) for c in msg.get("tool_calls") or []]
    return {"id": message_id(chat["id"]), "type": "message", "role": "assistant", "model": chat["model"],
            "content": content, **stop_fields(choice["finish_reason"], stop_word),
            "usage": message_usage(chat["usage"])}


Event = tuple[str, dict]  # an event's name and its data


class MessageStream:
    """Anthropic's stream events of one answer, from its chat.completion chunks (Generation.chunks), in the
    order a whole answer's blocks have: a new block whenever the kind changes. Whitespace before the first
    text waits, as a whole answer leaves a reply of calls and whitespace without text."""

    def __init__(self, input_tokens: int):
        self.input_tokens = input_tokens  # the prompt's, for message_start (message_delta's: cached apart)
        self.index, self.open, self.texts, self.calls = -1, None, 0, 0
        self.started, self.pending, self.finish_reason = False, "", None

    def feed(self, chunk: dict, stop_word: str | None = None) -> list[Event]:
        """The events of one chunk; stop_word: the stop string that ended the answer, once it ended."""
        if "error" in chunk:
            err = chunk["error"]
            return [("error", anthropic_error(err.get("code", 500), err.get("message", "generation failed")))]
        out = [] if self.started else [self._start(chunk)]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._delta("thinking", delta["reasoning_content"])
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if chunk.get("usage") is not None:
            out += self._finish(chunk["usage"], stop_word)
        return out

    def _start(self, chunk: dict) -> Event:
        self.started = True
        usage = {"input_tokens": self.input_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
                 "cache_creation_input_tokens": 0}
        return "message_start", {"type": "message_start", "message": {
            "id": message_id(chunk["id"]), "type": "message", "role": "assistant", "model": chunk["model"],
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}}

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _block(self, block: dict) -> list[Event]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        self.texts += block["type"] == "text"
        return out + [("content_block_start", {"type": "content_block_start", "index": self.index,
                                               "content_block": block})]

    def _delta(self, kind: str, text: str) -> list[Event]:
        out = []
        if self.open != kind:
            out += self._block({"type": "text", "text": ""} if kind == "text" else
                               {"type": "thinking", "thinking": "", "signature": ""})
        delta = {"type": "text_delta", "text": text} if kind == "text" else \
            {"type": "thinking_delta", "thinking": text}
        return out + [("content_block_delta",
                       {"type": "content_block_delta", "index": self.index, "delta": delta})]

    def _text(self, text: str) -> list[Event]:
        if self.open != "text" and not (self.pending + text).strip():
            self.pending += text
            return []
        text, self.pending = self.pending + text, ""
        return self._delta("text", text)

    def _call(self, delta: dict) -> list[Event]:
        f = delta.get("function") or {}
        out = []
        if delta.get("id"):
            self.calls += 1
            out += self._block({"type": "tool_use", "id": tool_use_id(delta["id"]), "name": f.get("name"),
                                "input": {}})
        if f.get("arguments"):
            out.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                "delta": {"type": "input_json_delta",
                                                          "partial_json": f["arguments"]}}))
        return out

    def _finish(self, use: dict, stop_word: str | None) -> list[Event]:
        out = []
        if self.pending and (self.texts or not self.calls):
            out += self._delta("text", self.pending)
        out += self._close()
        delta = stop_fields(self.finish_reason, stop_word)
        return out + [("message_delta",
                       {"type": "message_delta", "delta": delta, "usage": message_usage(use)}),
                      ("message_stop", {"type": "message_stop"})]
