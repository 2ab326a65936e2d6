"""Replicas behind an existing router (issue 41): two `moerun serve` replicas of the built-in model (`-t 1`, loopback
ports) and vllm-router in front (PyPI's, in the test extra; the router's tests are skipped with a note where it
is not installed). What the routers read from a worker (/get_load in both forms, /server_info, /model_info and
their /get_ forms, /version, vLLM's load gauges in /metrics); a chat, a stream and a required tool call through
the router with the `openai` client; cache_aware keeping each of two conversations of 5 turns on the replica that
holds its prefix (cache_n > 0 from turn 2, in the timings and the x-moerun-prefix-hit header alike);
consistent_hash keeping a session (X-Session-ID, or the body's `user` or `session_id`) on one replica."""

import json
import sys
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from replicas import Router, counts, router_binary, start_replicas, system_prompt

MODEL = "default-qwen3moe.gguf"
WEATHER = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 16}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    reps = start_replicas(2, "default", threads=1, parallel=4, ctx=2048, log_dir=tmp_path_factory.mktemp("replicas"))
    yield reps
    for r in reps:
        r.stop()


def router_on(replicas, policy: str, folder: Path) -> Router:
    if router_binary() is None:
        pytest.skip("vllm-router is not installed: `pip install -e .[test]` installs it where PyPI has its wheel "
                    "(Linux x86_64 and aarch64)")
    return Router([r.url for r in replicas], policy, folder / f"router-{policy}.log")


@pytest.fixture(scope="module")
def cache_aware(replicas, tmp_path_factory):
    r = router_on(replicas, "cache_aware", tmp_path_factory.mktemp("router"))
    yield r
    r.stop()


@pytest.fixture(scope="module")
def client(cache_aware):
    return openai.OpenAI(base_url=cache_aware.url + "/v1", api_key="none", max_retries=0, timeout=120)


def finished(replicas) -> list[float]:
    return counts(replicas)[2]


def served_by(replicas, before: list[float]) -> int:
    """The replica that finished one more request since `before` (requests sent one at a time)."""
    delta = [b - a for a, b in zip(before, finished(replicas))]
    assert sorted(delta) == [0] * (len(delta) - 1) + [1], delta
    return delta.index(1)


# -- what the routers read ----------------------------------------------------------------------------------


