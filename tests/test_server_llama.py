"""llama-server users' habits on a real `moerun serve` (the built-in model): any model name answered by the one
model served (--strict-model-name: 404), and llama-server's /props, /apply-template and /completion."""

import json

import pytest
from test_server import ALIAS, CTX, MODEL, PARALLEL, server_fixtures

server, client = server_fixtures("serve-llama")


def test_any_model_name_is_answered_by_the_served_model(server, client):
    """As llama-server: clients send their own default names (gpt-4o-mini); the one model served answers, under
    its own name, and says so once in the log."""
    r = client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, temperature=0)
    assert r.model == MODEL and r.choices[0].message.content is not None
    assert client.completions.create(model="llama", prompt="x", max_tokens=2).model == MODEL


def test_strict_model_name_refuses_another_name():
    from moerun.config import ServerConfig
    from moerun.server.errors import APIError
    from moerun.server.state import Server as State

    lenient = State(ServerConfig(model_names=(MODEL, ALIAS)), load=lambda: None)
    assert lenient.check_model("gpt-4") == MODEL and lenient.check_model(ALIAS) == MODEL
    strict = State(ServerConfig(model_names=(MODEL, ALIAS), strict_model_name=True), load=lambda: None)
    assert strict.check_model(ALIAS) == MODEL and strict.check_model(None) == MODEL
    with pytest.raises(APIError) as e:
        strict.check_model("gpt-4")
    assert e.value.status == 404 and "gpt-4" in str(e.value)


def test_llama_server_props_and_apply_template(server):
    """llama-server's /props and /apply-template: the settings the server runs with, and the prompt text the chat
    template makes, which is what /tokenize of the same messages reads."""
    props = server.http("GET", "/props").json()
    assert props["total_slots"] == PARALLEL and props["n_ctx"] == CTX == props["default_generation_settings"]["n_ctx"]
    assert props["model_alias"] == MODEL and props["model_path"].endswith(MODEL)
    assert "<|im_start|>" in props["chat_template"] and props["default_generation_settings"]["params"]["top_k"] == 40
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a prime"}]
    r = server.http("POST", "/apply-template", {"messages": messages})
    prompt = r.json()["prompt"]
    assert r.status_code == 200 and "be brief" in prompt and "name a prime" in prompt
    assert prompt.rstrip().endswith("<|im_start|>assistant")
    by_messages = server.http("POST", "/tokenize", {"messages": messages}).json()["tokens"]
    by_text = server.http("POST", "/tokenize", {"content": prompt, "add_special": False}).json()["tokens"]
    assert by_messages == by_text
    bad = server.http("POST", "/apply-template", {"messages": "hi"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def _native_stream(server, body):
    r = server.http("POST", "/completion", {**body, "stream": True})
    assert r.status_code == 200 and "[DONE]" not in r.text
    return [json.loads(line[len("data: "):]) for line in r.text.split("\n\n") if line.startswith("data: ")]


def test_llama_server_completion_whole_and_streamed(server):
    """llama-server's /completion: n_predict, stop_type "limit" / "word" (with the stopping word) / "eos", the
    prompt's cached tokens on a repeat, and the stream's pieces adding up to the whole content."""
    body = {"prompt": "def main():\n    ", "n_predict": 12, "temperature": 0}
    whole = server.http("POST", "/completion", body).json()
    assert whole["stop"] is True and whole["stop_type"] == "limit" and whole["tokens_predicted"] == 12
    assert whole["tokens_evaluated"] > 0 and whole["content"] and whole["timings"]["predicted_n"] == 12
    events = _native_stream(server, body)
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["tokens_cached"] > 0  # the same prompt again: its blocks were kept
    word = whole["content"].strip()[:2]
    stopped = server.http("POST", "/completion", {**body, "stop": [word]}).json()
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
    assert stopped["content"] == whole["content"][:whole["content"].index(word)]
    assert _native_stream(server, {**body, "stop": [word]})[-1]["stopping_word"] == word


def test_llama_server_completion_grammar_and_bad_input(server):
    """A GBNF grammar (llama.cpp's) and a json_schema constrain /completion; what cannot be enforced is a 400."""
    for seed in range(3):
        r = server.http("POST", "/completion", {"prompt": "x = ", "n_predict": 8, "seed": seed, "temperature": 1,
                                                "grammar": 'root ::= ("yes" | "no") "!"'}).json()
        assert r["content"] in ("yes!", "no!") and r["stop_type"] == "eos"
    schema = {"type": "object", "required": ["n"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    r = server.http("POST", "/completion", {"prompt": "x = ", "n_predict": 30, "json_schema": schema}).json()
    assert json.loads(r["content"])["n"] in range(10)
    for body, param in (({"grammar": "root ::= ("}, "grammar"), ({"n_probs": 3}, "n_probs"),
                        ({"grammar": 'root ::= "a"', "json_schema": {}}, "grammar"), ({"prompt": ""}, "prompt")):
        r = server.http("POST", "/completion", {"prompt": "x", "n_predict": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
