"""`moerun serve` end to end: a real server process on a free port, the built-in model, the real `openai`
client (and http.client for what the client hides: status codes, raw SSE, chunked bodies, disconnects)."""

import http.client
import itertools
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from toolkit import ServerProcess, free_port

KEY = "sk-test-7f3a"
CTX = 384
PARALLEL, QUEUE = 8, 4
MAX_BODY = 32 * 1024
MODEL = "default-qwen3moe.gguf"
ALIAS = "org/another-name"  # a second -a name, with a slash as Hugging Face ids have
SLOTS = 4  # --expert-cache-slots
HANG_GUARD_S = 120  # waits for something that must happen: only a hang comes near it, however loaded the machine
PROMPTS = ["def fib(n):", "import os\n", "class Foo:\n    def", "    return self.", "for i in range(",
           "x = [", "while True:\n", "# compute the"]


@dataclass
class Response:
    status_code: int
    headers: dict
    text: str

    def json(self):
        return json.loads(self.text)


class Server(ServerProcess):
    """The built-in model behind KEY with this file's limits (extra: more arguments); `health` has every /health
    answer until the model was ready. Requests: http (a Response), http_stream, metrics (labelled)."""

    def __init__(self, tmp_path, *extra):
        super().__init__(["-c", str(CTX), "-np", str(PARALLEL), "--max-queue", str(QUEUE), "--max-body-size",
                          str(MAX_BODY), "-t", "1", "--expert-cache-slots", str(SLOTS), "--log-interval", "0.5",
                          "-a", MODEL, "-a", ALIAS, *extra], tmp_path / "serve.log", key=KEY, wait=120, poll=0.01)

    def _connect(self, method, path, key, body, headers):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        h = {"Authorization": f"Bearer {key}"} if key else {}
        if isinstance(body, (dict, list)):
            body, h["Content-Type"] = json.dumps(body), "application/json"
        conn.request(method, path, body=body, headers={**h, **(headers or {})},
                     encode_chunked=body is not None and not isinstance(body, (str, bytes)))
        return conn

    def http(self, method, path, body=None, key=KEY, headers=None):
        """body: a dict (sent as JSON), str/bytes as they are, or an iterable of bytes (chunked)."""
        conn = self._connect(method, path, key, body, headers)
        try:
            r = conn.getresponse()
            return Response(r.status, dict(r.getheaders()), r.read().decode())
        finally:
            conn.close()

    @contextmanager
    def http_stream(self, path, body):
        """A streaming request held open until the `with` block ends; then the client disconnects. Yields an
        iterator over the response's lines."""
        conn = self._connect("POST", path, KEY, body, None)
        r = conn.getresponse()
        assert r.status == 200
        try:
            yield (line.decode().rstrip("\n") for line in iter(r.readline, b""))
        finally:
            conn.close()

    def metrics(self):
        text = self.http("GET", "/metrics").text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name if not s.labels else (s.name, tuple(sorted(s.labels.items())))
                out[key] = s.value
        return out


def server_fixtures(folder: str = "serve", timeout: float = 60):
    """A test module's `server` (a Server of its own, in a folder named `folder`) and `client` (the openai client
    on it) fixtures, module-scoped: `server, client = server_fixtures("serve-x")`."""

    @pytest.fixture(scope="module")
    def server(tmp_path_factory):
        s = Server(tmp_path_factory.mktemp(folder))
        yield s
        s.stop()

    @pytest.fixture(scope="module")
    def client(server):
        return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=timeout)

    return server, client


server, client = server_fixtures()


def total(metrics, name):
    return sum(v for k, v in metrics.items() if (k[0] if isinstance(k, tuple) else k) == name)


def stream_text(stream):
    parts, last = [], None
    for chunk in stream:
        last = chunk
        if chunk.choices:
            c = chunk.choices[0]
            parts.append(c.delta.content or "" if hasattr(c, "delta") else c.text)
    return "".join(parts), last


# -- loading, health, models, auth ------------------------------------------------------------------------

