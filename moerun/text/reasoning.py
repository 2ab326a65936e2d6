"""A chat model's reasoning, told apart from its answer: gpt-oss's harmony channels, `<think>...</think>`.

    syntax = syntax_for(template.source)                    # None: the template writes no reasoning
    parser = ReasoningParser(syntax, prime=template.generation_prompt(messages))
    for piece in generated_text:
        for kind, text in parser.feed(piece): ...             # kind: "reasoning" or "content"
    for kind, text in parser.flush(): ...

A syntax is data: states, each sending its text to the answer (content), the reasoning, a message header
or nowhere, and the markers that move from one state to another. The parser reads text as it streams and
holds back any end of it that may be the start of a marker, so a marker split over tokens or chunks never
shows in the output, and the split does not depend on how the text was cut: streamed and whole agree.

The model continues the generation prompt (the text the template's add_generation_prompt adds, e.g.
harmony's "<|start|>assistant", or a "<think>\\n" that opens the reasoning for the model): `prime`, from
its first marker on, is read before the model's text, and only the model's text comes out. This is
llama.cpp's rule too (it parses the generation prompt followed by the output).

Formats (llama-server's --reasoning-format): "none" leaves the reasoning in the content, markers and all;
"auto" and "deepseek" put it in `reasoning_content`, in whole answers and in stream deltas alike.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from moerun.config import REASONING_FORMATS

__all__ = ["HARMONY", "REASONING_FORMATS", "SYNTAXES", "THINK", "ReasoningParser", "ReasoningSyntax", "State",
           "split_reasoning", "syntax_for"]

CONTENT, REASONING, HEADER, DROP = "content", "reasoning", "header", "drop"  # where a state's text goes
ROUTE = "@route"  # the next state is the syntax's route for the header just read


@dataclass(frozen=True)
class State:
    """sink: content, reasoning, header (kept to choose the next state by) or drop. on: (marker, next state).
    lstrip / rstrip: leading / trailing whitespace of the state's text is dropped. until_text: the state that
    non-blank text moves to (the markers of this state only count before any text)."""

    sink: str
    on: tuple[tuple[str, str], ...] = ()
    lstrip: bool = False
    rstrip: bool = False
    until_text: str | None = None
    kept: str | None = None  # a DROP state's text, kept under this kind when the parser keeps it (tool calls)


@dataclass(frozen=True)
class ReasoningSyntax:
    """detect: a template whose source has this string writes this syntax (llama.cpp's test).
    routes: (regex, state): a header's next state is the first whose regex it contains, else route_default.
    max_header: a header longer than this is not one: its text is content."""

    name: str
    detect: str
    start: str
    states: Mapping[str, State]
    routes: tuple[tuple[str, str], ...] = ()
    route_default: str = CONTENT
    max_header: int = 256

    @property
    def markers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(m for s in self.states.values() for m, _ in s.on))


# gpt-oss: <|start|>assistant<|channel|>analysis<|message|>...<|end|>
#          <|start|>assistant<|channel|>final<|message|>...
# The analysis channel is reasoning; final and commentary (a preamble) are content; a message to a recipient
# (" to=functions.f", a tool call) is dropped, as llama.cpp's parser drops calls no tools were given for.
HARMONY = ReasoningSyntax(
    name="harmony", detect="<|channel|>", start="content",
    states=MappingProxyType({
        "content": State(CONTENT, on=(("<|start|>", "header"), ("<|channel|>", "header"),
                                      ("<|end|>", "content"))),
        "header": State(HEADER, on=(("<|message|>", ROUTE),)),
        "analysis": State(REASONING, on=(("<|end|>", "content"), ("<|start|>", "header"))),
        "recipient": State(DROP, on=(("<|end|>", "content"), ("<|start|>", "header")), kept="tool"),
    }),
    routes=((r" to=(?!assistant\b)", "recipient"),
            (r"<\|channel\|>\s*analysis\b(?!.*<\|channel\|>)", "analysis")))

# Qwen3, DeepSeek-R1, GLM-4.5 ...: an optional <think>...</think> first, then the answer; whitespace around
# the tags is dropped, as llama.cpp's parser does.
THINK = ReasoningSyntax(
    name="think", detect="</think>", start="start",
    states=MappingProxyType({
        "start": State(CONTENT, on=(("<think>", "reasoning"),), lstrip=True, until_text="content"),
        "reasoning": State(REASONING, on=(("</think>", "content"),), lstrip=True, rstrip=True),
        "content": State(CONTENT, lstrip=True),
    }))

SYNTAXES = (HARMONY, THINK)


def syntax_for(template_source: str | None, fmt: str = "auto") -> ReasoningSyntax | None:
    """The reasoning syntax the template writes, or None (no template, none known, or format "none")."""
    if fmt not in REASONING_FORMATS:
        raise ValueError(f"unknown reasoning format {fmt!r} (one of {', '.join(REASONING_FORMATS)})")
    if fmt == "none" or not template_source:
        return None
    return next((s for s in SYNTAXES if s.detect in template_source), None)


class ReasoningParser:
    """Splits streamed text into ("reasoning" | "content", text) pieces by a ReasoningSyntax."""

    def __init__(self, syntax: ReasoningSyntax, prime: str = "", keep: bool = False):
        """keep: dropped states with a `kept` kind give their text as (kind, text) pieces after a (kind +
        "_start", header) piece (harmony's messages to a recipient: tool calls, moerun.server.answers)."""
        self.syntax, self.keep = syntax, keep
        self._name, self._state = syntax.start, syntax.states[syntax.start]
        self._buf = ""       # text not given to a state yet (its end may start a marker)
        self._header = ""    # the header being read, its opening marker included
        self._primed = 0     # characters of the header that came from the prime
        self._blank = True   # the current state has had no non-blank text
        self._ws = ""        # whitespace an rstrip state holds back
        self._out: list[tuple[str, str]] = []
        starts = [i for m in syntax.markers if (i := prime.find(m)) >= 0]
        if starts:
            self._buf = prime[min(starts):]
            self._run(final=False)
            self._out.clear()
            self._buf, self._primed = "", len(self._header)  # the prompt's text never comes out

    def feed(self, text: str) -> list[tuple[str, str]]:
        """The pieces `text` completes (text that may start a marker waits for the next call)."""
        self._buf += text
        self._run(final=False)
        return self._take()

    def flush(self) -> list[tuple[str, str]]:
        """The rest, at the end of the output: held-back text that was no marker, an unfinished header."""
        self._run(final=True)
        if self._state.sink == HEADER:
            self._abandon_header()
        self._ws = ""
        return self._take()

    def whole(self, text: str) -> tuple[str, str]:
        """A whole output -> (content, reasoning)."""
        parts = {CONTENT: [], REASONING: []}
        for kind, piece in (*self.feed(text), *self.flush()):
            parts.get(kind, []).append(piece)
        return "".join(parts[CONTENT]), "".join(parts[REASONING])

    def _take(self) -> list[tuple[str, str]]:
        out, self._out = self._out, []
        return out

    def _run(self, final: bool) -> None:
        while True:
            hit = self._next_marker()
            if hit is None:
                keep = 0 if final else self._partial_marker()
                text, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                self._give(text)
                return
            at, marker, nxt = hit
            name = self._name
            self._give(self._buf[:at])
            self._buf = self._buf[at:]
            if self._name != name:  # text moved us on: the marker is for the new state to judge
                continue
            self._buf = self._buf[len(marker):]
            if nxt == ROUTE:
                nxt = self._route()
            self._enter(nxt, marker)

    def _next_marker(self) -> tuple[int, str, str] | None:
        """The first marker of the current state in the buffer (the longest, at one position)."""
        best = None
        for marker, nxt in self._state.on:
            i = self._buf.find(marker)
            if i >= 0 and (best is None or (i, -len(marker)) < (best[0], -len(best[1]))):
                best = (i, marker, nxt)
        return best

    def _partial_marker(self) -> int:
        """Length of the longest end of the buffer that is a proper prefix of one of the state's markers."""
        n = 0
        for marker, _ in self._state.on:
            for k in range(min(len(marker) - 1, len(self._buf)), n, -1):
                if self._buf.endswith(marker[:k]):
                    n = k
                    break
        return n

    def _enter(self, name: str, marker: str = "") -> None:
        self._name, self._state = name, self.syntax.states[name]
        self._blank, self._ws = True, ""
        if self._state.sink == HEADER:
            self._header, self._primed = marker, 0
        elif self.keep and self._state.kept:
            self._out.append((self._state.kept + "_start", self._header))

    def _route(self) -> str:
        return next((state for rx, state in self.syntax.routes if re.search(rx, self._header)),
                    self.syntax.route_default)

    def _abandon_header(self) -> None:
        """Not a header after all: what the model wrote of it is content."""
        text = self._header[self._primed:]
        self._enter(self.syntax.route_default)
        self._give(text)

    def _give(self, text: str) -> None:
        if not text:
            return
        st = self._state
        if st.until_text is not None and text.strip():
            i = len(text) - len(text.lstrip())
            self._give(text[:i])
            self._enter(st.until_text)
            self._give(text[i:])
            return
        if st.sink == HEADER:
            self._header += text
            if len(self._header) - self._primed > self.syntax.max_header:
                self._abandon_header()
            return
        if st.sink == DROP:
            if self.keep and st.kept:
                if self._out and self._out[-1][0] == st.kept:
                    self._out[-1] = (st.kept, self._out[-1][1] + text)
                else:
                    self._out.append((st.kept, text))
            return
        if st.lstrip and self._blank:
            text = text.lstrip()
        if not text:
            return
        self._blank = False
        if st.rstrip:
            text = self._ws + text
            body = text.rstrip()
            self._ws, text = text[len(body):], body
        if text:
            if self._out and self._out[-1][0] == st.sink:
                self._out[-1] = (st.sink, self._out[-1][1] + text)
            else:
                self._out.append((st.sink, text))


def split_reasoning(text: str, syntax: ReasoningSyntax | None, prime: str = "") -> tuple[str, str]:
    """A whole output -> (content, reasoning); without a syntax, all of it is content."""
    return (text, "") if syntax is None else ReasoningParser(syntax, prime).whole(text)
