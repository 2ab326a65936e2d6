"""Function calling for chat completions: the request's tools checked, the forced call's grammar, the answer's
calls in OpenAI's shape.

The tools reach the model through its chat template (`tools=`, as apply_chat_template renders them); the
template's tool-call syntax (moerun.text.toolcalls) reads the calls back. tool_choice "required" or a named
function constrains decoding (moerun.engine.grammar) to one call (or several, with parallel_tool_calls) in that
syntax whose arguments follow the function's parameter schema; "none" leaves the tools out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from moerun.server.errors import APIError
from moerun.text.toolcalls import ToolCall, ToolSyntax

# compact JSON in forced calls (llguidance's JSON options, inside a Lark grammar's %json)
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict]  # OpenAI's [{"type": "function", "function": {name, description, parameters}}]
    choice: str  # auto | none | required | the function's name (forced)
    parallel: bool

    @property
    def forced(self) -> list[dict]:
        """The functions decoding is constrained to ([] for auto and none)."""
        if self.choice == "auto" or self.choice == "none":
            return []
        return [t["function"] for t in self.tools if self.choice == "required" or t["function"]["name"] == self.choice]


def parse_request(tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> ToolRequest | None:
    """The request's tools and tool_choice, checked (400 naming the field), or None without tools."""
    if tool_choice is not None and not tools:
        if tool_choice == "none":
            return None
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if not tools:
        return None
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict):
            raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param=f"tools[{i}]")
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise APIError(400, f"tools[{i}].function has no name", param=f"tools[{i}].function.name")
        if not isinstance(f.get("parameters", {}), dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                           param=f"tools[{i}].function.parameters")
        names.append(f["name"])
    if tool_choice is None:
        choice = "auto"
    elif tool_choice in ("auto", "none", "required"):
        choice = tool_choice
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        choice = tool_choice["function"].get("name")
        if choice not in names:
            raise APIError(400, f"tool_choice names {choice!r}, which is not among the tools ({', '.join(names)})",
                           param="tool_choice")
    else:
        raise APIError(400, "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': "
                            "{'name': ...}}", param="tool_choice")
    return ToolRequest([{"type": "function", "function": t["function"]} for t in tools], choice,
                       True if parallel is None else bool(parallel))


def _call_schema(f: dict, name_field: bool) -> dict:
    params = f.get("parameters") or {"type": "object"}
    if not name_field:
        return {**params, **_COMPACT}
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": f["name"]}, "arguments": params}, **_COMPACT}


def _lit(text: str) -> str:
    return json.dumps(text)  # a Lark string literal: JSON's escapes are Lark's


def forced_grammar(syntax: ToolSyntax, req: ToolRequest) -> str | None:
    """A Lark grammar (llguidance's) of the calls tool_choice forces, in the template's syntax; None when nothing
    is forced. A syntax whose forced form is not written yet is a 400."""
    funcs = req.forced
    if not funcs:
        return None
    if syntax.body == "json":  # <tool_call>\n{"name": .., "arguments": ..}\n</tool_call>
        one = [f"{_lit(syntax.open + chr(10))} %json {json.dumps(_call_schema(f, True))} {_lit(chr(10) + syntax.close)}"
               for f in funcs]
    elif syntax.body == "name_json":  # OPEN name SEP {args} (CLOSE)
        one = [f"{_lit(syntax.open + f['name'] + syntax.sep)} %json {json.dumps(_call_schema(f, False))}"
               + (f" {_lit(syntax.close)}" if syntax.close else "") for f in funcs]
    elif syntax.body == "json_list":  # OPEN [{"name": .., "arguments": ..}, ...]
        item = {"anyOf": [_call_schema(f, True) for f in funcs]}
        schema = {"type": "array", "items": item, "minItems": 1, **({} if req.parallel else {"maxItems": 1}),
                  **_COMPACT}
        return f"start: {_lit(syntax.open)} %json {json.dumps(schema)}"
    elif syntax.xml_form is not None:
        return _xml_grammar(syntax, funcs, req.parallel)
    elif syntax.body == "harmony":  # one message to functions.NAME, its markers the special tokens they are
        one = [f"<|channel|> {_lit('commentary to=functions.' + f['name'] + ' ')} <|constrain|> \"json\" "
               f"<|message|> %json {json.dumps(_call_schema(f, False))} <|call|>" for f in funcs]
        return "start: " + " | ".join(f"({c})" for c in one)
    else:
        raise APIError(400, f"tool_choice {req.choice!r}: forced calls in this model's tool-call format "
                            f"({syntax.name}) are not supported yet (use 'auto')", param="tool_choice")
    call = " | ".join(f"({c})" for c in one)
    rule = "call (\"\\n\" call)*" if req.parallel and len(funcs) >= 1 else "call"
    return f"start: {rule}\ncall: {call}"


def _xml_grammar(syntax: ToolSyntax, funcs: list[dict], parallel: bool) -> str:
    """The forced calls of an xml syntax (Qwen3.5, GLM): each function's arguments in its schema's order, the
    required ones always, strings as one line of plain text (no '<', the schema's length bounds), anything else
    as JSON of its schema."""
    head, arg, tail = syntax.xml_form
    rules, calls = [], []
    for fi, f in enumerate(funcs):
        params = f.get("parameters") or {}
        required = set(params.get("required", []))
        parts = []
        for pi, (key, schema) in enumerate((params.get("properties") or {}).items()):
            before, after = arg.split("{value}")
            schema = schema if isinstance(schema, dict) else {}
            if schema.get("type") == "string" and "enum" not in schema:  # one line of text as written, no "<"
                lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
                rules.append(f"T{fi}_{pi}: /[^<\\n]{{{lo},{'' if hi is None else int(hi)}}}/")
                value = f"T{fi}_{pi}"
            else:
                value = f"%json {json.dumps({**schema, **_COMPACT})}"
            rules.append(f"a{fi}_{pi}: {_lit(before.format(key=key))} {value} {_lit(after)}")
            parts.append(f"a{fi}_{pi}" + ("" if key in required else "?"))
        body = " ".join([_lit(syntax.open + head.format(name=f["name"])), *parts, _lit(tail + syntax.close)])
        rules.append(f"c{fi}: {body}")
        calls.append(f"c{fi}")
    rule = "call (\"\\n\" call)*" if parallel else "call"
    return "\n".join([f"start: {rule}", f"call: {' | '.join(calls)}", *rules])


def message_calls(calls: list[ToolCall], parallel: bool) -> list[dict]:
    """The answer's tool_calls (the first only without parallel_tool_calls)."""
    return [c.to_openai() for c in (calls if parallel else calls[:1])]


def stream_deltas(index: int, call: ToolCall) -> list[dict]:
    """A call as OpenAI streams it: the id and name first, then the arguments."""
    return [{"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}},
            {"index": index, "function": {"arguments": call.arguments}}]
