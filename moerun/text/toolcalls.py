"""Tool calls in a model's own format, parsed back into OpenAI's `tool_calls`, while streaming.

    syntax = syntax_for(template.source)          # None: the template renders no tool calls
    parser = ToolCallParser(syntax)
    for piece in generated_text:
        for kind, value in parser.feed(piece): ...  # ("content", text) | ("call", ToolCall) | ("error", message)
    for kind, value in parser.flush(): ...

A syntax is data: the marker that opens a call and the one that closes it (None: the end of the text), markers
that are dropped (a block around several calls), and how a call's body reads:

    json        {"name": ..., "arguments": {...}}                          Qwen3, Hermes: <tool_call>...</tool_call>
    json_list   [{"name": ..., "arguments": {...}}, ...]                    Mistral (Nemo): [TOOL_CALLS][...]
    name_json   NAME <sep> {...}                                            DeepSeek-V3.1, Mistral Small 3.2
    xml         NAME, then <key>k</key><value>v</value> pairs per argument   GLM-4.5/4.6, Qwen3.5 / Qwen3-Coder

The parser holds back any end of the text that may be the start of a marker, so a marker split across tokens or
chunks never shows as content, and streamed and whole output parse alike. A call whose body does not parse
(malformed JSON, a call never closed) is an ("error", ...) and its text is given back as content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

__all__ = ["SYNTAXES", "HarmonyCalls", "ToolCall", "ToolCallParser", "ToolSyntax", "syntax_for"]


@dataclass(frozen=True)
class ToolSyntax:
    """detect: every one of these strings is in a template that writes this syntax (tried in SYNTAXES' order).
    xml: (name prefix, name suffix, key open, key close, value open, value close) for the xml body."""

    name: str
    detect: tuple[str, ...]
    open: str
    close: str | None
    body: str
    sep: str = ""
    id_sep: str = ""  # name_json: between the name and the call's id, when the model writes one (Mistral's)
    drop: tuple[str, ...] = ()
    xml: tuple[str, str, str, str, str, str] | None = None
    # how the template writes an xml call between its markers: (head with {name}, one argument with {key} and
    # {value}, tail), for the grammar of a forced call (moerun.server.tools)
    xml_form: tuple[str, str, str] | None = None

    @property
    def markers(self) -> tuple[str, ...]:
        return tuple(m for m in (self.open, self.close, *self.drop) if m)


SYNTAXES = (
    # gpt-oss: <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>;
    # its reasoning parser (moerun.text.reasoning, keep=True) hands over the header and the body: HarmonyCalls
    ToolSyntax("harmony", ("<|channel|>", "<|call|>"), "", None, "harmony"),
    ToolSyntax("glm", ("<tool_call>", "<arg_key>"), "<tool_call>", "</tool_call>", "xml",
               xml=("", "\n", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
               xml_form=("{name}\n", "<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n", "")),
    ToolSyntax("qwen-xml", ("<tool_call>", "<function="), "<tool_call>", "</tool_call>", "xml",
               xml=("<function=", ">", "<parameter=", ">", "", "</parameter>"),
               xml_form=("\n<function={name}>\n", "<parameter={key}>\n{value}\n</parameter>\n", "</function>\n")),
    ToolSyntax("deepseek", ("<｜tool▁call▁begin｜>",), "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "name_json",
               sep="<｜tool▁sep｜>", drop=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")),
    ToolSyntax("mistral-args", ("[TOOL_CALLS]", "[ARGS]"), "[TOOL_CALLS]", None, "name_json", sep="[ARGS]",
               id_sep="[CALL_ID]"),
    ToolSyntax("mistral", ("[TOOL_CALLS]",), "[TOOL_CALLS]", None, "json_list"),
    ToolSyntax("hermes", ("<tool_call>",), "<tool_call>", "</tool_call>", "json"),
)


def syntax_for(template: str | None) -> ToolSyntax | None:
    """The tool-call syntax a chat template's source writes, or None."""
    if not template:
        return None
    return next((s for s in SYNTAXES if all(d in template for d in s.detect)), None)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallError(ValueError):
    pass


def _object(text: str, what: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"{what} is not valid JSON ({e.msg} at {e.pos}): {text[:200]!r}") from None
    if not isinstance(value, dict):
        raise ToolCallError(f"{what} is not a JSON object: {text[:200]!r}")
    return value


def _named(obj: dict) -> ToolCall:
    name, args = obj.get("name"), obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or not name:
        raise ToolCallError(f"a tool call without a name: {json.dumps(obj)[:200]}")
    if isinstance(args, str):
        args = _object(args, f"{name}'s arguments")
    if not isinstance(args, dict):
        raise ToolCallError(f"{name}'s arguments are not an object")
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _xml_value(text: str):
    """An argument's text: JSON when it reads as JSON (numbers, objects, ...), else the string itself."""
    text = text.strip("\n")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_calls(syntax: ToolSyntax, body: str) -> list[ToolCall]:
    """The calls one body (the text between a call's markers) holds -> ToolCalls; ToolCallError if malformed."""
    body = body.strip()
    if syntax.body == "json":
        return [_named(_object(body, "the tool call"))]
    if syntax.body == "json_list":
        try:
            calls = json.loads(body)
        except json.JSONDecodeError as e:
            raise ToolCallError(f"the tool calls are not valid JSON ({e.msg} at {e.pos}): {body[:200]!r}") from None
        calls = calls if isinstance(calls, list) else [calls]
        if not all(isinstance(c, dict) for c in calls):
            raise ToolCallError(f"the tool calls are not a list of objects: {body[:200]!r}")
        return [_named(c) for c in calls]
    if syntax.body == "name_json":
        name, sep, args = body.partition(syntax.sep)
        if not sep or not name.strip():
            raise ToolCallError(f"a tool call without '{syntax.sep}' after its name: {body[:200]!r}")
        args = args.strip()
        if args.startswith("```"):  # DeepSeek-V3's fenced arguments
            args = re.sub(r"^```[a-z]*\s*|\s*```$", "", args)
        name, _, call_id = name.partition(syntax.id_sep) if syntax.id_sep else (name, "", "")
        call = ToolCall(name.strip(), json.dumps(_object(args, f"{name.strip()}'s arguments"), ensure_ascii=False))
        if call_id.strip():
            call.id = call_id.strip()
        return [call]
    pre, post, k_open, k_close, v_open, v_close = syntax.xml
    head = body
    if pre:
        if not body.startswith(pre) or post not in body:
            raise ToolCallError(f"a tool call without '{pre}NAME{post}': {body[:200]!r}")
        body = body[len(pre):]
    name, _, rest = body.partition(post)
    rest = rest.removesuffix("</function>").strip() if pre else rest
    args, pos = {}, 0
    pattern = re.compile(re.escape(k_open) + r"(.*?)" + re.escape(k_close) + r"\s*" + re.escape(v_open) + r"(.*?)"
                         + re.escape(v_close), re.DOTALL)
    for m in pattern.finditer(rest):
        if rest[pos:m.start()].strip():
            raise ToolCallError(f"unexpected text in a tool call's arguments: {head[:200]!r}")
        args[m.group(1).strip()] = _xml_value(m.group(2))
        pos = m.end()
    if rest[pos:].strip() or not name.strip():
        raise ToolCallError(f"a tool call that does not parse: {head[:200]!r}")
    return [ToolCall(name.strip(), json.dumps(args, ensure_ascii=False))]


class ToolCallParser:
    """Content and tool calls out of the generated text as it streams (module docstring)."""

    def __init__(self, syntax: ToolSyntax):
        self.syntax = syntax
        self.buf, self.in_call = "", False

    def _held(self, text: str, markers: tuple[str, ...]) -> int:
        """Length of the longest end of `text` that is the start of one of `markers`."""
        best = 0
        for m in markers:
            for n in range(min(len(m) - 1, len(text)), best, -1):
                if text.endswith(m[:n]):
                    best = n
                    break
        return best

    def feed(self, text: str) -> list[tuple[str, object]]:
        s, out = self.syntax, []
        self.buf += text
        while True:
            if not self.in_call:
                hits = [(self.buf.find(m), m) for m in (s.open, *s.drop) if m in self.buf]
                if not hits:
                    keep = self._held(self.buf, (s.open, *s.drop))
                    if len(self.buf) > keep:
                        out.append(("content", self.buf[:len(self.buf) - keep]))
                        self.buf = self.buf[len(self.buf) - keep:]
                    return out
                at, marker = min(hits)
                if at:
                    out.append(("content", self.buf[:at]))
                self.buf = self.buf[at + len(marker):]
                self.in_call = marker == s.open
                continue
            if s.close is None:  # a call ends where the next opens, or at the end of the text
                if s.open not in self.buf:
                    return out
                body, self.buf = self.buf.split(s.open, 1)
                out += self._calls(body)
                continue
            if s.close not in self.buf:
                return out
            body, self.buf = self.buf.split(s.close, 1)
            self.in_call = False
            out += self._calls(body)

    def _calls(self, body: str) -> list[tuple[str, object]]:
        try:
            return [("call", c) for c in parse_calls(self.syntax, body)]
        except ToolCallError as e:
            return [("error", str(e)), ("content", self.syntax.open + body + (self.syntax.close or ""))]

    def flush(self) -> list[tuple[str, object]]:
        """The end of the text: a call still open is parsed (a syntax that closes at the end) or given back."""
        out, body, self.buf = [], self.buf, ""
        if not self.in_call:
            return [("content", body)] if body else []
        self.in_call = False
        if self.syntax.close is None:
            return self._calls(body)
        out.append(("error", f"a tool call that was never closed ({self.syntax.close!r}): {body[:200]!r}"))
        out.append(("content", self.syntax.open + body))
        return out


class HarmonyCalls:
    """gpt-oss's calls from its reasoning parser's pieces: ("tool_start", the message's header naming
    functions.NAME) and ("tool", the JSON arguments); other pieces pass through. Same events as ToolCallParser."""

    def __init__(self):
        self.name: str | None = None
        self.body = ""

    def feed(self, kind: str, text: str) -> list[tuple[str, object]]:
        if kind == "tool":
            self.body += text
            return []
        out = self._close()
        if kind == "tool_start":
            m = re.search(r"to=functions\.([^\s<]+)", text)
            self.name = m.group(1) if m else ""
            return out
        return out + [(kind, text)]

    def flush(self) -> list[tuple[str, object]]:
        return self._close()

    def _close(self) -> list[tuple[str, object]]:
        if self.name is None:
            return []
        name, body, self.name, self.body = self.name, self.body, None, ""
        if not name:
            return [("error", f"a message to a recipient that is not a function: {body[:200]!r}")]
        try:
            return [("call", ToolCall(name, json.dumps(_object(body.strip(), f"{name}'s arguments"),
                                                       ensure_ascii=False)))]
        except ToolCallError as e:
            return [("error", str(e))]
