"""moerun.text.reasoning: a chat model's reasoning told apart from its answer, whole and streamed.

Outputs are written as the models write them (gpt-oss's harmony messages, Qwen3's and DeepSeek-R1's
<think> blocks); the expected splits are llama.cpp's (common/chat.cpp, common/parsers/gpt-oss.cpp).
Every case is also streamed cut at every character, in random chunks and token by token through the
tokenizer's incremental decoder: the pieces must add up to the whole split, and no marker, whole or in part,
may reach the content or the reasoning.
"""

from __future__ import annotations

import random
from importlib import resources

import pytest

from moerun.config import ServerConfig
from moerun.text import ChatTemplate
from moerun.text.reasoning import HARMONY, THINK, ReasoningParser, split_reasoning, syntax_for

GEN = "<|start|>assistant"  # what the gpt-oss template's add_generation_prompt adds
GPT_OSS = (resources.files("moerun") / "data" / "templates" / "gpt-oss.jinja").read_text(encoding="utf-8")
QWEN3 = (  # the part of Qwen3's template that matters here: think blocks, enable_thinking
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' and '</think>' in message.content %}"
    "{{- message.content.split('</think>')[-1].lstrip('\\n') }}{%- else %}{{- message.content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")
R1 = ("{% for m in messages %}{{ '<｜' + m.role + '｜>' + m.content }}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
      "{# content.split('</think>') #}")

A, F = "<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"  # harmony headers
PREAMBLE = (f"{A}First.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking...<|end|>"
            f"<|start|>assistant{A} Second.<|end|>{F}Done.")
TOOL_CALL = (f"{A}Use the tool.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary "
             '<|constrain|>json<|message|>{"city": "Paris"}')
LITERAL = f"{A}Write <think> and </think> literally.<|end|>{F}a <|channel b"
# (syntax, prime, output, content, reasoning)
CASES = {
    "harmony": (HARMONY, GEN, f"{A}The user asks 2+2. That is 4; answer briefly.<|end|>{F}2 + 2 = **4**.",
                "2 + 2 = **4**.", "The user asks 2+2. That is 4; answer briefly."),
    "harmony_no_final": (HARMONY, GEN, f"{A}Let me think about <b>this</b>, step 1", "",  # cut by max_tokens
                         "Let me think about <b>this</b>, step 1"),
    "harmony_only_final": (HARMONY, GEN, "<|channel|>final<|message|>Hello! 你好 😀", "Hello! 你好 😀", ""),
    "harmony_preamble_and_two_analyses": (HARMONY, GEN, PREAMBLE, "Checking...Done.", "First. Second."),
    # gpt-oss-20b sometimes writes this (llama.cpp's stray_commentary)
    "harmony_stray_commentary": (HARMONY, GEN, f"<|channel|>commentary to=assistant{A}Hmm.<|end|>{F}Yes.",
                                 "Yes.", "Hmm."),
    # a call nobody offered tools for: dropped, as llama.cpp does
    "harmony_tool_call_dropped": (HARMONY, GEN, TOOL_CALL, "", "Use the tool."),
    "harmony_no_header": (HARMONY, GEN, "Just text, no channels.", "Just text, no channels.", ""),
    "harmony_reasoning_markers_in_text": (HARMONY, GEN, LITERAL, "a <|channel b",
                                          "Write <think> and </think> literally."),
    "think": (THINK, "<|im_start|>assistant\n",
              "<think>\nThe user wants 2+2.\nIt is 4.\n</think>\n\nThe answer is 4.\n",
              "The answer is 4.\n", "The user wants 2+2.\nIt is 4."),
    "think_no_reasoning": (THINK, "<|im_start|>assistant\n", "\n\nPlain answer </think> stays.",
                           "Plain answer </think> stays.", ""),
    "think_late_tag_is_content": (THINK, "", "Answer first. <think>not reasoning</think>",
                                  "Answer first. <think>not reasoning</think>", ""),
    "think_empty": (THINK, "", "<think>\n\n</think>\n\nHi", "Hi", ""),
    "think_unfinished": (THINK, "", "<think>\nStill going  \n", "", "Still going"),
    "think_opened_by_the_prompt": (THINK, "<｜Assistant｜><think>\n", "Reason here.\n</think>\n\nAnswer.",
                                   "Answer.", "Reason here."),
    "think_closed_by_the_prompt": (THINK, "<|im_start|>assistant\n<think>\n\n</think>\n\n", "Direct <think>x",
                                   "Direct <think>x", ""),
}


def _stream(syntax, prime, chunks):
    parser, pieces = ReasoningParser(syntax, prime), []
    for c in chunks:
        pieces += parser.feed(c)
    return pieces + parser.flush()


