"""Speculative decoding on a real `moerun serve` (issue 20, item 5): prompt lookup and a draft model keep the
greedy and the seeded text, streamed or not, with parallel slots; timings carry llama-server's draft_n and
draft_n_accepted; a request's "speculative.*" settings apply to it alone, and bad ones are a 400."""

import threading

import openai
import pytest
from test_server import KEY, MODEL, Server

from moerun.builtin import default_model_path

CODE = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n"
PROMPTS = [CODE, "import os\nimport sys\nimport os\n", "for i in range(10):\n    print(i)\nfor i in range(",
           "class A:\n    pass\n\n\nclass B:\n    pass\n\n\nclass"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    plain = Server(tmp_path_factory.mktemp("serve-plain"))
    lookup = Server(tmp_path_factory.mktemp("serve-lookup"), "--lookup-ngram", "3")
    draft = Server(tmp_path_factory.mktemp("serve-draft"), "-md", str(default_model_path()), "--draft-p-min", "0")
    yield plain, lookup, draft
    for s in (plain, lookup, draft):
        s.stop()


def complete(server, prompt, **kw):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, **kw}
    r = server.http("POST", "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_drafts_keep_the_text_and_report_their_counts(servers):
    plain, lookup, draft = servers
    for prompt in PROMPTS:
        ref = complete(plain, prompt)
        assert "draft_n" not in ref["timings"]
        for s in (lookup, draft):
            got = complete(s, prompt)
            assert got["choices"][0]["text"] == ref["choices"][0]["text"]
            t = got["timings"]
            assert 0 <= t["draft_n_accepted"] <= t["draft_n"]
        assert t["draft_n"] > 0 and t["draft_n_accepted"] == t["draft_n"]  # the model as its own draft
    sampled = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 11}
    ref = complete(plain, CODE, **sampled)["choices"][0]["text"]
    assert all(complete(s, CODE, **sampled)["choices"][0]["text"] == ref for s in (lookup, draft))


def test_streamed_equals_whole_and_parallel_equals_alone(servers):
    plain, _, draft = servers
    c = openai.OpenAI(base_url=draft.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    whole = {p: complete(plain, p)["choices"][0]["text"] for p in PROMPTS}
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt=CODE, max_tokens=24, temperature=0, stream=True))
    assert streamed == whole[CODE]
    got, threads = {}, []
    for p in PROMPTS:  # decoded together: each slot drafts on its own draft sequence
        t = threading.Thread(target=lambda p=p: got.__setitem__(p, complete(draft, p)["choices"][0]["text"]))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    assert got == whole


def test_request_settings_apply_to_the_request(servers):
    _, lookup, _ = servers
    off = complete(lookup, CODE, **{"speculative.n_max": 0})
    assert off["timings"].get("draft_n", 0) == 0  # drafting off for this request
    one = complete(lookup, CODE, **{"speculative.n_max": 1})
    assert one["timings"]["draft_n"] <= 24
    for bad in ({"speculative.p_min": 2}, {"speculative.n_max": -1}, {"speculative.n_min": "x"}):
        r = lookup.http("POST", "/v1/completions", {"model": MODEL, "prompt": CODE, "max_tokens": 4, **bad})
        assert r.status_code == 400, (bad, r.text)
        err = r.json()["error"]
        assert "draft" in err["message"] and err["param"] == next(iter(bad))
