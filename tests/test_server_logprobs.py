"""logprobs / top_logprobs on a real `moerun serve` (the built-in model) through the `openai` client: chat and
completions, whole and streamed, greedy and sampled (issue 18, item 3)."""

import math

import openai
import pytest
from test_server import KEY, MODEL, Server

MESSAGES = [{"role": "user", "content": "Write a Python function that adds two numbers."}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("serve-logprobs"))
    yield openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    server.stop()


def chat_entries(client, stream: bool, **kw):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, logprobs=True,
                                       stream=stream, **kw)
    if not stream:
        return r.choices[0].message.content, r.choices[0].logprobs.content
    text, entries = [], []
    for chunk in r:
        for c in chunk.choices:
            text.append(c.delta.content or "")
            if c.logprobs is not None and c.logprobs.content:
                entries += c.logprobs.content
    return "".join(text), entries


def test_chat_top_logprobs_are_sorted_and_greedy_takes_the_top(client):
    text, entries = chat_entries(client, False, temperature=0, top_logprobs=5)
    assert len(entries) == 16
    for e in entries:
        lps = [t.logprob for t in e.top_logprobs]
        assert len(lps) == 5 and lps == sorted(lps, reverse=True) and lps[0] <= 0
        assert e.token == e.top_logprobs[0].token and e.logprob == pytest.approx(lps[0], abs=1e-6)
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
        assert sum(math.exp(x) for x in lps) <= 1 + 1e-5
    assert "".join(e.token for e in entries) == text


def test_chat_stream_carries_the_same_entries(client):
    whole_text, whole = chat_entries(client, False, temperature=0, top_logprobs=2)
    text, streamed = chat_entries(client, True, temperature=0, top_logprobs=2)
    assert text == whole_text
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, [t.token for t in e.top_logprobs]) for e in whole]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-4)


def test_sampled_tokens_report_their_own_logprob(client):
    """At temperature 1 the chosen token need not be the top one; its log probability is the model's (not the
    sampler's), so it is at most the top alternative's, and top_logprobs 0 gives none."""
    _, entries = chat_entries(client, False, temperature=1.0, seed=7, top_logprobs=0)
    assert len(entries) == 16 and all(e.top_logprobs == [] and e.logprob <= 0 for e in entries)
    _, with_top = chat_entries(client, False, temperature=1.0, seed=7, top_logprobs=3)
    assert [e.token for e in with_top] == [e.token for e in entries]  # same seed, same tokens
    assert all(e.logprob <= e.top_logprobs[0].logprob + 1e-6 for e in with_top)


def test_completion_logprobs_whole_and_streamed(client):
    r = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=12, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    for tok, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(x, abs=1e-6) and tok in top
    chunks = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=12, temperature=0,
                                       logprobs=3, stream=True)
    tokens, values, offsets = [], [], []
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            tokens += c.choices[0].logprobs.tokens
            values += c.choices[0].logprobs.token_logprobs
            offsets += c.choices[0].logprobs.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset
    assert values == pytest.approx(lp.token_logprobs, abs=1e-4)  # the second request reuses the cached prompt