def test_worker_endpoints_in_the_routers_shapes(replicas):
    r = replicas[0]
    obj, arr = r.request("GET", "/get_load").json(), r.request("GET", "/get_load?form=array").json()
    assert obj == {"load": 0, "dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    assert arr == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    info = r.request("GET", "/server_info").json()
    assert info == r.request("GET", "/get_server_info").json()
    assert info["served_model_name"] == MODEL and info["model_path"].endswith(MODEL)
    assert (info["context_length"], info["max_running_requests"], info["dp_size"]) == (2048, 4, 1)
    assert info["max_total_tokens"] >= 4 * 2048 and info["version"] == r.request("GET", "/version").json()["version"]
    model = r.request("GET", "/model_info").json()
    assert model == r.request("GET", "/get_model_info").json()
    assert model["model_type"] == "qwen3moe" and model["is_generation"] is True
    names = {s.name for fam in text_string_to_metric_families(r.request("GET", "/metrics").text) for s in fam.samples}
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:gpu_prefix_cache_hit_rate", "moerun:tokens_in_flight"} <= names


def test_get_load_counts_a_request_in_flight(replicas):
    r = replicas[1]
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    conn = r.connect("POST", "/v1/completions", body)
    try:
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: {")  # a token: the request is running
        load = r.request("GET", "/get_load").json()
        assert load["num_reqs"] == 1 and load["num_waiting_reqs"] == 0
        assert load["load"] == load["num_tokens"] > 0  # the prompt and the tokens so far
        gauges = {s.name: s.value for fam in text_string_to_metric_families(r.request("GET", "/metrics").text)
                  for s in fam.samples}
        assert gauges["vllm:num_requests_running"] == 1 and gauges["vllm:kv_cache_usage_perc"] > 0
    finally:
        conn.close()


# -- through vllm-router ------------------------------------------------------------------------------------


def test_a_chat_a_stream_and_a_tool_call_through_the_router(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
                                       temperature=0)
    assert r.choices[0].message.content and r.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                                 max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather" and "city" in json.loads(calls[0].function.arguments)


def test_cache_aware_keeps_each_conversation_on_the_replica_with_its_prefix(replicas, tmp_path):
    """Two agents start at once through a fresh router: the second, matching too little of the first's text, goes
    to the replica with fewer requests in flight, the other one. Then their turns, interleaved, each go to the
    replica that holds their history: cache_n covers the previous turn's prompt from turn 2 on."""
    router = router_on(replicas, "cache_aware", tmp_path)
    try:
        conversations(replicas, openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0,
                                              timeout=120))
    finally:
        router.stop()


def conversations(replicas, client):
    convs = {c: [{"role": "system", "content": system_prompt(41, c, words=150)},
                 {"role": "user", "content": f"Turn 1 of {c}: start."}] for c in (0, 1)}
    before = finished(replicas)
    first = client.chat.completions.create(model=MODEL, messages=convs[0], max_tokens=400, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = [next(first)]  # agent 0 is generating on one replica while agent 1 starts
    other = client.chat.completions.create(model=MODEL, messages=convs[1], max_tokens=8, temperature=0)
    chunks += list(first)
    assert [b - a for a, b in zip(before, finished(replicas))] == [1, 1]  # one each
    previous = {0: chunks[-1].usage.prompt_tokens, 1: other.usage.prompt_tokens}
    convs[0].append({"role": "assistant", "content": "".join(c.choices[0].delta.content or "" for c in chunks
                                                             if c.choices)})
    convs[1].append({"role": "assistant", "content": other.choices[0].message.content})
    home: dict[int, int] = {}
    for turn in range(1, 5):
        for c, msgs in convs.items():  # interleaved
            msgs.append({"role": "user", "content": f"Turn {turn + 1} of {c}: go on."})
            before = finished(replicas)
            raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=8,
                                                                   temperature=0)
            body = raw.http_response.json()
            replica, cache_n = served_by(replicas, before), body["timings"]["cache_n"]
            assert raw.headers["x-moerun-prefix-hit"] == str(cache_n)
            assert cache_n >= 0.9 * previous[c], (c, turn, cache_n, previous[c])  # its whole history found
            assert home.setdefault(c, replica) == replica, (c, turn)
            previous[c] = body["usage"]["prompt_tokens"]
            msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    assert home[0] != home[1]


def test_consistent_hash_keeps_a_session_on_one_replica(replicas, tmp_path):
    router = router_on(replicas, "consistent_hash", tmp_path)
    try:
        c = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=120)
        for how in ({"extra_headers": {"X-Session-ID": "s-1"}}, {"user": "u-7"}, {"extra_body": {"session_id": "x"}}):
            seen = set()
            for i in range(4):
                before = finished(replicas)
                c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Question {i}"}],
                                          max_tokens=2, **how)
                seen.add(served_by(replicas, before))
            assert len(seen) == 1, how
    finally:
        router.stop()


def test_load_form_sets_get_loads_default_shape():
    """serve --load-form array: sglang-router's power_of_two (which cannot ask for a form) reads the array."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from moerun.config import ServerConfig
    from moerun.server.routes import workers
    from moerun.server.state import Server as State

    snap = SimpleNamespace(running=1, waiting=2, tokens_in_flight=30)
    entry = {"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 2, "num_tokens": 30}
    for form, want in (("object", {"load": 30, **entry}), ("array", [entry])):
        state = State(ServerConfig(model_names=("m",), load_form=form), load=lambda: None)
        state.ready = SimpleNamespace(scheduler=SimpleNamespace(snapshot=lambda: snap))
        app = FastAPI()
        workers.add_routes(app, state)
        http = TestClient(app)
        assert http.get("/get_load").json() == want
        assert http.get("/get_load?form=object").json() == {"load": 30, **entry}  # asked for: as asked
        assert http.get("/get_load?form=array").json() == [entry]
    with pytest.raises(ValueError, match="load_form"):
        ServerConfig(model_names=("m",), load_form="list")
