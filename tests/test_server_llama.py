"""llama-server users' habits on a real `moerun serve` (the built-in model): any model name answered by the one
model served (--strict-model-name: 404), and llama-server's /props and /apply-template."""

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