def _joined(pieces):
    return tuple("".join(t for k, t in pieces if k == kind) for kind in ("content", "reasoning"))


@pytest.mark.parametrize("name", list(CASES))
def test_split_whole_and_streamed(name):
    syntax, prime, out, content, reasoning = CASES[name]
    assert split_reasoning(out, syntax, prime) == (content, reasoning)
    rng = random.Random(name)
    cuts = [list(out)]  # every character alone: every marker split at every point
    for _ in range(20):
        at = sorted(rng.sample(range(1, len(out)), min(len(out) - 1, rng.randint(1, 6))))
        cuts.append([out[a:b] for a, b in zip([0, *at], [*at, len(out)])])
    for chunks in cuts:
        pieces = _stream(syntax, prime, chunks)
        assert _joined(pieces) == (content, reasoning), chunks
        assert all(text and kind in ("content", "reasoning") for kind, text in pieces)
        for _, text in pieces:  # no whole marker in a piece (a part of one would break the sums above)
            assert not any(m in text for m in syntax.markers if m not in content + reasoning)


def test_streamed_pieces_come_in_order():
    pieces = _stream(HARMONY, GEN, list(CASES["harmony_preamble_and_two_analyses"][2]))
    kinds = [k for k, _ in pieces]
    assert [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k] == ["reasoning", "content",
                                                                                "reasoning", "content"]


def test_held_back_text_is_released_at_the_end():
    parser = ReasoningParser(HARMONY, GEN)
    assert parser.feed("<|channel|>final<|message|>x <|") == [("content", "x ")]
    assert parser.flush() == [("content", "<|")]
    parser = ReasoningParser(THINK)
    assert parser.feed("<thi") == [] and parser.flush() == [("content", "<thi")]


def test_a_long_headerless_answer_streams():
    """Text that never opens a harmony message comes out as content once it is too long to be a header."""
    parser = ReasoningParser(HARMONY, GEN)
    assert parser.feed("word " * 20) == []
    out = parser.feed("word " * 60)
    assert out and out[0][0] == "content" and "".join(t for _, t in out + parser.flush()) == "word " * 80


def test_harmony_through_the_tokenizer(tmp_path):
    """gpt-oss's markers are control tokens: the decoder writes them out, and the split of a token-by-token
    stream is the whole text's."""
    from moerun.text import Tokenizer
    from moerun.tools.tokenizer import build_tokenizer, gguf_tokenizer_metadata

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOERUN_CACHE", str(tmp_path))
        tok = Tokenizer.from_gguf(gguf_tokenizer_metadata(build_tokenizer(1024, "gptoss")))
    syntax, prime, out, content, reasoning = CASES["harmony"]
    ids = tok.encode(out + "<|return|>", add_special=False)
    assert ids[-1] in tok.eos_ids
    stream = tok.incremental_decoder()
    chunks = [stream.step(i) for i in ids[:-1]] + [stream.flush()]
    assert "<|channel|>" in chunks and "<|end|>" in chunks  # markers arrive whole, one token each
    assert _joined(_stream(syntax, prime, chunks)) == (content, reasoning)


def test_syntax_for_templates_and_formats():
    assert syntax_for(GPT_OSS) is HARMONY and syntax_for(GPT_OSS, "deepseek") is HARMONY
    assert syntax_for(QWEN3) is THINK and syntax_for(R1) is THINK
    assert syntax_for(GPT_OSS, "none") is None and syntax_for(None) is None
    assert syntax_for("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    with pytest.raises(ValueError, match="unknown reasoning format 'deepseek-legacy'"):
        syntax_for(QWEN3, "deepseek-legacy")
    with pytest.raises(ValueError, match="reasoning_format must be one of none, auto, deepseek, got 'on'"):
        ServerConfig(model_names=("m",), reasoning_format="on")


def test_generation_prompts_prime_the_parser():
    chat = [{"role": "user", "content": "2+2?"}]
    assert ChatTemplate(GPT_OSS).generation_prompt(chat) == GEN
    qwen = ChatTemplate(QWEN3)
    assert qwen.generation_prompt(chat) == "<|im_start|>assistant\n"
    off = qwen.generation_prompt(chat, enable_thinking=False)
    assert off == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert split_reasoning("Sure.", THINK, off) == ("Sure.", "")
    r1 = ChatTemplate(R1).generation_prompt(chat)
    assert r1 == "<｜Assistant｜><think>\n"
    assert split_reasoning("4, easily.\n</think>\n\nFour.", THINK, r1) == ("Four.", "4, easily.")
    rejecting = ChatTemplate("{% if not add_generation_prompt %}{{ raise_exception('no') }}{% endif %}x")
    assert rejecting.generation_prompt(chat) == ""
