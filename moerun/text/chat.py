"""Chat templates: a conversation -> the prompt text the model was trained on, rendered as transformers does.

    tmpl = ChatTemplate.for_tokenizer(tok)               # the model's template, or ChatML when it has none
    prompt = tmpl.render(messages, add_generation_prompt=True)
    ids = tok.encode(prompt, add_special=False)          # the template writes BOS itself when the model wants it

Templates come from model files, so they are untrusted code: they run in Jinja's immutable sandbox, and
anything that reaches for Python internals (`''.__class__`, `x.__globals__`) stops with ChatTemplateError.
The environment matches transformers' `apply_chat_template`: trim_blocks, lstrip_blocks, loop controls,
`{% generation %}` blocks, `raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, and
the same clean-up of the messages (None-valued keys dropped, reasoning fields aliased).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moerun.errors import MoerunError
from moerun.text.template_limits import (
    LimitError,
    Limits,
    checked_join,
    guard_filters,
    guarded_render,
    size_checked_binop,
    size_checked_call,
)

__all__ = ["CHATML_TEMPLATE", "ChatTemplate", "ChatTemplateError", "select_template"]

# transformers' historical default: ChatML, as Qwen and many fine-tunes use it.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(MoerunError):
    """A chat template that does not compile, fails while rendering, rejects the messages
    (`raise_exception`), or tries to escape the sandbox."""


class _Raised(TemplateError):
    """raise_exception(...) called by the template: the messages are wrong, not the template."""


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, limits: Limits, **kwargs: Any):
        super().__init__(**kwargs)
        self.limits = limits

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # Jinja would return an Undefined that only fails when used; stop at the first attempt instead.
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        size_checked_binop(operator, left, right, self.limits)
        return super().call_binop(context, operator, left, right)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        args = size_checked_call(obj, args, kwargs, self.limits)
        return super().call(context, obj, *args, **kwargs)

    def concat(self, parts: Any) -> str:  # output and macro/filter-block buffers
        return checked_join(parts, self.limits)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): renders its body."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed names (as transformers')."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's Namespace signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template cannot set the underscore-prefixed attribute {name!r}")


class _Dict:
    """`dict(...)` for templates, without the type itself (no dict.__subclasses__ and friends)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise _Raised(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment(limits: Limits) -> ImmutableSandboxedEnvironment:
    env = _Sandbox(limits, trim_blocks=True, lstrip_blocks=True,
                   extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = guard_filters(env.filters, limits)
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    return env


def _plain(v: Any) -> Any:
    """Plain JSON-like data for the template: no objects whose methods the sandbox does not know about."""
    if v is None or type(v) in (str, int, float, bool):
        return v
    if isinstance(v, str):
        return str.__str__(v)
    if isinstance(v, bool):
        return bool(v)
    if isinstance(v, int):
        return int.__int__(v)
    if isinstance(v, float):
        return float.__float__(v)
    if isinstance(v, Mapping):
        return {_plain(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_plain(x) for x in v)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if callable(getattr(v, "model_dump", None)):  # pydantic models (OpenAI SDK messages)
        return _plain(v.model_dump())
    return f"<{type(v).__name__}>"


def _messages(messages: Sequence[Any]) -> list[dict]:
    out = []
    for m in messages:
        m = _plain(m)
        if not isinstance(m, dict):
            raise ChatTemplateError(f"a chat message must be a dict with 'role' and 'content', not {m!r}")
        m = {k: v for k, v in m.items() if v is not None}  # content=None etc. would render as "None"
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def select_template(templates: Mapping[str, str], name: str | None = None, tools: Any = None) -> str | None:
    """transformers' choice among a model's templates: the named one; "tool_use" when tools are given and the
    model has it; else "default". None when the model has no template at all."""
    if name is not None:
        if name in templates:
            return templates[name]
        raise ChatTemplateError(f"the model has no chat template named {name!r} (it has: {', '.join(templates)})")
    if tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates or not templates:
        return templates.get("default")
    raise ChatTemplateError(f"the model has several chat templates ({', '.join(templates)}) and none is "
                            "'default': name the one to use")


class ChatTemplate:
    """One compiled chat template. `source=None` means the model has none: ChatML is used (`is_fallback`).
    `limits` bounds the steps, time and sizes of one render (see moerun.text.template_limits)."""

    def __init__(self, source: str | None = None, special_tokens: Mapping[str, str] | None = None,
                 limits: Limits | None = None):
        self.is_fallback = source is None
        self.source = CHATML_TEMPLATE if source is None else source
        self.special_tokens = dict(special_tokens or {})  # bos_token, eos_token, ... visible to the template
        self.limits = limits or Limits()
        try:
            self._template = _environment(self.limits).from_string(self.source)
        except TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template does not compile (line {e.lineno}): {e.message}") from None
        except (TemplateError, RecursionError, MemoryError) as e:
            raise ChatTemplateError(f"the chat template does not compile: {type(e).__name__}: {e}") from None
        self._template.root_render_func.__globals__["str_join"] = lambda parts: checked_join(parts, self.limits)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, name: str | None = None, tools: Any = None,
                      source: str | None = None) -> ChatTemplate:
        """The template a moerun Tokenizer carries (see select_template), with its special tokens; `source`, a
        template given instead of the model's (--chat-template, moerun.text.templates), replaces it."""
        if source is None:
            source = select_template(tokenizer.chat_templates, name, tools)
        return cls(source, tokenizer.special_tokens)

    def render(self, messages: Sequence[Any], add_generation_prompt: bool = False, tools: Any = None,
               documents: Any = None, continue_final_message: bool = False, **kwargs: Any) -> str:
        """The prompt text. `continue_final_message` leaves the last message open (to prefill the answer);
        extra keyword arguments (e.g. enable_thinking=False) are passed to the template."""
        msgs = _messages(messages)
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
            final = msgs[-1].get("content") if msgs else None
            if not isinstance(final, str):
                raise ChatTemplateError("continue_final_message needs a last message with text content")
            msgs[-1]["content"] = final + _CONTINUE_TAG
        variables = {**self.special_tokens, **_plain(kwargs)}
        text = self._render(messages=msgs, tools=_plain(tools), documents=_plain(documents),
                            add_generation_prompt=add_generation_prompt, **variables)
        if continue_final_message:
            tag = _CONTINUE_TAG.strip()
            if final.strip() not in text or tag not in text:
                raise ChatTemplateError("continue_final_message: the template does not write the last message "
                                        "as given, so it cannot be continued")
            at = text.rindex(tag)
            text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        return text

    def generation_prompt(self, messages: Sequence[Any], **kwargs: Any) -> str:
        """The text add_generation_prompt adds after `messages` (what the model's answer continues, e.g.
        "<|im_start|>assistant\\n"), as llama.cpp finds it: the prompt with it, less the prompt without it.
        "" when the template cannot render the messages without it."""
        full = self.render(messages, add_generation_prompt=True, **kwargs)
        try:
            base = self.render(messages, add_generation_prompt=False, **kwargs)
        except ChatTemplateError:
            return ""
        n = 0
        for a, b in zip(full, base):
            if a != b:
                break
            n += 1
        return full[n:]

    def _render(self, **variables: Any) -> str:
        try:
            return guarded_render(lambda: self._template.render(**variables), self.limits)
        except _Raised as e:
            raise ChatTemplateError(f"the chat template rejected the messages: {e.message}") from None
        except LimitError as e:
            raise ChatTemplateError(f"the chat template went past a resource limit: {e}") from None
        except RecursionError:
            raise ChatTemplateError("the chat template recursed too deeply") from None
        except (MemoryError, OverflowError) as e:
            raise ChatTemplateError(f"the chat template went past a resource limit: {type(e).__name__}: "
                                    f"{e}") from None
        except SecurityError as e:
            raise ChatTemplateError(f"the chat template tried an operation the sandbox forbids: {e}") from None
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
