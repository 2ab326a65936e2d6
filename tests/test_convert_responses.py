"""The Responses conversion without a server: input items to chat messages, chat answers (whole, or as stream
chunks) to output items, and the store of responses kept for previous_response_id."""

import pytest

from moerun.server.convert.responses import Output, ResponseStore, Stored, input_messages
from moerun.server.errors import APIError

CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": 1}', "id": "fc_x",
        "status": "completed"}


def test_items_become_chat_messages():
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
             {"role": "user", "content": "hi"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
             CALL, {**CALL, "call_id": "call_2"},
             {"type": "function_call_output", "call_id": "call_1", "output": "1"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "2"}]}]
    calls = [{"id": c, "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
             for c in ("call_1", "call_2")]
    assert input_messages(items, []) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "calling", "reasoning_content": "hm", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "1"},
        {"role": "tool", "tool_call_id": "call_2", "content": "2"}]
    assert input_messages("hi", []) == [{"role": "user", "content": "hi"}]


def test_a_result_needs_its_call():
    history = [{"role": "assistant", "content": "", "tool_calls": [{"id": "call_9", "type": "function",
                                                                    "function": {"name": "f", "arguments": "{}"}}]}]
    out = {"type": "function_call_output", "call_id": "call_9", "output": "ok"}
    assert input_messages([out], history) == [{"role": "tool", "tool_call_id": "call_9", "content": "ok"}]
    with pytest.raises(APIError) as e:
        input_messages([out], [])
    assert e.value.status == 400 and e.value.param == "input[0].call_id"
    for bad, param in (([{"type": "item_reference", "id": "x"}], "input[0].type"),
                       ([{"role": "tool", "content": "x"}], "input[0].role"),
                       ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "input[0].content[0]"),
                       ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}], "input[0]")):
        with pytest.raises(APIError) as e:
            input_messages(bad, [])
        assert e.value.status == 400 and e.value.param == param


def _chunk(**delta):
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def test_stream_chunks_and_the_whole_answer_make_the_same_items():
    message = {"role": "assistant", "reasoning_content": "think", "content": "text",
               "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]}
    whole = Output("resp_1")
    whole.message(message)
    stream, events = Output("resp_1"), []
    for c in (_chunk(role="assistant"), _chunk(reasoning_content="thi"), _chunk(reasoning_content="nk"),
              _chunk(content="te"), _chunk(content="xt"),
              _chunk(tool_calls=[{"index": 0, "id": "call_1", "type": "function",
                                  "function": {"name": "f", "arguments": ""}}]),
              _chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"a":1}'}}])):
        events += stream.chunk(c)
    events += stream.close()
    assert stream.items == whole.items and [i["type"] for i in whole.items] == ["reasoning", "message", "function_call"]
    assert whole.assistant() == {**message, "content": "text"}
    names = [n for n, _ in events]
    assert names.count("response.output_item.added") == names.count("response.output_item.done") == 3
    assert names.index("response.reasoning_text.done") < names.index("response.content_part.added")
    added = [d["item"] for n, d in events if n == "response.output_item.added"]
    assert [a["status"] for a in added] == ["in_progress"] * 3 and added[1]["content"] == []
    done = [d for n, d in events if n == "response.function_call_arguments.done"]
    assert done == [{"item_id": whole.items[2]["id"], "output_index": 2, "name": "f", "arguments": '{"a":1}'}]


def test_the_store_keeps_the_most_recently_used():
    store = ResponseStore(2)
    for rid in ("a", "b"):
        store.put(rid, Stored({"id": rid}, []))
    store.get("a")  # used: "b" is now the oldest
    store.put("c", Stored({"id": "c"}, []))
    assert store.get("a").response["id"] == "a" and store.get("c")
    with pytest.raises(APIError) as e:
        store.get("b")
    assert e.value.status == 404 and "evicted" in e.value.message
    with pytest.raises(APIError) as e:
        store.get("zz")
    assert "not found" in e.value.message and e.value.param == "previous_response_id"
    store.delete("a")
    with pytest.raises(APIError):
        store.get("a")
    off = ResponseStore(0)
    off.put("a", Stored({}, []))
    with pytest.raises(APIError):
        off.get("a")


def test_a_failure_mid_stream_is_an_error_event_then_response_failed():
    import asyncio
    import json

    from moerun.server.convert.responses import Conversion, ResponsesRequest
    from moerun.server.routes.responses import _events

    class Failing:
        async def chunks(self):
            yield _chunk(content="par")
            yield {"error": {"code": 500, "message": "generation failed: boom", "type": "server_error", "param": None}}

    conv = Conversion.of(ResponsesRequest(input="hi", stream=True), [])

    async def run():
        return [e async for e in _events(Failing(), conv, "resp_1", "m", 0, lambda o: 0, lambda *a: None)]

    events = [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(run())]
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "error", "response.failed"]
    assert events[-2]["message"] == "generation failed: boom" and events[-1]["response"]["status"] == "failed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
