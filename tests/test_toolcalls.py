"""moerun.text.toolcalls on the tool-call formats as the families' published chat templates render them
(tests/data/templates): several calls, text before a call, every split of the text into stream chunks, and
malformed calls (reported, their text given back)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from moerun.text.chat import ChatTemplate
from moerun.text.toolcalls import ToolCallParser, syntax_for

TEMPLATES = Path(__file__).parent / "data" / "templates"
CASES = {  # template -> the syntax it is read as
    "Qwen-Qwen3-0.6B.jinja": "hermes", "Qwen3.5-4B.jinja": "qwen-xml",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": "mistral", "Mistral-Small-3.2-24B-Instruct-2506.jinja": "mistral-args",
    "deepseek-ai-DeepSeek-V3.1.jinja": "deepseek", "GLM-4.6.jinja": "glm",
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}},
         {"type": "function", "function": {"name": "search", "parameters": {
             "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "moe runtimes"})]


def rendered_calls(name: str, calls, content: str | None) -> str:
    """What the template writes for an assistant message with these tool calls: the part after the prompt."""
    template = ChatTemplate((TEMPLATES / name).read_text(), special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    ids = [f"call{i:06d}" for i in range(len(calls))]  # Mistral's templates want 9-character ids
    tool_calls = [{"id": ids[i][:9], "type": "function", "function": {"name": n, "arguments": a}}
                  for i, (n, a) in enumerate(calls)]
    user = [{"role": "user", "content": "What is the weather in Paris?"}]
    prompt = template.render(user, add_generation_prompt=True, tools=TOOLS)
    full = template.render(user + [{"role": "assistant", "content": content or "", "tool_calls": tool_calls}],
                           tools=TOOLS)
    if not full.startswith(prompt):  # templates that render the generation prompt differently from a turn
        prompt = prompt[:next(i for i, (a, b) in enumerate(zip(prompt, full)) if a != b)]
    return full[len(prompt):].removesuffix("</s>")  # generation ends at EOS, which is no text


def parse(syntax, text: str, cuts: list[int]) -> tuple[str, list, list]:
    parser, events = ToolCallParser(syntax), []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        events += parser.feed(text[a:b])
    events += parser.flush()
    content = "".join(v for k, v in events if k == "content")
    return content, [v for k, v in events if k == "call"], [v for k, v in events if k == "error"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_template_is_read_as_its_syntax(name):
    assert syntax_for((TEMPLATES / name).read_text()).name == CASES[name]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("text_before", [None, "Let me look that up."])
def test_rendered_calls_parse_back_in_any_chunks(name, text_before):
    syntax = syntax_for((TEMPLATES / name).read_text())
    text = rendered_calls(name, CALLS, text_before)
    for cut in [[]] + [sorted(random.Random(seed).sample(range(1, len(text)), 7)) for seed in range(6)] + \
               [list(range(1, len(text)))]:
        content, calls, errors = parse(syntax, text, cut)
        assert errors == [], (name, text)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS, (name, text, cut)
        if text_before and text_before in text:  # Mistral Small 3.2's template leaves a call's text out
            assert text_before in content
        for marker in syntax.markers:
            assert marker not in content


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_calls_are_reported_and_given_back(name):
    syntax = syntax_for((TEMPLATES / name).read_text())
    broken = {"hermes": '<tool_call>\n{"name": "search", "arguments": {"query": "x"\n</tool_call>',
              "qwen-xml": "<tool_call>\nno function here\n</tool_call>",
              "mistral": '[TOOL_CALLS][{"name": "search", "arguments": {"query": ',
              "mistral-args": '[TOOL_CALLS]search[ARGS]{"query": "x",}',
              "deepseek": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{query: x}<｜tool▁call▁end｜>",
              "glm": "<tool_call>search\n<arg_key>query</arg_key>\nstray text\n</tool_call>"}[syntax.name]
    content, calls, errors = parse(syntax, "Sure. " + broken, [3, 9])
    assert calls == [] and len(errors) == 1 and content.startswith("Sure. ")


def test_a_call_never_closed_is_an_error_and_content():
    syntax = syntax_for((TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text())
    content, calls, errors = parse(syntax, 'ok <tool_call>\n{"name": "search"', [])
    assert calls == [] and "never closed" in errors[0] and content == 'ok <tool_call>\n{"name": "search"'


def test_plain_text_and_lookalike_markers_stay_content():
    syntax = syntax_for((TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text())
    text = "a <tool_ca b <tool> c"
    content, calls, errors = parse(syntax, text, [4, 11])
    assert content == text and calls == errors == []


@pytest.mark.parametrize("text", [
    # what gpt-oss writes after its generation prompt "<|start|>assistant": reasoning, then the call
    ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}'),
    # the recipient before the channel, as the published template renders a call in the history
    ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", "days": 3}',
])
def test_harmony_calls_come_from_the_reasoning_parser(text):
    """gpt-oss's calls: its reasoning parser (keep=True) hands over the message to functions.NAME, which
    HarmonyCalls reads; in any split into chunks, the reasoning stays reasoning, no marker shows."""
    from moerun.server.answers import read_calls
    from moerun.text.reasoning import HARMONY, ReasoningParser

    template = (Path(__file__).parents[1] / "moerun" / "data" / "templates" / "gpt-oss.jinja").read_text()
    syntax = syntax_for(template)
    assert syntax.name == "harmony"
    for cut in [[]] + [sorted(random.Random(seed).sample(range(1, len(text)), 9)) for seed in range(5)]:
        parser, pieces = ReasoningParser(HARMONY, "<|start|>assistant", keep=True), []
        for a, b in zip([0, *cut], [*cut, len(text)]):
            pieces += parser.feed(text[a:b])
        events = read_calls(syntax, pieces + parser.flush(), True)
        calls = [v for k, v in events if k == "call"]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [CALLS[0]], (text, cut)
        assert "".join(v for k, v in events if k == "content") == ""
        assert "Need the weather." in "".join(v for k, v in events if k == "reasoning") or "analysis" not in text
