"""reasoning_content from `moerun serve`, through the `openai` client, and `moerun chat`'s display of it: a
tiny model with gpt-oss's tokenizer and template (harmony channels), and one with a Qwen3-style template
(<think>), whose output is forced.

The forcing is the only thing not real: the scheduler's sampler runs as usual on the model's logits and then
its pick is replaced by the next token of a script (what a gpt-oss or Qwen3 model writes). Everything after it
is the server's own path: end-of-generation tokens, the incremental decoder writing harmony's markers, stop
strings, the chat route's reasoning parser, whole responses and SSE chunks.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from typing import ClassVar

import openai
import pytest
import torch
import uvicorn
from family_checks import free_port

from moerun.config import RuntimeConfig, ServerConfig
from moerun.engine import scheduler
from moerun.engine.sampler import Sampler
from moerun.runtime import build as build_runtime
from moerun.server.app import create_app
from moerun.text import ChatTemplate, Tokenizer
from moerun.tools.make_model import make_model
from moerun.tools.presets import preset
from moerun.tools.tokenizer import build_tokenizer, special_ids, write_hf_tokenizer

VOCAB = 1024
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
HARMONY_OUT = ("<|channel|>analysis<|message|>The user asks 2+2. Simple: 4. Answer briefly.<|end|>"
               "<|start|>assistant<|channel|>final<|message|>2 + 2 = **4**.")
THINK_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}{# a reply's content.split('</think>') #}")
THINK_OUT = "<think>\nThe user wants 2+2.\nThat is 4.\n</think>\n\nThe answer is 4."


class ScriptedSampler(Sampler):
    """The real sampler, whose pick is replaced by the script's next token; it records the prompt it saw."""

    script: ClassVar[tuple[int, ...]] = ()
    prompts: ClassVar[list[list[int]]] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._left, self._first = iter(type(self).script), True

    def sample(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        picked = super().sample(logits, history)
        if self._first:  # the history of the first pick is the prompt
            type(self).prompts.append(history.tolist())
            self._first = False
        return torch.full_like(picked, next(self._left))


def _model(tmp_path, family_style: str | None, template: str | None = None):
    """tiny-qwen3moe's weights with a tokenizer in the style of `family_style`'s models (and `template`)."""
    folder = tmp_path / "model"
    make_model(preset("tiny-qwen3moe", vocab=VOCAB), folder, fmt="safetensors", progress=False)
    tok = build_tokenizer(VOCAB, family_style)
    write_hf_tokenizer(tok, folder)
    ids = special_ids(tok)
    gen = {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"]}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    if template is not None:
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    return folder


@contextmanager
def serving(folder, **cfg):
    app = create_app(ServerConfig(model_names=("tiny",), parallel=1, log_interval=0, **cfg),
                     load=lambda: build_runtime(RuntimeConfig(model=str(folder), threads=1, ctx_size=1024)))
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    deadline = time.time() + 120
    while app.state.server.ready is None and time.time() < deadline:
        assert app.state.server.load_error is None, app.state.server.load_error
        time.sleep(0.05)
    try:
        yield client
    finally:
        uv.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("harmony")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOERUN_CACHE", str(tmp / "cache"))
        folder = _model(tmp, "gptoss")
    return folder, Tokenizer.from_hf_dir(folder)


@pytest.fixture(scope="module")
def harmony(harmony_model):
    folder, tok = harmony_model
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scheduler, "Sampler", ScriptedSampler)
        with serving(folder) as client:
            yield client, tok


@pytest.fixture(scope="module")
def think(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("think")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOERUN_CACHE", str(tmp / "cache"))
        folder = _model(tmp, None, THINK_TEMPLATE)
    tok = Tokenizer.from_hf_dir(folder)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scheduler, "Sampler", ScriptedSampler)
        with serving(folder, reasoning_format="none") as client:
            yield client, tok


def _script(monkeypatch, tok, text: str, end: str) -> list[int]:
    ids = tok.encode(text, add_special=False)
    monkeypatch.setattr(ScriptedSampler, "script", (*ids, tok.token_to_id(end)))
    monkeypatch.setattr(ScriptedSampler, "prompts", [])
    return ids


def _stream(client, **kw):
    """The stream's (field, text) deltas, its finish reason and usage."""
    deltas, finish, use = [], None, None
    for chunk in client.chat.completions.create(model="tiny", stream=True, **kw):
        if chunk.usage is not None:
            use = chunk.usage
        for choice in chunk.choices:
            d = choice.delta
            extra = d.model_extra or {}
            fields = [(f, v) for f, v in (("content", d.content), ("reasoning_content",
                                                                   extra.get("reasoning_content"))) if v]
            assert len(fields) <= 1  # a delta carries one field
            deltas += fields
            finish = choice.finish_reason or finish
    return deltas, finish, use


def _join(deltas, field):
    return "".join(t for f, t in deltas if f == field)


def test_harmony_reasoning_content_whole_and_streamed(harmony, monkeypatch):
    client, tok = harmony
    ids = _script(monkeypatch, tok, HARMONY_OUT, "<|return|>")
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=200, reasoning_effort="high")
    msg = r.choices[0].message
    assert msg.content == "2 + 2 = **4**."
    assert msg.model_extra["reasoning_content"] == "The user asks 2+2. Simple: 4. Answer briefly."
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == len(ids)
    prompt = tok.decode(ScriptedSampler.prompts[0], skip_special=False)
    want = ChatTemplate.for_tokenizer(tok).render(ASK, add_generation_prompt=True, reasoning_effort="high")
    assert prompt == want and "Reasoning: high" in prompt and prompt.endswith("<|start|>assistant")

    deltas, finish, _ = _stream(client, messages=ASK, max_tokens=200, reasoning_effort="high")
    assert (_join(deltas, "content"), _join(deltas, "reasoning_content"), finish) == \
        (msg.content, msg.model_extra["reasoning_content"], "stop")
    fields = [f for f, _ in deltas]
    assert fields.count("reasoning_content") > 3 and fields.count("content") > 3  # token by token
    assert fields == sorted(fields, key=lambda f: f == "content")  # the reasoning, then the answer
    assert not any("<|" in t or "|>" in t for _, t in deltas)