def test_health_is_503_while_loading_then_200(server):
    statuses = [s for s, _ in server.health]
    assert statuses[0] == 503 and statuses[-1] == 200
    assert server.health[0][1]["error"] | {"param": None} == {
        "code": 503, "message": "Loading model", "type": "unavailable_error", "param": None}
    assert server.health[-1][1] == {"status": "ok"}
    assert set(statuses) == {503, 200} and statuses.index(200) == len(statuses) - 1


def test_models_and_api_key(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert server.http("GET", "/health", key=None).status_code == 200  # open
    for key in (None, "sk-wrong", KEY + "x"):
        r = server.http("GET", "/v1/models", key=key)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.json()["error"]["code"] == 401
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_models_retrieve(server, client):
    for name in (MODEL, ALIAS):
        m = client.models.retrieve(name)
        assert (m.id, m.object, m.owned_by) == (name, "model", "moerun")
        assert m.model_extra["meta"]["n_ctx"] == CTX
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["param"] == "model" and "gpt-4" in e.value.body["message"]
    r = server.http("GET", "/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404 and r.json()["error"]["type"]


# -- generation ---------------------------------------------------------------------------------------------

def test_chat_streamed_equals_whole_at_temperature_0(client):
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "write a loop"}], "max_tokens": 24,
          "temperature": 0}
    whole = client.chat.completions.create(**kw)
    text, last = stream_text(client.chat.completions.create(**kw, stream=True))
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == text and text
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens <= 24 and whole.usage.prompt_tokens > 5
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    timings = last.model_extra["timings"]
    assert {"prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms", "predicted_per_second",
            "expert_cache_hits", "expert_cache_queries"} <= set(timings)
    assert timings["predicted_n"] == whole.usage.completion_tokens
    assert timings["expert_cache_queries"] > 0 and 0 <= timings["expert_cache_hits"] <= timings["expert_cache_queries"]


def test_completion_streamed_equals_whole_and_raw_sse(server, client):
    kw = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 20, "temperature": 0}
    whole = client.completions.create(**kw)
    text, _ = stream_text(client.completions.create(**kw, stream=True))
    assert whole.choices[0].text == text and text
    r = server.http("POST", "/v1/completions", {**kw, "stream": True, "stream_options": {"include_usage": True}})
    events = [line[len("data: "):] for line in r.text.split("\n\n") if line]
    assert r.headers["content-type"].startswith("text/event-stream"), r.text
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
    assert chunks[-2]["choices"][0]["finish_reason"] == whole.choices[0].finish_reason
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == whole.usage.completion_tokens
    assert "timings" in chunks[-1]


def test_same_seed_same_text(client):
    kw = {"model": MODEL, "prompt": "import ", "max_tokens": 32, "temperature": 0.9, "extra_body": {"ignore_eos": True}}
    a = client.completions.create(**kw, seed=1234).choices[0].text
    b = client.completions.create(**kw, seed=1234).choices[0].text
    c = client.completions.create(**kw, seed=99).choices[0].text
    assert a == b and a != c


def test_a_chat_turn_reuses_the_previous_turns_kv_cache(server, client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "write a class"}]
    a = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    tokenized = server.http("POST", "/tokenize", {"messages": msgs}).json()
    assert tokenized["count"] == a.usage.prompt_tokens
    msgs += [{"role": "assistant", "content": a.choices[0].message.content}, {"role": "user", "content": "again"}]
    b = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    assert a.usage.prompt_tokens <= b.usage.prompt_tokens_details.cached_tokens < b.usage.prompt_tokens
    assert b.model_extra["timings"]["cache_n"] == b.usage.prompt_tokens_details.cached_tokens
    assert b.model_extra["timings"]["prompt_n"] == b.usage.prompt_tokens - b.usage.prompt_tokens_details.cached_tokens


def test_eight_concurrent_streams_each_get_what_they_get_alone(client):
    kw = {"model": MODEL, "max_tokens": 32, "temperature": 0, "extra_body": {"ignore_eos": True}}
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in PROMPTS]
    got, spans = [None] * len(PROMPTS), [None] * len(PROMPTS)
    start, order = threading.Barrier(len(PROMPTS)), itertools.count()  # the order events came in, not their times

    def one(i):
        start.wait()
        first = next(order)
        got[i], _ = stream_text(client.completions.create(prompt=PROMPTS[i], stream=True, **kw))
        spans[i] = (first, next(order))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone
    assert max(s for s, _ in spans) < min(e for _, e in spans)  # all eight had started before any ended


