"""n > 1 on a real server through the `openai` client: n choices sampled from one prefill (the others take the
first's prompt blocks), each choice the answer of a single request with its seed, streamed and whole alike
(issue 18, item 3)."""

from test_server import MODEL, server_fixtures

PROMPT = "def fibonacci(n):\n    # return the n-th Fibonacci number, iteratively, with a docstring\n" * 3


server, client = server_fixtures("serve-choices", timeout=120)


def test_n_choices_are_single_requests_of_their_seeds_from_one_prefill(server, client):
    before = server.metrics()["llamacpp:prompt_tokens_total"]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=40, n=3)
    ran = server.metrics()["llamacpp:prompt_tokens_total"] - before
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 36 and ran < 1.5 * r.usage.prompt_tokens  # prefilled once, not 3 times
    singles = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=40 + i)
               .choices[0].text for i in range(3)]
    assert [c.text for c in r.choices] == singles and len(set(singles)) > 1


def test_streamed_choices_equal_whole_ones(client):
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 10,
          "temperature": 1.0, "seed": 5, "n": 2}
    whole = client.chat.completions.create(**kw)
    texts, reasons = {0: "", 1: ""}, {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert [texts[i] for i in (0, 1)] == [c.message.content for c in whole.choices]
    assert set(reasons) == {0, 1}


def test_greedy_choices_are_equal(client):
    r = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=8, temperature=0, n=4)
    assert len({c.text for c in r.choices}) == 1 and len(r.choices) == 4
