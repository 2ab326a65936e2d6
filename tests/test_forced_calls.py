"""Forced tool calls (tool_choice required or named): the Lark grammar of each tool-call syntax with the
function's parameter schema (moerun.server.tools) accepts the call as the family's template writes it, and
decoding under it (random logits, masked) always ends in a call the parser reads back and the schema validates."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from moerun.builtin import default_model_path
from moerun.engine.grammar import Grammars
from moerun.loading import load_model
from moerun.server.tools import forced_grammar, parse_request
from moerun.text import Tokenizer
from moerun.text.toolcalls import SYNTAXES, ToolCallParser

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
WRITTEN = {  # the call as each family's template writes it (tests/data/templates)
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    "qwen-xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
                "</parameter>\n</function>\n</tool_call>",
    "glm": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
           "<arg_value>3</arg_value>\n</tool_call>",
    "deepseek": '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}<｜tool▁call▁end｜>',
    "mistral-args": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
}


@pytest.fixture(scope="module")
def grammars():
    loaded = load_model(str(default_model_path()))
    tok = Tokenizer.from_model_file(loaded.file)
    return tok, Grammars(tok, loaded.model.spec.vocab)


def compact(text: str) -> str:  # forced JSON is compact (no optional whitespace)
    return text.replace('": ', '":').replace(', "', ',"')


TEXTUAL = [s for s in SYNTAXES if s.body != "harmony"]  # gpt-oss's calls are read by its reasoning parser


@pytest.mark.parametrize("syntax", TEXTUAL, ids=[s.name for s in TEXTUAL])
def test_the_written_call_is_in_the_grammar(grammars, syntax):
    tok, g = grammars
    c = g.constraint(g.lark(forced_grammar(syntax, parse_request(TOOLS, "required", False))))
    text = WRITTEN[syntax.name]
    text = text if syntax.body == "xml" else compact(text)
    for t in tok.encode(text, add_special=False):
        c.accept(t)
    assert c.matcher.is_accepting()


@pytest.mark.parametrize("syntax", TEXTUAL, ids=[s.name for s in TEXTUAL])
def test_decoding_under_the_grammar_ends_in_a_valid_call(grammars, syntax):
    tok, g = grammars
    grammar = g.lark(forced_grammar(syntax, parse_request(TOOLS, {"type": "function", "function": {
        "name": "get_weather"}}, False)))
    for seed in range(3):
        c, gen, out = g.constraint(grammar), torch.Generator().manual_seed(seed), []
        while not c.done and len(out) < 400:
            logits = torch.randn(g.vocab, generator=gen)
            logits[[i for i in range(g.vocab) if "<" in tok.token_to_piece(i) or '"' in tok.token_to_piece(i)]] += 4
            t = int(c.mask(logits).argmax())  # values end soon: tokens that may close them are favoured
            if t in tok.eos_ids:
                break
            c.accept(t)
            out.append(t)
        parser = ToolCallParser(syntax)
        events = parser.feed(tok.decode(out)) + parser.flush()
        calls = [v for k, v in events if k == "call"]
        assert len(calls) == 1 and calls[0].name == "get_weather", (syntax.name, tok.decode(out))
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)


def test_forced_harmony_calls(tmp_path):
    """gpt-oss (make-model's tiny-gptoss: the o200k/harmony special tokens): the grammar's markers are the
    special tokens; the written call is in it, and decoding under it ends in a call that gpt-oss's reasoning
    parser hands over and the schema validates."""
    from moerun.server.answers import read_calls
    from moerun.text.reasoning import HARMONY, ReasoningParser
    from moerun.tools.make_model import make_model

    loaded = load_model(str(make_model("tiny-gptoss", tmp_path / "gptoss.gguf", progress=False)))
    tok = Tokenizer.from_model_file(loaded.file)
    g = Grammars(tok, loaded.model.spec.vocab)
    harmony = next(s for s in SYNTAXES if s.body == "harmony")
    grammar = g.lark(forced_grammar(harmony, parse_request(TOOLS, "required", False)))
    special = {m: tok.token_to_id(m) for m in ("<|channel|>", "<|constrain|>", "<|message|>", "<|call|>")}
    written = ([special["<|channel|>"]] + tok.encode("commentary to=functions.get_weather ", add_special=False)
               + [special["<|constrain|>"]] + tok.encode("json", add_special=False) + [special["<|message|>"]]
               + tok.encode('{"city":"Paris","days":3}', add_special=False) + [special["<|call|>"]])
    c = g.constraint(grammar)
    for t in written:
        c.accept(t)
    assert c.done
    for seed in range(3):
        c, gen, out = g.constraint(grammar), torch.Generator().manual_seed(seed), []
        while not c.done and len(out) < 300:
            t = int(c.mask(torch.randn(g.vocab, generator=gen)).argmax())
            if t in tok.eos_ids:  # <|call|> ends generation, as in the scheduler
                break
            c.accept(t)
            out.append(t)
        parser = ReasoningParser(HARMONY, "<|start|>assistant", keep=True)
        pieces = parser.feed(tok.decode(out, skip_special=False)) + parser.flush()
        calls = [v for k, v in read_calls(harmony, pieces, True) if k == "call"]
        assert len(calls) == 1 and calls[0].name == "get_weather", tok.decode(out, skip_special=False)
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
