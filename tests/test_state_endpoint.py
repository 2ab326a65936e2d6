"""GET /v1/moerun/state (the web page's live view) and the expert use counter behind its heat map
(moerun.experts.usage); the page's routes without a browser (/, /webui/NAME, --no-webui). Real `moerun serve`
processes on the built-in model (tests/test_webui.py drives the page itself in Chromium)."""

import http.client
import json
import math
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from moerun.experts.usage import ExpertUse

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from toolkit import Reply, ServerProcess

KEY = "sk-state-1"
SLOTS = 4  # of the built-in model's 8 experts per layer


# -- the counter -------------------------------------------------------------------------------------------

def test_expert_use_decays_by_half_every_half_life_steps():
    use = ExpertUse({3: 4}, half_life=8)
    use.record(3, [1, 2])
    assert use.recent(3) == [0.0, 1.0, 1.0, 0.0] and use.total(3) == [0, 1, 1, 0] and use.steps(3) == 1
    for _ in range(8):
        use.record(3, [0])
    recent = use.recent(3)
    assert math.isclose(recent[1], 0.5) and math.isclose(recent[2], 0.5)
    assert math.isclose(recent[0], sum(0.5 ** (k / 8) for k in range(8)))
    assert use.total(3) == [8, 1, 1, 0] and use.steps(3) == 9 and use.layers() == [3]


def test_expert_use_rescales_and_grows():
    use = ExpertUse(half_life=1)
    use.record(0, [2])  # a layer not given up front: sized by its first record
    assert use.recent(0) == [0.0, 0.0, 1.0]
    for _ in range(200):  # the weight passes 2**64 and is rescaled
        use.record(0, [0])
    assert use._layers[0].weight < 2.0**64
    recent = use.recent(0)
    assert math.isclose(recent[0], 2.0, rel_tol=1e-9) and recent[2] < 1e-30
    use.record(0, [5])
    assert len(use.recent(0)) == 6 and use.total(0) == [200, 0, 1, 0, 0, 1]
    assert use.recent(7) == [] and use.total(7) == [] and use.steps(7) == 0
    with pytest.raises(ValueError):
        ExpertUse(half_life=0)


def test_expert_use_record_is_cheap():
    """O(k) per step and layer: a top-8 step of a 128-expert layer stays within a few microseconds."""
    use = ExpertUse({0: 128})
    ids = [1, 5, 9, 20, 33, 40, 77, 100]
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(2000):
            use.record(0, ids)
        best = min(best, (time.perf_counter() - t0) / 2000)
    assert best < 20e-6, f"{best * 1e6:.1f} us per record"


# -- the endpoint ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(["-c", "512", "-np", "2", "-t", "1", "--expert-cache-slots", str(SLOTS),
                       "--log-interval", "0"], tmp_path_factory.mktemp("state") / "serve.log", key=KEY, wait=120)
    yield s
    s.stop()


def chat(server, content: str, max_tokens: int = 16) -> dict:
    r = server.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": content}],
                                                        "max_tokens": max_tokens, "temperature": 0,
                                                        "ignore_eos": True})
    assert r.status == 200, r.text
    return r.json()


def state(server, key=KEY) -> dict:
    r = server.request("GET", "/v1/moerun/state", key=key)
    assert r.status == 200, r.text
    return r.json()


def cache_metrics(server) -> dict:
    """(layer, phase) -> (hits, queries) from /metrics."""
    out: dict = {}
    for fam in text_string_to_metric_families(server.request("GET", "/metrics").text):
        for s in fam.samples:
            if s.name in ("moerun:expert_cache_hits_total", "moerun:expert_cache_queries_total"):
                key = (int(s.labels["layer"]), s.labels["phase"])
                hits, queries = out.get(key, (0, 0))
                out[key] = (s.value, queries) if "hits" in s.name else (hits, s.value)
    return out


