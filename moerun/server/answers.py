"""One choice of an answer, from the scheduler's events to OpenAI's objects: the reasoning told apart, tool calls
read back, log probabilities attached; as stream chunks (ChoiceStream) or whole (whole_choice)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from moerun.server.protocol import Reply
from moerun.server.tools import ToolRequest, message_calls, stream_deltas
from moerun.text.toolcalls import HarmonyCalls, ToolCallParser, ToolSyntax

log = logging.getLogger("moerun.server")

Calls = tuple[ToolSyntax, ToolRequest]  # the template's tool-call syntax and the request's tools


def read_calls(syntax: ToolSyntax, pieces: list[tuple[str, str]], final: bool, parser=None):
    """(kind, text) pieces of the reasoning parser (or all content) through the syntax's call reader -> the
    reader's events; `parser`: the reader kept across calls (a stream's)."""
    parser = parser or (HarmonyCalls() if syntax.body == "harmony" else ToolCallParser(syntax))
    out = []
    for kind, text in pieces:
        if isinstance(parser, HarmonyCalls):
            out += parser.feed(kind, text)
        elif kind == "content":
            out += parser.feed(text)
        elif kind in ("content", "reasoning"):
            out.append((kind, text))
    return out + (parser.flush() if final else [])


class _StreamCalls:
    """A stream's content pieces through the tool-call parser: text stays content, each call becomes its
    chunks (kind "tool": ready chunk objects)."""

    def __init__(self, calls: Calls, reply: Reply, request_id: str, index: int):
        (self.syntax, self.tools), self.reply, self.id, self.index = calls, reply, request_id, index
        self.parser = HarmonyCalls() if self.syntax.body == "harmony" else ToolCallParser(self.syntax)
        self.n = 0

    def _out(self, events) -> list[tuple[str, Any]]:
        out = []
        for kind, value in events:
            if kind in ("content", "reasoning"):
                out.append((kind, value))
            elif kind == "call" and (self.tools.parallel or self.n == 0):
                out += [("tool", self.reply.tool_chunk(d, self.index)) for d in stream_deltas(self.n, value)]
                self.n += 1
            elif kind == "error":
                log.warning("request %s: %s (kept as content)", self.id, value)
        return out

    def feed(self, pieces: list[tuple[str, str]]) -> list[tuple[str, Any]]:
        return self._out(read_calls(self.syntax, pieces, False, self.parser))

    def flush(self) -> list[tuple[str, Any]]:
        return self._out(self.parser.flush())


class ChoiceStream:
    """Choice `index`'s stream chunks, event by event (Event: text, logprobs entries, finish_reason)."""

    def __init__(self, reply: Reply, index: int, request_id: str, split: Callable | None, calls: Calls | None,
                 logprobs: bool):
        self.reply, self.index, self.logprobs = reply, index, logprobs
        self.parser = None if split is None else split()
        self.tools = None if calls is None else _StreamCalls(calls, reply, request_id, index)

    def _chunks(self, pieces, held) -> list[dict]:
        out = []
        for kind, text in pieces:
            if kind == "tool":
                out.append(text)
            elif text and kind in ("content", "reasoning"):  # never a dropped message's text
                out.append(self.reply.chunk(text, kind, held, self.index))
                held = [] if held is not None else None
        if held:  # tokens whose text is held back: their entries now
            out.append(self.reply.chunk("", "content", held, self.index))
        return out

    def feed(self, ev) -> list[dict]:
        pieces = [("content", ev.text)] if self.parser is None else self.parser.feed(ev.text)
        if self.tools is not None:
            pieces = self.tools.feed(pieces)
        return self._chunks(pieces, list(ev.logprobs) if self.logprobs else None)

    def finish(self, ev) -> tuple[list[dict], str]:
        """The last event's chunks and what is still held back -> (chunks, the choice's finish reason: "tool_calls"
        after a whole call, unless max_tokens stopped it: "length", as a call cut off is never a whole one)."""
        chunks = self.feed(ev)
        rest = [] if self.parser is None else self.parser.flush()
        if self.tools is not None:
            rest = self.tools.feed(rest) + self.tools.flush()
        chunks += self._chunks(rest, None)
        made = self.tools is not None and self.tools.n and ev.finish_reason != "length"
        return chunks, "tool_calls" if made else ev.finish_reason


def whole_choice(reply: Reply, index: int, request_id: str, text: str, finish_reason: str, split: Callable | None,
                 calls: Calls | None, logprobs: list | None) -> dict:
    """Choice `index` of a whole answer from its text."""
    if split is None:
        pieces = [("content", text)]
    else:
        parser = split()
        pieces = parser.feed(text) + parser.flush()
    tool_calls = None
    if calls is not None:
        pieces = read_calls(calls[0], pieces, True)
        tool_calls = message_calls([v for k, v in pieces if k == "call"], calls[1].parallel)
        for message in (v for k, v in pieces if k == "error"):
            log.warning("request %s: %s (kept as content)", request_id, message)
    text = "".join(v for k, v in pieces if k == "content")
    reasoning = "".join(v for k, v in pieces if k == "reasoning")
    return reply.whole_choice(text, finish_reason, reasoning, logprobs, tool_calls, index)