def test_a_client_that_disconnects_is_cancelled_and_its_kv_freed(server, client):
    before = server.metrics()
    kw = {"model": MODEL, "max_tokens": 40, "temperature": 0, "extra_body": {"ignore_eos": True}}
    expected = client.completions.create(prompt=PROMPTS[5], **kw).choices[0].text
    other = {}
    t = threading.Thread(target=lambda: other.update(
        text=stream_text(client.completions.create(prompt=PROMPTS[5], stream=True, **kw))[0]))
    with server.http_stream("/v1/completions", {"model": MODEL, "prompt": PROMPTS[0] * 4, "max_tokens": 300,
                                                "temperature": 0, "stream": True, "ignore_eos": True}) as lines:
        first = json.loads(next(line for line in lines if line.startswith("data: "))[len("data: "):])
        for _ in range(5):
            next(lines)
        t.start()
        rid = first["id"].removeprefix("cmpl-")
        slot = next(s for s in server.http("GET", "/slots").json() if s["id_task"] == rid)
        assert slot["is_processing"] and slot["n_blocks"] > 0
    deadline = time.time() + HANG_GUARD_S
    while time.time() < deadline:
        now = next(s for s in server.http("GET", "/slots").json() if s["id"] == slot["id"])
        if not now["is_processing"]:
            break
        time.sleep(0.02)
    assert not now["is_processing"] and now["n_tokens"] == 0 and now["n_blocks"] == 0
    t.join()
    assert other["text"] == expected
    after = server.metrics()
    reason = ("moerun:requests_finished_total", (("finish_reason", "cancelled"),))
    assert after.get(reason, 0) == before.get(reason, 0) + 1


# -- metrics and logs ---------------------------------------------------------------------------------------

def test_metrics_parse_and_move(server, client):
    before = server.metrics()
    r = client.completions.create(model=MODEL, prompt="while x:", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True, "cache_prompt": False})
    after = server.metrics()
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == 12
    assert after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"] == r.usage.prompt_tokens
    assert after["llamacpp:prompt_seconds_total"] > before["llamacpp:prompt_seconds_total"]
    for h in ("moerun:time_to_first_token_seconds_count", "moerun:e2e_request_latency_seconds_count"):
        assert after[h] == before[h] + 1
    assert after["moerun:inter_token_latency_seconds_count"] == before["moerun:inter_token_latency_seconds_count"] + 11
    for name in ("moerun:expert_cache_queries_total", "moerun:expert_cache_hits_total"):
        assert total(after, name) > total(before, name)
    assert total(after, "moerun:expert_cache_queries_total") >= total(after, "moerun:expert_cache_hits_total")
    labels = {dict(k[1])["phase"] for k in after if isinstance(k, tuple) and k[0] == "moerun:expert_cache_hits_total"}
    assert labels == {"prefill", "decode"}
    for gauge in ("llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:kv_cache_usage_ratio",
                  "moerun:expert_cache_evictions_total", "moerun:expert_paged_bytes_total",
                  "moerun:expert_prefetch_hits_total"):
        assert any((k[0] if isinstance(k, tuple) else k) == gauge for k in after), gauge


def test_log_lines(server):
    import gguf

    from moerun.builtin import default_model_path

    r = gguf.GGUFReader(str(default_model_path()))
    n_experts = int(r.fields["qwen3moe.expert_count"].parts[-1][0])
    expert_bytes = sum(int(t.n_bytes) for t in r.tensors if "_exps" in t.name) / n_experts  # one, over all layers
    wanted = [f"expert cache {SLOTS * expert_bytes / 2**20:.1f} MiB ({SLOTS} slots per layer)",
              "prompt eval time = ", "       eval time = ", "total time = ",  # each request's lines
              "expert cache: prefill hit rate", "decode hit rate",
              "Avg prompt throughput: ", "Running: ", "Expert cache hit rate: "]  # the periodic line (every 0.5 s)
    deadline = time.time() + HANG_GUARD_S  # the periodic line comes when the server's clock says: wait for it
    while not all(w in (log := server.log_path.read_text()) for w in wanted) and time.time() < deadline:
        time.sleep(0.05)
    for w in wanted:
        assert w in log, w


