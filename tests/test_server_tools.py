"""Function calling on a real `moerun serve` through the `openai` client: the built-in model, which carries Qwen3's
published chat template (tests/data/templates/Qwen-Qwen3-0.6B.jinja), tools rendered into the prompt, forced
(named) and required calls whose arguments validate against the schema, whole and streamed, a tool result sent
back (issue 18, item 1)."""

import json

import jsonschema
import openai
import pytest
from test_server import KEY, MODEL, Server

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 16}, "days": {"type": "integer", "minimum": 1,
                                                                               "maximum": 7}}}
SEARCH = {"type": "object", "additionalProperties": False, "required": ["query"],
          "properties": {"query": {"type": "string", "maxLength": 20}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for three days?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve-tools"), "-c", "2048")  # the tools make a long prompt
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def calls_of(client, stream: bool, **kw) -> tuple[list[tuple[str, dict]], str | None]:
    r = client.chat.completions.create(model=MODEL, messages=kw.pop("messages", MESSAGES), tools=TOOLS,
                                       max_tokens=80, stream=stream, **kw)
    if not stream:
        c = r.choices[0]
        return [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls or []], \
            c.finish_reason
    parts: dict[int, list] = {}
    reason = None
    for chunk in r:
        for c in chunk.choices:
            reason = c.finish_reason or reason
            for d in c.delta.tool_calls or []:
                entry = parts.setdefault(d.index, [None, ""])
                if d.function.name:
                    assert entry[0] is None and entry[1] == "" and d.id  # the name (and id) come first
                    entry[0] = d.function.name
                entry[1] += d.function.arguments or ""
    return [(name, json.loads(args)) for name, args in (parts[i] for i in sorted(parts))], reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_named_tool_choice_forces_a_valid_call(client, stream):
    for seed in range(3):
        calls, reason = calls_of(client, stream, temperature=1.0, seed=seed,
                                 tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                 parallel_tool_calls=False)
        assert reason == "tool_calls" and len(calls) == 1 and calls[0][0] == "get_weather"
        jsonschema.validate(calls[0][1], WEATHER)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_required_calls_validate_against_their_tools(client, stream):
    for seed in range(3):
        calls, reason = calls_of(client, stream, temperature=1.0, seed=seed, tool_choice="required")
        # parallel calls may go on until max_tokens ("length"), the whole ones before it returned as calls
        assert reason in ("tool_calls", "length") and calls
        for name, args in calls:
            jsonschema.validate(args, SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_call_cut_off_by_max_tokens_ends_in_length_and_is_no_call(client, stream):
    """max_tokens stops a forced call half written: finish_reason "length", and no tool_calls entry (a cut-off call
    is not a whole one)."""
    kw = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=5, temperature=0,
                                       stream=stream, **kw)
    if not stream:
        c = r.choices[0]
        assert c.finish_reason == "length" and not c.message.tool_calls
        return
    reasons, deltas = [], []
    for chunk in r:
        for c in chunk.choices:
            reasons += [c.finish_reason] if c.finish_reason else []
            deltas += c.delta.tool_calls or []
    assert reasons == ["length"] and deltas == []


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_calls_that_run_into_max_tokens_end_in_length(client, stream):
    """Required calls, in parallel: a reply that reaches max_tokens (after whole calls, in the middle of the next)
    says "length", one that stops by itself "tool_calls"; only the whole calls are returned."""
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=80,
                                           temperature=1.0, seed=seed, tool_choice="required", stream=stream,
                                           stream_options={"include_usage": True} if stream else None)
        if stream:
            chunks = list(r)
            reason = next(c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason)
            used = next(ch.usage for ch in chunks if ch.usage).completion_tokens
        else:
            reason, used = r.choices[0].finish_reason, r.usage.completion_tokens
        assert reason == ("length" if used == 80 else "tool_calls"), (seed, reason, used)


def test_stream_equals_whole(client):
    kw = {"temperature": 1.0, "seed": 11, "tool_choice": "required", "parallel_tool_calls": False}
    assert calls_of(client, True, **kw) == calls_of(client, False, **kw)


def test_a_tool_result_goes_back_and_the_conversation_continues(server, client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0]
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})}]
    follow = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8,
                                            temperature=0)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert follow.usage.prompt_tokens > r.usage.prompt_tokens
    r = server.http("POST", "/detokenize", json.dumps({"tokens": server.http(
        "POST", "/tokenize", json.dumps({"messages": history}), headers={"Content-Type": "application/json"}
    ).json()["tokens"]}), headers={"Content-Type": "application/json"})
    prompt = r.json()["content"]  # the template rendered the call and its result (Qwen3's <tool_response>)
    assert '"temperature_c": 21' in prompt and "<tool_response>" in prompt and call.function.name in prompt


@pytest.mark.parametrize("body, phrase, param", [
    ({"tool_choice": "sometimes"}, "tool_choice must be", "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools", "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "has no name", "tools[0].function.name"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice needs tools", "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot both", "response_format"),
])
def test_bad_tool_requests_are_400_naming_the_field(server, body, phrase, param):
    req = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **body}
    r = server.http("POST", "/v1/chat/completions", json.dumps(req), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert phrase in err["message"] and err["param"] == param


def test_an_agent_loop_reuses_its_prefix_every_turn(server, client):
    """A scripted agent: 5 turns of a forced tool call and its result sent back. From the second turn on the
    prefill runs only the new part (timings.cache_n), the prefix-cache metric moves, and a second client with
    the same system prompt reuses the cached blocks on its first request."""
    system = {"role": "system", "content": "You are an agent. Call tools to answer. " * 6}
    messages = [system, {"role": "user", "content": "Plan a trip to Paris."}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    before = server.metrics()
    cached = []
    for turn in range(5):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice,
                                           max_tokens=60, temperature=0)
        cached.append(r.model_extra["timings"]["cache_n"])
        call = r.choices[0].message.tool_calls[0]
        messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"turn": turn, "ok": True})}]
    assert cached[0] < len(system["content"]) // 4 and all(c > cached[0] for c in cached[1:]), cached
    after = server.metrics()
    hits = after["moerun:prefix_cache_hits_total"] - before.get("moerun:prefix_cache_hits_total", 0)
    assert hits >= sum(cached) and after["moerun:prefix_cache_hit_ratio"] > 0
    other = client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "Hi."}],
                                           tools=TOOLS, max_tokens=4, temperature=0)
    assert other.model_extra["timings"]["cache_n"] >= 32