def test_harmony_cut_while_reasoning_and_format_none(harmony, monkeypatch):
    client, tok = harmony
    _script(monkeypatch, tok, HARMONY_OUT, "<|return|>")
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12)
    cut = tok.decode(tok.encode(HARMONY_OUT, add_special=False)[:12])
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == ""
    reasoning = r.choices[0].message.model_extra["reasoning_content"]
    assert reasoning == cut.removeprefix("<|channel|>analysis<|message|>")
    deltas, finish, _ = _stream(client, messages=ASK, max_tokens=12)
    assert _join(deltas, "reasoning_content") == reasoning
    assert _join(deltas, "content") == "" and finish == "length"

    raw = client.chat.completions.create(model="tiny", messages=ASK, extra_body={"reasoning_format": "none"})
    assert raw.choices[0].message.content == HARMONY_OUT  # the markers as the model wrote them
    assert "reasoning_content" not in (raw.choices[0].message.model_extra or {})
    deltas, _, _ = _stream(client, messages=ASK, extra_body={"reasoning_format": "none"})
    assert _join(deltas, "content") == HARMONY_OUT and _join(deltas, "reasoning_content") == ""


def test_harmony_only_final_and_a_bad_format(harmony, monkeypatch):
    client, tok = harmony
    _script(monkeypatch, tok, "<|channel|>final<|message|>Just 4.", "<|return|>")
    r = client.chat.completions.create(model="tiny", messages=ASK)
    msg = r.choices[0].message
    assert msg.content == "Just 4." and "reasoning_content" not in msg.model_extra
    deltas, _, _ = _stream(client, messages=ASK)
    assert deltas and all(f == "content" for f, _ in deltas) and _join(deltas, "content") == "Just 4."
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ASK, extra_body={"reasoning_format": "bogus"})
    assert "reasoning_format 'bogus' is not one of none, auto, deepseek" in str(e.value)
    assert e.value.body["param"] == "reasoning_format"


