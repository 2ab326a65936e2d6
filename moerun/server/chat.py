"""What every route that takes chat messages shares: the prompt (the chat template applied, then tokenized),
the reasoning parser that tells the answer's reasoning apart, the tool-call syntax and the grammar the output
must follow."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool

from moerun.server.errors import APIError
from moerun.server.generation import Generation, start
from moerun.server.protocol import ChatRequest, message_texts
from moerun.server.tools import ToolRequest, forced_grammar, parse_request

if TYPE_CHECKING:
    from moerun.server.answers import Calls
    from moerun.server.ready import Ready
    from moerun.server.state import Server
    from moerun.text import ChatTemplate
    from moerun.text.reasoning import ReasoningParser

    Split = Callable[[], ReasoningParser]  # a new parser for one request's output

log = logging.getLogger("moerun.server")


@contextlib.contextmanager
def _template_errors():
    """A template's own error (a raise_exception, a limit hit) is the request's: 400 on its messages."""
    from moerun.text import ChatTemplateError

    try:
        yield
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from None


def chat_text(ready: Ready, messages: list[dict], kwargs: dict | None = None) -> str:
    """The chat template applied to `messages` with the generation prompt: the text chat_prompt tokenizes
    (llama-server's /apply-template)."""
    if ready.template is None:
        raise APIError(501, f"this model's chat template cannot be used: {ready.template_error}")
    with _template_errors():
        return ready.template.render(message_texts(messages), add_generation_prompt=True, **(kwargs or {}))


def chat_prompt(ready: Ready, messages: list[dict], kwargs: dict | None, reasoning: str = "none",
                tools: list[dict] | None = None, keep: bool = False) -> tuple[list[int], Split | None]:
    """The chat template applied (with the request's tools), then tokenized (the template writes BOS itself
    when the model wants it); and, when the template writes reasoning the `reasoning` format tells apart,
    the parser's factory."""
    from moerun.text.reasoning import ReasoningParser

    kwargs = {**(kwargs or {}), **({"tools": tools} if tools else {})}
    text = chat_text(ready, messages, kwargs)
    tok = ready.runtime.engine.tokenizer
    syntax = usable_syntax(ready.template, tok, reasoning)
    with _template_errors():
        prime = "" if syntax is None else ready.template.generation_prompt(message_texts(messages), **kwargs)
    split = None if syntax is None else functools.partial(ReasoningParser, syntax, prime, keep=keep)
    return tok.encode(text, add_special=False), split


async def start_chat(server: Server, body: ChatRequest) -> Generation:
    """A chat request submitted: its tools and tool_choice read, the template applied, the output's grammar
    compiled. Chat completions answer it as they are; the Responses and Messages APIs convert it both ways."""
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
    return await start(server, body, prompt, "chat", split, grammar, calls)


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


def usable_syntax(template: ChatTemplate, tokenizer: Any, fmt: str):
    """The reasoning syntax of `template` under format `fmt`, when the tokenizer writes all its markers out
    (a marker that is a control token decoding leaves out could not be seen); else None."""
    from moerun.text.reasoning import syntax_for

    syntax = None if template.is_fallback else syntax_for(template.source, fmt)
    return syntax if syntax is not None and all(map(tokenizer.renders, syntax.markers)) else None


def say_reasoning(template: ChatTemplate, tokenizer: Any, fmt: str) -> None:
    """At load: a log line on the reasoning the chat template writes and what chat completions do with it."""
    from moerun.text.reasoning import syntax_for

    syntax = None if template.is_fallback else syntax_for(template.source)
    if syntax is None:
        return
    if usable_syntax(template, tokenizer, "auto") is None:
        log.warning("the chat template writes %s reasoning, but the tokenizer leaves some of its markers out "
                    "of the text: the reasoning stays in the content", syntax.name)
    elif fmt != "none":
        log.info("chat completions return the model's %s reasoning as reasoning_content "
                 "(--reasoning-format %s)", syntax.name, fmt)
