"""Reasoning in the agent APIs: Responses' reasoning items from a reasoning model's output, whole and streamed,
through the same reasoning parsers as chat completions (the scripted models of test_server_reasoning)."""

from __future__ import annotations

from test_server_reasoning import (  # noqa: F401
    ASK,
    HARMONY_OUT,
    THINK_OUT,
    ScriptedSampler,
    _script,
    harmony,
    harmony_model,
    think,
)


def _items(response) -> list[tuple[str, str]]:
    out = []
    for item in response.output:
        if item.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in item.content)))
        elif item.type == "message":
            out.append(("message", "".join(c.text for c in item.content)))
    return out


def _responses(client, monkeypatch, tok, script: str, end: str, **kw):
    """The whole response and the streamed one's events, for the same scripted output."""
    ids = _script(monkeypatch, tok, script, end)
    whole = client.responses.create(model="tiny", **kw)
    _script(monkeypatch, tok, script, end)
    with client.responses.stream(model="tiny", **kw) as s:
        events = list(s)
    return ids, whole, events


def test_harmony_reasoning_is_a_reasoning_item(harmony, monkeypatch):  # noqa: F811 (a fixture)
    client, tok = harmony
    ids, r, events = _responses(client, monkeypatch, tok, HARMONY_OUT, "<|return|>", input=ASK[1:],
                                instructions=ASK[0]["content"], max_output_tokens=200, reasoning={"effort": "high"})
    assert _items(r) == [("reasoning", "The user asks 2+2. Simple: 4. Answer briefly."),
                         ("message", "2 + 2 = **4**.")]
    assert r.output_text == "2 + 2 = **4**." and r.usage.output_tokens == len(ids)
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < len(ids)
    prompt = tok.decode(ScriptedSampler.prompts[0], skip_special=False)
    assert "Reasoning: high" in prompt and "Be brief." in prompt  # reasoning.effort and instructions reach it
    final = events[-1].response
    assert events[-1].type == "response.completed" and _items(final) == _items(r)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == _items(r)[0][1]
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")


def test_think_reasoning_is_a_reasoning_item(think, monkeypatch):  # noqa: F811 (a fixture)
    """A <think> template on a server started with --reasoning-format none: the Responses API still tells the
    reasoning apart (its items have a place for it)."""
    client, tok = think
    _, r, events = _responses(client, monkeypatch, tok, THINK_OUT, "<|im_end|>", input="What is 2+2?",
                              max_output_tokens=100)
    assert _items(r) == [("reasoning", "The user wants 2+2.\nThat is 4."), ("message", "The answer is 4.")]
    assert _items(events[-1].response) == _items(r)
