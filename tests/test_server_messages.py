"""Anthropic's Messages API on a real `moerun serve` through the `anthropic` client (issue 38, item 4): the
built-in model with Qwen3's published chat template, text and forced tool_use answers whole and streamed (the
stream's final message equal to the whole one), a tool_result turn, count_tokens, stop sequences, x-api-key,
and errors in Anthropic's shape. The conversion itself (moerun.server.convert.messages) is checked first,
without a server."""

import json
from pathlib import Path

import anthropic
import jsonschema
import pytest
from family_checks import rewrite_gguf
from test_server import KEY, MAX_BODY, MODEL, Server
from test_server_reasoning import THINK_OUT, THINK_TEMPLATE, ScriptedSampler, _model, _script, serving

from moerun.builtin import default_model_path
from moerun.engine import scheduler
from moerun.server.convert.messages import (
    CountTokensRequest,
    MessagesRequest,
    MessageStream,
    to_chat,
    to_message,
)
from moerun.server.errors import APIError
from moerun.text import Tokenizer

TEMPLATE = (Path(__file__).parent / "data" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 16},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
SEARCH = {"type": "object", "additionalProperties": False, "required": ["query"],
          "properties": {"query": {"type": "string", "maxLength": 20}}}
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER},
         {"name": "search", "description": "Search the web", "input_schema": SEARCH}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
ASK = [{"role": "user", "content": "What is the weather in Paris for three days?"}]
GREEDY = {"extra_body": {"temperature": 0}}  # the client no longer sends temperature itself
ONE_CALL = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}


# -- the conversion, without a server ---------------------------------------------------------------------

def test_a_conversation_becomes_chat_messages_in_order():
    req = MessagesRequest(model="m", max_tokens=9, system=[{"type": "text", "text": "Be brief."},
                                                           {"type": "text", "text": "Use tools."}],
                          messages=[{"role": "user", "content": "Weather?"},
                                    {"role": "assistant", "content": [
                                        {"type": "thinking", "thinking": "A call.", "signature": "x"},
                                        {"type": "redacted_thinking", "data": "..."},
                                        {"type": "text", "text": "Calling."},
                                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                         "input": {"city": "Paris", "days": 3}}]},
                                    {"role": "user", "content": [
                                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                        {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                         "content": [{"type": "text", "text": "timeout"}]},
                                        {"type": "text", "text": "And tomorrow?"}]}],
                          tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                          stop_sequences=["END"], temperature=0.5, top_k=4, seed=7,
                          thinking={"type": "disabled"}, metadata={"user_id": "u"})
    chat = to_chat(req)
    assert chat.messages == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Calling.", "reasoning_content": "A call.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: timeout"},
        {"role": "user", "content": "And tomorrow?"}]
    assert chat.tools[0] == {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                                              "description": "The weather in a city"}}
    assert (chat.tool_choice, chat.parallel_tool_calls, chat.stop) == ("required", False, ["END"])
    assert (chat.temperature, chat.top_k, chat.seed, chat.max_tokens) == (0.5, 4, 7, 9)
    assert chat.chat_template_kwargs == {"enable_thinking": False} and chat.reasoning_format == "auto"
    named = to_chat(CountTokensRequest(model="m", messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "tool", "name": "search"}))
    assert named.tool_choice == {"type": "function", "function": {"name": "search"}}
    assert named.max_tokens is None  # count_tokens: the prompt only
    no_tools = to_chat(CountTokensRequest(model="m", messages=ASK, tool_choice={"type": "auto"}))
    assert no_tools.tool_choice is None


@pytest.mark.parametrize("change, phrase", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image' are not"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x",
                                                 "content": "?"}]}]}, "no earlier tool_use"),
    ({"messages": ASK + [{"role": "assistant", "content": "Sure"}]}, "prefilling"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "'user' or 'assistant'"),
    ({"system": [{"type": "image"}]}, "text only"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
    ({"tools": [{"name": "f"}]}, "input_schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"thinking": {"type": "maybe"}}, "thinking.type"),
    ({"output_config": {"format": {"type": "regex"}}}, "output_config.format"),
])
def test_what_the_chat_path_cannot_take_is_a_400(change, phrase):
    with pytest.raises(APIError) as e:
        to_chat(MessagesRequest(**{"model": "m", "max_tokens": 4, "messages": ASK, **change}))
    assert e.value.status == 400 and phrase in e.value.message


CALL = {"id": "call_abc", "type": "function", "function": {"name": "search", "arguments": '{"query": "x"}'}}
USAGE = {"prompt_tokens": 30, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 12}}


