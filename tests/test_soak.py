"""The soak of bench/soak.py, short: 4 clients for 20 s on the built-in model, and its pass criteria."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import soak


@pytest.mark.slow  # 20 s of clients against a server: `python -m pytest -m slow`, and CI
def test_short_soak_passes(tmp_path):
    r = soak.soak(None, seconds=20, clients=4, n_ctx=512, parallel=4, threads=1, n_cases=6, warmup=4, seed=1,
                  log_path=tmp_path / "serve.log")
    assert r["failures"] == [] and r["passed"], r
    kinds, statuses = r["by_kind"], r["by_status"]
    assert kinds["greedy"] > 0 and kinds["sampled"] > 0 and kinds["cancelled"] > 0 and kinds["invalid"] > 0
    assert r["served"] > 0 and not any(s.isdigit() and int(s) >= 500 for s in statuses)
    assert {"400", "404"} <= set(statuses)
    assert r["rss_growth_pct"] < 5
    assert r["kv_usage_after_erase"] == 0
    assert r["ttft_p50_ms"] is not None and r["itl_p99_ms"] is not None
    assert r["server_exit"] in (0, -15)
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


class _Rng:
    def random(self):
        return 0.0  # the non-streamed branch

    def choice(self, seq):
        return seq[0]


class _Server:
    def __init__(self, status, answer):
        self.status, self.answer = status, answer

    def request(self, method, path, body=None, key=None):
        body = {"choices": [{"text": self.answer, "finish_reason": "length"}], "usage": {"completion_tokens": 3}}
        return soak.Reply(self.status, json.dumps(body))


def _greedy(status, answer):
    tally = soak.Tally()
    case = soak.Case("/v1/completions", {"prompt": [5], "max_tokens": 3}, ("abc", "length", 3))
    soak.Client(_Server(status, answer), [case], tally, _Rng(), n_ctx=64, vocab=100).greedy()
    return tally


def test_the_pass_criteria_can_fail():
    assert soak.verdict([_greedy(200, "abc")], rss_growth=0.0) == []
    wrong = soak.verdict([_greedy(200, "abd")], rss_growth=0.0)
    assert len(wrong) == 1 and "alone it answered" in wrong[0]
    failed = soak.verdict([_greedy(500, "abc")], rss_growth=0.0)
    assert any("5xx answers: {500: 1}" in f for f in failed)
    assert soak.verdict([_greedy(200, "abc")], rss_growth=0.05) == ["RSS grew 5.0% after warm-up"]
