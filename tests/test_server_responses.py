"""OpenAI's Responses API on a real `moerun serve` (the built-in model with Qwen3's published template) through the
real `openai` client and an OpenAI Agents SDK agent: text, forced function calls that validate, a function result
turn, previous_response_id reusing the cached prefix, json_schema output, stream == whole, and bad input answered
in OpenAI's error shape (issue 38, item 3)."""

import json
from pathlib import Path

import jsonschema
import openai
import pytest
from family_checks import rewrite_gguf
from test_server import KEY, MODEL, Server

from moerun.builtin import default_model_path

TEMPLATE = (Path(__file__).parent / "data" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 16},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER,
          "strict": True}]
QUESTION = "What is the weather in Paris for three days?"
# a long shared instruction: its KV blocks are what a continued response finds cached
INSTRUCTIONS = "You answer questions about the weather. " * 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-responses")
    model = folder / "qwen3-template.gguf"
    rewrite_gguf(default_model_path(), model, key=lambda k, v: TEMPLATE if k == "tokenizer.chat_template" else v)
    s = Server(folder, "-m", str(model), "-c", "2048", "--responses-max", "3")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def streamed(client, **kw):
    """responses.stream's events and its final response (None when the stream ended without response.completed)."""
    with client.responses.stream(model=MODEL, **kw) as s:
        events = list(s)
        final = events[-1].response if events[-1].type == "response.completed" else None
    return events, final


def shape(response) -> list[tuple]:
    """What a response said: its items' kinds and texts or calls, and its status."""
    out = []
    for item in response.output:
        if item.type == "message":
            out.append(("message", "".join(c.text for c in item.content)))
        elif item.type == "function_call":
            out.append(("function_call", item.name, item.arguments))
        else:
            out.append((item.type, json.dumps(item.model_dump().get("content"))))
    return [response.status, *out]


def test_text_whole_and_streamed_are_equal(client):
    kw = {"input": "def fib(n):", "max_output_tokens": 12, "temperature": 0}
    r = client.responses.create(model=MODEL, **kw)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.usage.output_tokens == 12 and r.usage.input_tokens > 0
    events, final = streamed(client, **kw)
    assert final is None and events[-1].type == "response.incomplete"
    assert shape(events[-1].response) == shape(r)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-2:] == ["response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}],
                         ids=["required", "named"])
def test_a_forced_function_call_validates_and_streams_the_same(client, choice):
    kw = {"input": QUESTION, "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False,
          "max_output_tokens": 80, "temperature": 1.0}
    for seed in range(2):
        r = client.responses.create(model=MODEL, **kw, extra_body={"seed": seed})
        calls = [i for i in r.output if i.type == "function_call"]
        assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
        assert calls[0].call_id and calls[0].id.startswith("fc_")
        events, final = streamed(client, **kw, extra_body={"seed": seed})
        assert final is not None and shape(final) == shape(r)
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert args == calls[0].arguments
        assert "response.function_call_arguments.done" in [e.type for e in events]


def test_a_function_call_output_turn(client):
    r = client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    call = next(i for i in r.output if i.type == "function_call")
    items = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temperature_c": 21})}]
    follow = client.responses.create(model=MODEL, input=items, tools=TOOLS, max_output_tokens=6, temperature=0)
    assert follow.status in ("completed", "incomplete") and follow.usage.input_tokens > r.usage.input_tokens


def test_previous_response_id_continues_with_the_cached_prefix(client):
    first = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=8,
                                    temperature=0)
    second = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, previous_response_id=first.id,
                                     input="And in Rome?", max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2
    # the same conversation sent whole (no previous_response_id) is the same prompt, so the same answer
    again = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, max_output_tokens=8, temperature=0,
                                    input=[{"role": "user", "content": QUESTION},
                                           {"role": "assistant", "content": first.output_text},
                                           {"role": "user", "content": "And in Rome?"}])
    assert again.usage.input_tokens == second.usage.input_tokens and again.output_text == second.output_text
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_json_schema_output(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
              "properties": {"city": {"type": "string", "maxLength": 12},
                             "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
    fmt = {"format": {"type": "json_schema", "name": "forecast", "schema": schema, "strict": True}}
    r = client.responses.create(model=MODEL, input=QUESTION, text=fmt, max_output_tokens=60, temperature=0)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    _, final = streamed(client, input=QUESTION, text=fmt, max_output_tokens=60, temperature=0)
    assert final.output_text == r.output_text


def test_an_agents_sdk_agent_runs_a_function_tool(server):
    """An agent of the OpenAI Agents SDK, on moerun through OpenAIResponsesModel with a custom base URL: its
    (forced) tool runs, its result goes back, and the run completes."""
    agents = pytest.importorskip("agents")
    ran = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        ran.append(city)
        return f"Sunny in {city}"

    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120))
    agent = agents.Agent(name="weather", instructions="Use the tool.", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=200, temperature=0,
                                                                 parallel_tool_calls=False),
                         tool_use_behavior="stop_on_first_tool", reset_tool_choice=True)
    result = agents.Runner.run_sync(agent, QUESTION, run_config=agents.RunConfig(tracing_disabled=True))
    assert len(ran) == 1 and isinstance(ran[0], str)
    assert result.final_output == f"Sunny in {ran[0]}"


def test_bad_input_is_a_400_in_openai_shape(server, client):
    cases = [
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "1"}]}, "input[0].call_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0]"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "tools": [{"type": "function", "name": "f",
                                    "parameters": {"type": "object", "properties": {"a": {"type": "strnig"}}}}],
          "tool_choice": "required"}, "tools"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, max_output_tokens=4, **body)
        err = e.value.body
        assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)


def test_an_unknown_or_evicted_previous_response_id_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id" and "not found" in e.value.body["message"]
    first = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    for _ in range(3):  # --responses-max 3: three newer responses push the first out
        client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="hi", previous_response_id=first.id, max_output_tokens=2)
    assert "evicted" in e.value.body["message"] and "--responses-max" in e.value.body["message"]
    unstored = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