def chat_answer(message: dict, finish: str) -> dict:
    return {"id": "chatcmpl-r1", "model": "m", "usage": USAGE,
            "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}]}


def test_a_chat_answer_becomes_a_message():
    m = to_message(chat_answer({"content": "Hi", "reasoning_content": "Think.", "tool_calls": [CALL]},
                               "tool_calls"))
    assert m == {"id": "msg_r1", "type": "message", "role": "assistant", "model": "m", "content": [
        {"type": "thinking", "thinking": "Think.", "signature": ""}, {"type": "text", "text": "Hi"},
        {"type": "tool_use", "id": "toolu_abc", "name": "search", "input": {"query": "x"}}],
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 18, "output_tokens": 7, "cache_read_input_tokens": 12,
                  "cache_creation_input_tokens": 0}}
    assert to_message(chat_answer({"content": "a"}, "length"))["stop_reason"] == "max_tokens"
    assert to_message(chat_answer({"content": "a"}, "stop"))["stop_reason"] == "end_turn"
    stopped = to_message(chat_answer({"content": "a"}, "stop"), "END")
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "END")


def chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> dict:
    c = {"id": "chatcmpl-r1", "model": "m",
         "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}
    return c if usage is None else {**c, "usage": usage}


def replay(events: list[tuple[str, dict]]) -> dict:
    """The message a client builds from the events (as anthropic's accumulate_event does)."""
    message = None
    for name, data in events:
        assert data["type"] == name
        if name == "message_start":
            message = data["message"]
        elif name == "content_block_start":
            assert data["index"] == len(message["content"])
            message["content"].append(dict(data["content_block"], partial=""))
        elif name == "content_block_delta":
            block, d = message["content"][data["index"]], data["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking",
                   "input_json_delta": "partial"}[d["type"]]
            block[key] += d.get(key, d.get("partial_json"))
        elif name == "message_delta":
            message.update(data["delta"], usage={**message["usage"], **data["usage"]})
    for b in message["content"]:
        partial = b.pop("partial")
        if partial:
            b["input"] = json.loads(partial)
    return message


def test_chunks_become_the_events_of_the_same_message():
    deltas = [{"role": "assistant", "content": ""}, {"reasoning_content": "Th"},
              {"reasoning_content": "ink."}, {"content": "\n"}, {"content": "Hi"}, {"content": " there"},
              {"tool_calls": [{"index": 0, "id": "call_abc", "type": "function",
                               "function": {"name": "search", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '{"query": "x"}'}}]}]
    stream = MessageStream(30)
    events = [e for d in deltas for e in stream.feed(chunk(d))]
    events += stream.feed(chunk(finish="tool_calls", usage=USAGE))
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_start") == names.count("content_block_stop") == 3
    json_deltas = [d["delta"] for n, d in events if d.get("delta", {}).get("type") == "input_json_delta"]
    assert [d["partial_json"] for d in json_deltas] == ['{"query": "x"}']
    whole = to_message(chat_answer({"content": "\nHi there", "reasoning_content": "Think.",
                                    "tool_calls": [CALL]}, "tool_calls"))
    assert replay(events) == whole


def test_whitespace_before_calls_is_no_text_block_and_errors_end_the_stream():
    stream = MessageStream(3)
    events = [e for d in [{"content": "\n"}, {"tool_calls": [{"index": 0, "id": "call_1", "function": {
        "name": "search", "arguments": ""}}]}] for e in stream.feed(chunk(d))]
    events += stream.feed(chunk(finish="tool_calls", usage=USAGE))
    assert [d["content_block"]["type"] for n, d in events if n == "content_block_start"] == ["tool_use"]
    only_space = MessageStream(3)
    events = only_space.feed(chunk({"content": " "})) + only_space.feed(chunk(finish="stop", usage=USAGE))
    assert [d["delta"]["text"] for n, d in events if n == "content_block_delta"] == [" "]
    failed = MessageStream(3).feed({"error": {"code": 503, "message": "down", "type": "unavailable_error"}})
    assert failed == [("error", {"type": "error", "error": {"type": "overloaded_error", "message": "down"}})]


# -- a real server ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-messages")
    model = folder / "qwen3-template.gguf"
    rewrite_gguf(default_model_path(), model,
                 key=lambda k, v: TEMPLATE if k == "tokenizer.chat_template" else v)
    s = Server(folder, "-m", str(model), "-c", "2048")  # the tools make a long prompt
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def both(client, model=MODEL, **kw):
    """The same request whole (messages.create) and streamed (messages.stream's final message), as dicts."""
    whole = client.messages.create(model=model, **kw).model_dump()
    with client.messages.stream(model=model, **kw) as s:
        streamed = s.get_final_message().model_dump()
    return whole, streamed


def same_answer(a: dict, b: dict) -> dict:
    """What two answers to one request share: their blocks (ids aside), stop reason and output tokens."""
    def blocks(m):
        return [{k: v for k, v in b.items() if k != "id"} for b in m["content"]]
    assert blocks(a) == blocks(b)
    assert (a["stop_reason"], a["stop_sequence"]) == (b["stop_reason"], b["stop_sequence"])
    assert a["usage"]["output_tokens"] == b["usage"]["output_tokens"]
    assert a["usage"]["input_tokens"] + a["usage"]["cache_read_input_tokens"] \
        == b["usage"]["input_tokens"] + b["usage"]["cache_read_input_tokens"]
    return a


def test_text_whole_and_streamed_are_the_same_message(client):
    m = same_answer(*both(client, max_tokens=24, messages=[{"role": "user", "content": "Say hello."}],
                          system="You are brief.", **GREEDY))
    assert m["id"].startswith("msg_") and m["type"] == "message" and m["model"] == MODEL
    assert [b["type"] for b in m["content"]] == ["text"] and m["content"][0]["text"]
    assert m["stop_reason"] in ("end_turn", "max_tokens") and m["usage"]["output_tokens"] <= 24


def test_the_stream_names_its_events_in_anthropics_order(server):
    body = {"model": MODEL, "max_tokens": 60, "messages": ASK, "tools": TOOLS, "tool_choice": ONE_CALL,
            "temperature": 0, "stream": True}
    with server.http_stream("/v1/messages", body) as lines:
        frames = [line for line in lines if line]
    names = [f.removeprefix("event: ") for f in frames[0::2]]
    datas = [json.loads(f.removeprefix("data: ")) for f in frames[1::2]]
    assert [d["type"] for d in datas] == names
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert datas[1]["content_block"]["type"] == "tool_use" and datas[-2]["delta"]["stop_reason"] == "tool_use"


def test_max_tokens_ends_in_max_tokens(client):
    m = client.messages.create(model=MODEL, max_tokens=3, messages=ASK, **GREEDY)
    assert (m.stop_reason, m.usage.output_tokens) == ("max_tokens", 3)


def test_a_stop_sequence_ends_the_answer_and_is_named(client):
    text = client.messages.create(model=MODEL, max_tokens=24, messages=ASK, **GREEDY).content[0].text
    word = next(w for w in text.split()[1:] if text.index(w) > 0 and len(w) > 1)
    for m in both(client, max_tokens=24, messages=ASK, stop_sequences=["\x00never", word], **GREEDY):
        assert (m["stop_reason"], m["stop_sequence"]) == ("stop_sequence", word)
        assert m["content"][0]["text"] == text[:text.index(word)]


@pytest.mark.parametrize("choice", [ONE_CALL, {"type": "any", "disable_parallel_tool_use": True}],
                         ids=["tool", "any"])
def test_a_forced_tool_use_validates_whole_and_streamed(client, choice):
    m = same_answer(*both(client, max_tokens=80, messages=ASK, tools=TOOLS, tool_choice=choice, **GREEDY))
    assert m["stop_reason"] == "tool_use" and [b["type"] for b in m["content"]] == ["tool_use"]
    call = m["content"][0]
    assert call["id"].startswith("toolu_") and (choice["type"] == "any" or call["name"] == "get_weather")
    jsonschema.validate(call["input"], SCHEMAS[call["name"]])
    for seed in range(2):  # sampled calls validate too
        m = client.messages.create(model=MODEL, max_tokens=80, messages=ASK, tools=TOOLS, tool_choice=choice,
                                   extra_body={"temperature": 1.0, "seed": seed})
        jsonschema.validate(m.content[0].input, SCHEMAS[m.content[0].name])


def test_a_tool_result_turn_completes(client):
    first = client.messages.create(model=MODEL, max_tokens=80, messages=ASK, tools=TOOLS,
                                   tool_choice=ONE_CALL, **GREEDY)
    call = first.content[0]
    said = [b.model_dump(exclude_none=True) for b in first.content]
    history = ASK + [{"role": "assistant", "content": said},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": json.dumps({"temperature_c": 21})}]}]
    whole, streamed = both(client, max_tokens=8, messages=history, tools=TOOLS, **GREEDY)
    m = same_answer(whole, streamed)
    assert m["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    prompt = lambda u: u["input_tokens"] + u["cache_read_input_tokens"]
    assert prompt(m["usage"]) > prompt(first.usage.model_dump())


def test_count_tokens_is_the_prompt_a_create_reads(server, client):
    messages = [{"role": "user", "content": "Say hello."}]
    n = client.messages.count_tokens(model=MODEL, messages=messages, system="Be brief.").input_tokens
    chat = [{"role": "system", "content": "Be brief."}, *messages]
    assert n == server.http("POST", "/tokenize", {"messages": chat}).json()["count"]
    used = client.messages.create(model=MODEL, max_tokens=2, messages=messages, system="Be brief.").usage
    assert used.input_tokens + used.cache_read_input_tokens == n
    longer = messages + [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again."}]
    assert client.messages.count_tokens(model=MODEL, messages=longer, system="Be brief.").input_tokens > n
    with_tools = client.messages.count_tokens(model=MODEL, messages=ASK, tools=TOOLS).input_tokens
    assert with_tools > client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    used = client.messages.create(model=MODEL, max_tokens=2, messages=ASK, tools=TOOLS).usage
    assert used.input_tokens + used.cache_read_input_tokens == with_tools
    no_thinking = client.messages.count_tokens(model=MODEL, messages=ASK, thinking={"type": "disabled"})
    assert no_thinking.input_tokens > client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens


def test_structured_output_follows_its_schema(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"type": "string", "maxLength": 12}}}
    m = client.messages.create(model=MODEL, max_tokens=40, messages=ASK, **GREEDY,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_x_api_key_and_bearer_are_accepted_a_wrong_key_is_not(server):
    ok = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)  # Authorization: Bearer
    assert ok.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0
    bad = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    assert "x-api-key" in e.value.body["error"]["message"]


@pytest.mark.parametrize("kw, phrase", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "'image'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope",
                                                 "content": "21"}]}]}, "toolu_nope"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "if": {"required": ["a"]}, "then": {}}}],
      "tool_choice": {"type": "tool", "name": "f"}}, "cannot be enforced"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "server tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "not among the tools"),
    ({"max_tokens": 10 ** 6}, "context size"),
])
def test_bad_requests_are_400s_in_anthropics_shape(client, kw, phrase):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, **{"max_tokens": 4, "messages": ASK, **kw})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert phrase in e.value.body["error"]["message"]