def test_state_needs_the_key_and_has_every_part(server):
    r = server.request("GET", "/v1/moerun/state", key="sk-wrong")
    assert r.status == 401
    before = state(server)
    assert before["object"] == "moerun.state"
    assert before["model"] | {"name": None} == {"name": None, "family": "qwen3moe", "n_layers": 4, "n_experts": 8,
                                                 "n_experts_used": 2, "n_ctx": 512, "device": "cpu"}
    assert [s["id"] for s in before["slots"]] == [0, 1] and {s["state"] for s in before["slots"]} == {"idle"}
    p = before["placement"]
    assert sum(t["bytes"] for t in p["tensors"]) == p["totals"]["model_bytes"] > 0
    assert {t["tensor"] for t in p["tensors"]} >= {"blk.*.ffn_gate_exps.weight", "token_embd.weight"}
    assert [d["device"] for d in p["devices"]] == ["cpu"] and p["devices"][0]["layers"] == [0, 4]
    experts = before["experts"]
    assert [row["layer"] for row in experts["layers"]] == [0, 1, 2, 3]
    assert all(len(row["recent"]) == len(row["total"]) == 8 and row["slots"] == SLOTS for row in experts["layers"])
    assert before["build_ms"] >= 0


def test_a_reply_moves_the_counters(server):
    before = state(server)
    out = chat(server, "def fib(n):", max_tokens=24)
    after = state(server)
    assert after["tokens"]["generated"] - before["tokens"]["generated"] == out["usage"]["completion_tokens"] == 24
    assert after["tokens"]["prompt"] > before["tokens"]["prompt"]
    for b, a in zip(before["experts"]["layers"], after["experts"]["layers"]):
        assert a["steps"] > b["steps"] and sum(a["total"]) - sum(b["total"]) >= 2 * (a["steps"] - b["steps"]) - 2
        assert sum(a["recent"]) > 0 and len(a["resident"]) <= SLOTS and set(a["resident"]) <= set(range(8))
    assert any(a["resident"] for a in after["experts"]["layers"])  # decode pages experts into the slots
    idle = [s for s in after["slots"] if s["state"] == "idle" and s["n_tokens"]]
    assert idle and idle[0]["n_tokens"] >= out["usage"]["prompt_tokens"]


def test_cache_figures_equal_metrics(server):
    chat(server, "import os\n")
    figures = {(row["layer"], phase): (row[phase]["hits"], row[phase]["queries"])
               for row in state(server)["cache"] for phase in ("prefill", "decode")}
    assert figures == cache_metrics(server) and any(q for _, q in figures.values())


def test_state_streams_as_server_sent_events(server):
    conn = server.connect("GET", "/v1/moerun/state?stream=true&interval=0.2")
    try:
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
        events = []
        while len(events) < 3:
            line = r.readline().decode()
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
        assert all(e["object"] == "moerun.state" for e in events)
        assert events[-1]["time"] - events[0]["time"] >= 0.35  # the interval asked for
    finally:
        conn.close()
    assert server.request("GET", "/v1/moerun/state?stream=true&interval=0.01").status == 400


def test_state_costs_little_to_build(server):
    """What the page asks for once a second: the median over 50 answers of the time to build one."""
    chat(server, "class A:")
    ms = sorted(state(server)["build_ms"] for _ in range(50))
    assert ms[25] < 20, ms


# -- the page's routes -------------------------------------------------------------------------------------

def bare(server, path: str) -> Reply:
    """GET path with no key."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return Reply(r.status, r.read().decode(), {k.lower(): v for k, v in r.getheaders()})
    finally:
        conn.close()


def test_page_and_files_are_open_and_the_apis_are_not(server):
    page = bare(server, "/")
    assert page.status == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
    for name in ("style.css", "markdown.js", "api.js", "chat.js", "live.js"):
        r = bare(server, f"/webui/{name}")
        assert r.status == 200 and f'"/webui/{name}"' in page.text, name
    assert bare(server, "/webui/nothing.js").status == 401  # not a file of the page: guarded
    assert server.request("GET", "/webui/nothing.js").status == 404
    for path in ("/props", "/v1/moerun/state", "/metrics"):
        assert bare(server, path).status == 401


def test_no_webui(tmp_path):
    s = ServerProcess(["-c", "256", "-np", "1", "--no-webui"], tmp_path / "serve.log", wait=120)
    try:
        assert s.request("GET", "/").status == 404
        assert s.request("GET", "/webui/chat.js").status == 404
        plain = s.request("GET", "/v1/moerun/state").json()  # no expert cache: no per-expert counts
        assert plain["experts"] is None and plain["cache"] is None and plain["placement"]["tensors"]
    finally:
        s.stop()