def test_think_reasoning_per_request_over_the_server_default(think, monkeypatch):
    """The server runs with --reasoning-format none; a request asks for deepseek. <think> is plain text in
    this vocabulary, so its tags reach the parser in pieces."""
    client, tok = think
    ids = _script(monkeypatch, tok, THINK_OUT, "<|im_end|>")
    assert len(tok.encode("<think>", add_special=False)) > 1
    raw = client.chat.completions.create(model="tiny", messages=ASK)
    assert raw.choices[0].message.content == THINK_OUT
    body = {"reasoning_format": "deepseek"}
    r = client.chat.completions.create(model="tiny", messages=ASK, extra_body=body)
    msg = r.choices[0].message
    assert (msg.content, msg.model_extra["reasoning_content"]) == \
        ("The answer is 4.", "The user wants 2+2.\nThat is 4.")
    assert r.usage.completion_tokens == len(ids)
    deltas, finish, _ = _stream(client, messages=ASK, extra_body=body, stream_options={"include_usage": True})
    assert (_join(deltas, "content"), _join(deltas, "reasoning_content"), finish) == \
        (msg.content, msg.model_extra["reasoning_content"], "stop")
    assert not any("<" in t or ">" in t for _, t in deltas)


def test_think_closed_by_the_template(think, monkeypatch):
    """enable_thinking=False: the generation prompt closes the think block, so what follows is the answer."""
    client, tok = think
    _script(monkeypatch, tok, "Four.", "<|im_end|>")
    r = client.chat.completions.create(model="tiny", messages=ASK, extra_body={
        "reasoning_format": "auto", "chat_template_kwargs": {"enable_thinking": False}})
    msg = r.choices[0].message
    assert msg.content == "Four." and "reasoning_content" not in msg.model_extra
    assert tok.decode(ScriptedSampler.prompts[0], skip_special=False).endswith("<think>\n\n</think>\n\n")


def test_chat_shows_reasoning_apart_and_keeps_only_the_answer(harmony_model, monkeypatch):
    """`moerun chat`: the answer on stdout, the reasoning on stderr (or hidden, or all on stdout as written);
    the next turn's prompt holds the answer as a final message and no reasoning (the template drops past
    turns' reasoning)."""
    from click.testing import CliRunner

    from moerun.cli import main
    from moerun.engine import engine

    folder, tok = harmony_model
    monkeypatch.setattr(engine, "Sampler", ScriptedSampler)

    def chat(*flags):
        _script(monkeypatch, tok, HARMONY_OUT, "<|return|>")
        r = CliRunner().invoke(main, ["chat", "-m", str(folder), "-n", "100", "-t", "1", *flags],
                               input="What is 2+2?\nAnd 3+3?\n", catch_exceptions=False)
        assert r.exit_code == 0, r.output
        return r

    r = chat()
    assert r.stdout.count("2 + 2 = **4**.") == 2 and "user asks" not in r.stdout and "<|" not in r.stdout
    assert r.stderr.count("The user asks 2+2. Simple: 4. Answer briefly.\n") == 2
    second = tok.decode(ScriptedSampler.prompts[1], skip_special=False)
    assert "<|start|>assistant<|channel|>final<|message|>2 + 2 = **4**.<|end|><|start|>user<|message|>And 3+3?" \
        in second and "The user asks" not in second
    hidden = chat("--hide-reasoning")
    assert hidden.stdout == r.stdout and "The user asks" not in hidden.stderr
    raw = chat("--reasoning-format", "none")  # shown as written; kept apart for the template all the same
    assert raw.stdout.count(HARMONY_OUT) == 2 and "The user asks" not in raw.stderr
    assert tok.decode(ScriptedSampler.prompts[1], skip_special=False) == second