def test_tokenize_detokenize(server):
    r = server.http("POST", "/tokenize", {"content": "def f(x): return x", "with_pieces": True}).json()
    ids = [t["id"] for t in r["tokens"]]
    assert "".join(t["piece"] for t in r["tokens"]) == "def f(x): return x"
    assert server.http("POST", "/detokenize", {"tokens": ids}).json() == {"content": "def f(x): return x"}
    assert server.http("POST", "/detokenize", {"tokens": [10**9]}).status_code == 400


# -- errors ------------------------------------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("body,status,phrase", [
    ('{"model": "x", "messages": [', 400, "malformed JSON"),
    ("[1, 2]", 400, "invalid request"),
    ({**CHAT, "temperature": "hot"}, 400, "temperature"),
    ({**CHAT, "top_p": 2}, 400, "top_p"),
    ({**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ({**CHAT, "n": 17}, 400, "n=17"),
    ({**CHAT, "stop": [""]}, 400, "stop"),
    ({**CHAT, "top_logprobs": 3}, 400, "top_logprobs needs logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 2, "logprobs": -1}, 400, "logprobs"),
    ({**CHAT, "messages": []}, 400, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "image_url"),
    ({"model": MODEL, "prompt": [], "max_tokens": 2}, 400, "empty"),
    ({**CHAT, "max_tokens": CTX + 1}, 400, f"more than the context size {CTX}"),
    ({**CHAT, "max_completion_tokens": CTX + 1}, 400, "max_completion_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ({**CHAT, "lora": [{"id": 0, "scale": 1.0}]}, 400, "LoRA"),
])
def test_bad_requests_get_openai_shaped_errors(server, body, status, phrase):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    r = server.http("POST", path, body if isinstance(body, str) else json.dumps(body),
                    headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and phrase in err["message"] and err["type"]


OUT_OF_RANGE = [("temperature", -0.1), ("temperature", 2.1), ("top_p", 0), ("top_p", 1.5), ("top_p", -1),
                ("presence_penalty", -2.5), ("presence_penalty", 2.1), ("frequency_penalty", -2.1),
                ("frequency_penalty", 3)]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_sampling_values_outside_openais_ranges_are_400_naming_the_field(server, path):
    base = CHAT if "chat" in path else {"model": MODEL, "prompt": "x", "max_tokens": 2}
    for name, value in OUT_OF_RANGE:
        r = server.http("POST", path, {**base, name: value})
        assert r.status_code == 400, (name, value, r.text)
        err = r.json()["error"]
        assert err["param"] == name and name in err["message"] and err["type"] == "invalid_request_error"
    edges = {"temperature": (0, 2), "top_p": (1e-3, 1), "presence_penalty": (-2, 2), "frequency_penalty": (-2, 2)}
    for name, values in edges.items():  # the ends of each range are accepted
        for value in values:
            r = server.http("POST", path, {**base, name: value})
            assert r.status_code == 200, (name, value, r.text)


def test_an_unknown_role_is_400_naming_the_message(server, client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "narrator", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert e.value.body["param"] == "messages[1].role" and "'narrator'" in e.value.body["message"]
    r = server.http("POST", "/tokenize", {"messages": msgs})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].role"
    for role in ("system", "developer", "user", "assistant", "tool"):  # OpenAI's roles all pass
        r = server.http("POST", "/v1/chat/completions", {**CHAT, "messages": [{"role": role, "content": "hi"}]})
        assert r.status_code == 200, (role, r.text)


def test_prompt_longer_than_the_context(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=list(range(5, 5 + CTX + 10)), max_tokens=4)
    err = e.value.body
    assert err["type"] == "exceed_context_size_error"
    assert err["n_prompt_tokens"] == CTX + 10 and err["n_ctx"] == CTX
    assert f"{CTX + 10} prompt tokens" in err["message"] and f"context size is {CTX}" in err["message"]


def test_body_over_the_size_limit(server):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}
    r = server.http("POST", "/v1/chat/completions", big)
    assert r.status_code == 413 and str(MAX_BODY) in r.json()["error"]["message"]
    data = json.dumps(big).encode()
    r = server.http("POST", "/v1/chat/completions", iter([data[:1000], data[1000:]]))  # chunked: no Content-Length
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    small = json.dumps(CHAT).encode()
    assert server.http("POST", "/v1/chat/completions", iter([small[:10], small[10:]])).status_code == 200


def test_queue_full_is_503_and_the_server_recovers(server, client):
    long = {"model": MODEL, "prompt": "x", "max_tokens": 300, "temperature": 0, "stream": True, "ignore_eos": True}
    with ExitStack() as stack:
        for _ in range(PARALLEL + QUEUE):
            stack.enter_context(server.http_stream("/v1/completions", long))
        r = server.http("POST", "/v1/completions", {**long, "stream": False})
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["type"] == "unavailable_error" and "busy" in err["message"] and f"--parallel {PARALLEL}" in err[
            "message"]
    deadline = time.time() + HANG_GUARD_S
    while time.time() < deadline:
        m = server.metrics()
        if m["llamacpp:requests_processing"] == 0 and m["llamacpp:requests_deferred"] == 0:
            break
        time.sleep(0.05)
    assert m["llamacpp:requests_processing"] == 0 and m["llamacpp:requests_deferred"] == 0


def test_the_server_survives_all_of_it(server, client):
    assert server.proc.poll() is None
    assert server.http("GET", "/health", key=None).json() == {"status": "ok"}
    r = client.chat.completions.create(**CHAT)
    assert r.choices[0].finish_reason in ("stop", "length")


def serve_fails(*args, timeout=120, warnings=0):
    """`moerun serve ARGS` that must stop before serving -> its stderr's last line, which must be its only
    one (but for `warnings` lines before it) and an `error:` line."""
    r = subprocess.run([sys.executable, "-m", "moerun", "serve", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, check=False)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 + warnings and lines[-1].startswith("error: "), r.stderr
    assert all(" WARNING " in line for line in lines[:-1]), r.stderr
    return lines[-1]


def test_a_model_that_does_not_load_stops_the_server_with_one_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    assert "broken.gguf" in serve_fails("-m", bad, "--port", free_port())
    # beyond loopback without a key, the warning comes first: it is about what was asked for
    assert "broken.gguf" in serve_fails("-m", bad, "--host", "0.0.0.0", "--port", free_port(), warnings=1)


def test_a_model_over_the_ram_budget_is_one_line():
    assert "but the RAM budget is 1.00 MiB" in serve_fails("--ram-budget", "1MiB", "--port", free_port())


def test_a_port_in_use_is_one_line_and_status_1():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = serve_fails("--port", port, timeout=60)
    assert f"cannot listen on 127.0.0.1:{port}" in line and "in use" in line and "--port" in line


def test_trace_routing_that_exists_is_one_line(tmp_path):
    path = tmp_path / "routes.jsonl"
    path.write_text("mine")
    assert "already exists" in serve_fails("--trace-routing", path, "--port", free_port())
    assert path.read_text() == "mine"


def test_trace_routing_numbers_the_requests_and_batches_steps(tmp_path):
    """One trace for the server: each record carries its request's number; a decode step that ran two
    requests together is one step of both; the trace replays."""
    from click.testing import CliRunner

    from moerun.cli import main
    from moerun.experts.trace import read_trace

    path = tmp_path / "routes.jsonl"
    s = Server(tmp_path, "--trace-routing", path)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        kw = {"model": MODEL, "temperature": 0, "extra_body": {"ignore_eos": True, "cache_prompt": False}}
        stream = client.completions.create(prompt="def long_one(x):", max_tokens=200, stream=True, **kw)
        chunks = iter(stream)
        next(chunks)  # the long request is decoding
        short = client.completions.create(prompt="import os, sys, re\n", max_tokens=12, **kw)
        rest = list(chunks)
    finally:
        s.stop()
    long_usage = rest[-1].usage
    trace = read_trace(path)
    moe = sorted({r.layer for r in trace.records})
    assert moe
    by_req = {}
    for rec in trace.records:
        by_req.setdefault(rec.request_id, []).append(rec)
    assert sorted(by_req) == [0, 1]  # numbered in the order they ran: the long one first
    for n, use in ((0, long_usage), (1, short.usage)):
        recs = by_req[n]
        for layer in moe:
            pre = [r.position for r in recs if r.layer == layer and r.phase == "prefill"]
            dec = [r.position for r in recs if r.layer == layer and r.phase == "decode"]
            assert pre == list(range(use.prompt_tokens))
            assert dec == list(range(use.prompt_tokens, use.prompt_tokens + use.completion_tokens - 1))
    steps = {}
    for rec in trace.records:
        if rec.phase == "decode" and rec.layer == 0:
            steps.setdefault(rec.step, set()).add(rec.request_id)
    assert {0, 1} in steps.values()  # a decode step of both
    sim = CliRunner().invoke(main, ["trace", "simulate", str(path), "--slots", "2", "--group", "batch"])
    assert sim.exit_code == 0, sim.output


def test_a_non_streaming_client_that_goes_away_is_cancelled(server):
    before = server.metrics()
    reason = ("moerun:requests_finished_total", (("finish_reason", "cancelled"),))
    conn = server._connect("POST", "/v1/completions", KEY, {"model": MODEL, "prompt": "x", "max_tokens": CTX,
                                                            "temperature": 0, "ignore_eos": True}, None)
    deadline = time.time() + HANG_GUARD_S  # the client goes away once its request is running, not after a guess
    while time.time() < deadline and server.metrics()["llamacpp:requests_processing"] == 0:
        time.sleep(0.02)
    conn.close()
    while time.time() < deadline and server.metrics().get(reason, 0) == before.get(reason, 0):
        time.sleep(0.05)
    after = server.metrics()
    assert after.get(reason, 0) == before.get(reason, 0) + 1
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] < CTX - 2


def test_slot_erase_frees_an_idle_slots_kv_and_refuses_a_busy_one(server, client):
    client.completions.create(model=MODEL, prompt="def erase(x):", max_tokens=8, temperature=0)
    slot = max(server.http("GET", "/slots").json(), key=lambda s: s["n_tokens"])
    assert slot["n_blocks"] > 0 and not slot["is_processing"]
    r = server.http("POST", f"/slots/{slot['id']}?action=erase")
    assert r.status_code == 200 and r.json() == {"id_slot": slot["id"], "n_erased": slot["n_tokens"]}
    now = next(s for s in server.http("GET", "/slots").json() if s["id"] == slot["id"])
    assert now["n_blocks"] == 0 and now["n_tokens"] == 0
    assert server.http("POST", f"/slots/{PARALLEL}?action=erase").status_code == 404
    r = server.http("POST", "/slots/0?action=restore&filename=x.bin")  # this server has no --slot-save-path
    assert r.status_code == 400 and "--slot-save-path" in r.json()["error"]["message"]
    with server.http_stream("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": CTX - 2, "stream": True,
                                                "temperature": 0, "ignore_eos": True}) as lines:
        rid = json.loads(next(line for line in lines if line.startswith("data: "))[len("data: "):])["id"]
        busy = next(s for s in server.http("GET", "/slots").json() if s["id_task"] == rid.removeprefix("cmpl-"))
        r = server.http("POST", f"/slots/{busy['id']}?action=erase")
        assert r.status_code == 409 and "is processing" in r.json()["error"]["message"]


def test_sigterm_ends_the_streams_in_flight_and_exits(server):  # last: it stops the module's server
    with server.http_stream("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": CTX, "stream": True,
                                                "temperature": 0, "ignore_eos": True}) as lines:
        next(lines)
        server.proc.terminate()
        rest = list(lines)
        events = [line for line in rest if line.startswith("data: ")]
    assert json.loads(events[-1][len("data: "):])["error"]["code"] == 503, rest
    # uvicorn re-raises the signal once it is done
    assert server.proc.wait(timeout=HANG_GUARD_S) in (0, -signal.SIGTERM)
    log = server.log_path.read_text()
    assert "Finished server process" in log and "Traceback" not in log