def test_every_error_on_these_paths_has_anthropics_shape(server):
    def error_of(path, body, status, kind, **headers):
        r = server.http("POST", path, body, **headers)
        assert r.status_code == status, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind, r.text
        return r.json()["error"]["message"]

    missing = error_of("/v1/messages", {"model": MODEL, "messages": ASK}, 400, "invalid_request_error")
    assert "max_tokens" in missing
    error_of("/v1/messages", "{not json", 400, "invalid_request_error")
    error_of("/v1/messages/count_tokens", {"messages": ASK}, 400, "invalid_request_error")
    error_of("/v1/messages/nope", {}, 404, "not_found_error")
    error_of("/v1/messages", {"model": MODEL, "messages": ASK, "max_tokens": 2}, 401, "authentication_error",
             key=None, headers={"x-api-key": "sk-wrong"})
    error_of("/v1/messages", "x" * (MAX_BODY + 1), 413, "request_too_large")
    assert "error" in server.http("POST", "/v1/chat/completions", {"model": MODEL}).json()  # OpenAI's still
    r = server.http("POST", "/v1/messages", {"model": MODEL, "messages": ASK, "max_tokens": 2}, key=None,
                    headers={"x-api-key": KEY})
    assert r.status_code == 200 and r.json()["type"] == "message"


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """The anthropic client on a tiny model with a Qwen3-style template (<think>) whose output is scripted
    (test_server_reasoning), and its tokenizer."""
    tmp = tmp_path_factory.mktemp("think")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOERUN_CACHE", str(tmp / "cache"))
        folder = _model(tmp, None, THINK_TEMPLATE)
        mp.setattr(scheduler, "Sampler", ScriptedSampler)
        with serving(folder) as openai_client:
            url = str(openai_client.base_url).removesuffix("/").removesuffix("/v1")
            client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
            yield client, Tokenizer.from_hf_dir(folder)


def test_a_reasoning_models_thinking_is_a_thinking_block(thinker, monkeypatch):
    client, tok = thinker
    kw = {"model": "tiny", "max_tokens": 60, "system": "Be brief.",
          "messages": [{"role": "user", "content": "What is 2+2?"}]}
    _script(monkeypatch, tok, THINK_OUT, "<|im_end|>")
    m = same_answer(*both(client, **kw))
    thought = "The user wants 2+2.\nThat is 4."
    assert m["content"] == [{"type": "thinking", "thinking": thought, "signature": ""},
                            {"type": "text", "text": "The answer is 4.", "citations": None}]
    assert m["stop_reason"] == "end_turn"
    _script(monkeypatch, tok, "Four.", "<|im_end|>")
    m = client.messages.create(**kw, thinking={"type": "disabled"})
    assert [(b.type, b.text) for b in m.content] == [("text", "Four.")]
    assert tok.decode(ScriptedSampler.prompts[0], skip_special=False).endswith("<think>\n\n</think>\n\n")
