"""Soak test of `moerun serve`: many concurrent clients for a bounded time, then the pass criteria.

    python bench/soak.py [-m MODEL] [--seconds 120] [--clients 16] [-c 512] [-np 4] [-t 1] [-o md|json]

Starts `moerun serve` on a free loopback port (with an API key, a 256 KiB body limit and an expert cache
over the memory-mapped file), then:

1. reference: each of `--cases` greedy requests (completions of random token-id prompts of random lengths up
   to the context, and a few chats) is sent alone, one after the other; its text is the expected answer;
2. warm-up: the concurrent mix below for `--warmup` seconds; then the server's RSS is read (start);
3. soak: `--clients` threads send the mix for `--seconds` of running time (time this process was stopped
   or starved for over a second, e.g. by SIGSTOP, is reported as `paused_s` and added to the end): greedy
   requests from the reference set (streamed or not; the answer must equal the reference), sampled requests
   (temperature 0.8, random seed and length), clients that disconnect mid-stream or before a non-streamed
   answer, and invalid requests (each must get its 4xx);
4. end: wait until no request runs, read RSS (end), check /slots and /metrics (no slot processing; KV blocks
   in use only if idle slots keep prompts for prompt caching), erase every slot (`POST /slots/N?action=erase`)
   and check that every KV block is free (a block no slot owns would stay in use).

TTFT is send -> first SSE event with text; inter-token latency is the gap between SSE events with text
(one token each, except where a UTF-8 character or a stop-string prefix is held back). Pass: no 5xx, every
greedy answer equal to its reference, every invalid request answered with its status, RSS growth under 5%
after warm-up, all KV blocks free at the end. Exit status 0 when it passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from toolkit import Reply, ServerProcess, add, md_table

KEY = "sk-soak"
MAX_BODY = 256 * 1024
CHATS = ["write a loop", "what is a list?", "explain recursion in one line", "def main():", "hello",
         "sort these numbers: 3 1 2"]


# -- the workload -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """A greedy request and, after the reference pass, what it answered alone."""

    path: str
    body: dict
    expected: tuple[str, str, int] | None = None  # text, finish_reason, completion tokens


def _random_prompt(rng: random.Random, vocab: int, n_ctx: int, max_tokens: int) -> list[int]:
    longest = n_ctx - 1
    n = min(longest, round(2 ** rng.uniform(0, longest.bit_length())))
    return [rng.randrange(3, vocab) for _ in range(max(1, n - (max_tokens if rng.random() < 0.7 else 0)))]


def make_cases(rng: random.Random, n: int, vocab: int, n_ctx: int) -> list[Case]:
    """n greedy requests: completions of random token-id prompts of lengths up to the context (most leave
    room for max_tokens, some run into the end of the context), one in five a chat."""
    cases = []
    for i in range(n):
        max_tokens = rng.randint(1, 48)
        if i % 5 == 4:
            body = {"messages": [{"role": "user", "content": CHATS[i // 5 % len(CHATS)]}]}
            cases.append(Case("/v1/chat/completions", {**body, "max_tokens": max_tokens, "temperature": 0}))
        else:
            prompt = _random_prompt(rng, vocab, n_ctx, max_tokens)
            cases.append(Case("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}))
    return cases


def invalid_requests(n_ctx: int) -> list[tuple[str, str, object, str | None, int]]:
    """(method, path, body, key, expected status)."""
    ok = {"prompt": "x", "max_tokens": 2}
    return [
        ("POST", "/v1/completions", '{"prompt": ', None, 400),
        ("POST", "/v1/completions", {**ok, "max_tokens": n_ctx + 1}, None, 400),
        ("POST", "/v1/completions", {**ok, "prompt": [5] * (n_ctx + 3)}, None, 400),
        ("POST", "/v1/completions", {**ok, "model": "../x.gguf"}, None, 404),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
         None, 400),
        ("POST", "/v1/completions", {**ok, "prompt": "x" * (MAX_BODY + 1)}, None, 413),
        ("POST", "/v1/completions", ok, "sk-wrong", 401),
        ("GET", "/v1/nothing", None, None, 404),
    ]


@dataclass
class Tally:
    """What the clients saw; one lock for all of it."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    statuses: Counter = field(default_factory=Counter)  # HTTP status (and "stream error NNN") -> count
    kinds: Counter = field(default_factory=Counter)  # greedy / sampled / cancelled / invalid -> count
    served: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    slowest: float = 0.0  # seconds, the longest request

    def add(self, kind: str, status, served: bool = False, failure: str | None = None,
            ttft: float | None = None, gaps: list[float] | None = None) -> None:
        with self.lock:
            self.kinds[kind] += 1
            self.statuses[status] += 1
            self.served += served
            if failure is not None:
                self.failures.append(failure)
            if ttft is not None:
                self.ttft.append(ttft)
            self.itl.extend(gaps or [])


def read_stream(resp, t0: float, stop_after: int | None = None) -> dict:
    """An SSE response to a request sent at t0 -> text, finish_reason, completion tokens, error, ttft, gaps
    (between events with text). stop_after: return after that many lines (the caller then disconnects)."""
    last, out = None, {"text": [], "gaps": [], "ttft": None, "finish": None,
                                                "tokens": None, "error": None}
    for n, line in enumerate(iter(resp.readline, b"")):
        if stop_after is not None and n >= stop_after:
            break
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        ev, now = json.loads(line[6:]), time.perf_counter()
        if "error" in ev:
            out["error"] = ev["error"]
            break
        choice = ev["choices"][0] if ev.get("choices") else {}
        text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        if text or choice.get("finish_reason"):
            if out["ttft"] is None:
                out["ttft"] = now - t0
            elif text:
                out["gaps"].append(now - last)
            last = now
        out["text"].append(text)
        out["finish"] = choice.get("finish_reason") or out["finish"]
        if ev.get("usage"):
            out["tokens"] = ev["usage"]["completion_tokens"]
    out["text"] = "".join(out["text"])
    return out


def _whole_answer(reply: Reply) -> tuple[str, str, int]:
    body = reply.json()
    choice = body["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text, choice["finish_reason"], body["usage"]["completion_tokens"]


def _stream_answer(server: ServerProcess, path: str, body: dict) -> tuple[int, dict | str]:
    t0 = time.perf_counter()
    conn = server.connect("POST", path, {**body, "stream": True})
    try:
        resp = conn.getresponse()
        if resp.status != 200:
            return resp.status, resp.read().decode()
        return 200, read_stream(resp, t0)
    finally:
        conn.close()


def reference(server: ServerProcess, cases: list[Case]) -> list[Case]:
    out = []
    for case in cases:
        r = server.request("POST", case.path, case.body)
        if r.status != 200:
            raise RuntimeError(f"reference request failed: HTTP {r.status}: {r.text[:300]}")
        out.append(Case(case.path, case.body, _whole_answer(r)))
    return out


class Client:
    """One soak client: a loop of random requests until the deadline."""

    def __init__(self, server: ServerProcess, cases: list[Case], tally: Tally, rng: random.Random,
                 n_ctx: int, vocab: int):
        self.server, self.cases, self.tally, self.rng = server, cases, tally, rng
        self.n_ctx, self.vocab = n_ctx, vocab
        self.invalid = invalid_requests(n_ctx)

    def run(self, clock: Clock) -> None:
        actions = [(0.40, self.greedy), (0.25, self.sampled), (0.20, self.cancel), (0.15, self.bad)]
        while not clock.expired():
            x = self.rng.random()
            for weight, action in actions:
                if x < weight:
                    break
                x -= weight
            t0 = time.perf_counter()
            try:
                action()
            except Exception as e:  # noqa: BLE001 - a client error is a failure of the run, not of the thread
                self.tally.add("client error", "exception", failure=f"{action.__name__}: {type(e).__name__}: {e}")
            with self.tally.lock:
                self.tally.slowest = max(self.tally.slowest, time.perf_counter() - t0)

    def greedy(self) -> None:
        case = self.rng.choice(self.cases)
        if self.rng.random() < 0.5:
            r = self.server.request("POST", case.path, case.body)
            got = _whole_answer(r) if r.status == 200 else None
            ttft, gaps = None, None
        else:
            status, out = _stream_answer(self.server, case.path, case.body)
            r = Reply(status, "" if status == 200 else out)
            got = (out["text"], out["finish"], out["tokens"]) if status == 200 and out["error"] is None else None
            ttft, gaps = (out["ttft"], out["gaps"]) if status == 200 else (None, None)
            if status == 200 and out["error"] is not None:
                r = Reply(out["error"].get("code", 500), json.dumps(out["error"]))
        failure = None
        if r.status != 200:
            failure = f"greedy {case.path}: HTTP {r.status}: {r.text[:200]}"
        elif got != case.expected:
            failure = f"greedy {case.path} answered {got!r}, alone it answered {case.expected!r}"
        self.tally.add("greedy", r.status, served=r.status == 200, failure=failure, ttft=ttft, gaps=gaps)

    def sampled(self) -> None:
        max_tokens = self.rng.randint(1, 64)
        body = {"prompt": _random_prompt(self.rng, self.vocab, self.n_ctx, max_tokens), "max_tokens": max_tokens,
                "temperature": 0.8, "seed": self.rng.randrange(2**31), "cache_prompt": self.rng.random() < 0.7}
        status, out = _stream_answer(self.server, "/v1/completions", body)
        if status != 200:
            self.tally.add("sampled", status, failure=f"sampled: HTTP {status}: {out[:200]}")
            return
        failure = None
        if out["error"] is not None:
            status = out["error"].get("code", 500)
            failure = f"sampled: error event {out['error']}"
        elif out["finish"] not in ("stop", "length") or not 0 < (out["tokens"] or 0) <= max_tokens:
            failure = f"sampled: finish {out['finish']!r} after {out['tokens']} tokens (max_tokens {max_tokens})"
        self.tally.add("sampled", status, served=failure is None, failure=failure, ttft=out["ttft"], gaps=out["gaps"])

    def cancel(self) -> None:
        body = {"prompt": _random_prompt(self.rng, self.vocab, self.n_ctx // 2, 0), "max_tokens": self.n_ctx // 2,
                "temperature": 0, "ignore_eos": True}
        if self.rng.random() < 0.7:
            conn = self.server.connect("POST", "/v1/completions", {**body, "stream": True})
            resp = conn.getresponse()
            status = resp.status
            if status == 200:
                read_stream(resp, time.perf_counter(), stop_after=self.rng.randint(1, 24))
        else:  # non-streamed: go away before the answer
            conn = self.server.connect("POST", "/v1/completions", body)
            time.sleep(self.rng.uniform(0.01, 0.5))
            status = "disconnected"
        conn.close()
        failure = f"cancel: HTTP {status}" if status not in (200, "disconnected") else None
        self.tally.add("cancelled", status, failure=failure)

    def bad(self) -> None:
        method, path, body, key, expected = self.rng.choice(self.invalid)
        r = self.server.request(method, path, body, key=key)
        failure = None if r.status == expected else f"{method} {path} expected {expected}, got {r.status}: {r.text[:200]}"
        self.tally.add("invalid", r.status, failure=failure)


class Clock:
    """`seconds` of running time: a watcher thread that finds itself woken over a second late (this process
    was stopped or starved: SIGSTOP, a loaded machine) counts the lost time as paused and extends the end."""

    def __init__(self, seconds: float, tick: float = 0.1):
        self.end, self.paused, self.tick = time.monotonic() + seconds, 0.0, tick
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        last = time.monotonic()
        while not self._done.wait(self.tick):
            now = time.monotonic()
            if now - last > 1.0:
                self.paused += now - last - self.tick
                self.end += now - last - self.tick
            last = now

    def expired(self) -> bool:
        return time.monotonic() >= self.end

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def run_clients(server: ServerProcess, cases: list[Case], n: int, seconds: float, seed: int, n_ctx: int,
                vocab: int) -> tuple[Tally, Clock]:
    tally, clock = Tally(), Clock(seconds)
    threads = [threading.Thread(target=Client(server, cases, tally, random.Random(seed * 1000 + i), n_ctx,
                                              vocab).run, args=(clock,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    clock.stop()
    return tally, clock


# -- the end state ------------------------------------------------------------------------------------------

def wait_idle(server: ServerProcess, timeout: float = 120) -> list[dict]:
    deadline = time.time() + timeout
    while True:
        slots, m = server.request("GET", "/slots").json(), server.metrics()
        idle = not any(s["is_processing"] for s in slots) and m["llamacpp:requests_processing"] == 0 \
            and m["llamacpp:requests_deferred"] == 0
        if idle or time.time() > deadline:
            return slots
        time.sleep(0.1)


def kv_checks(server: ServerProcess, slots: list[dict]) -> tuple[dict, list[str]]:
    """Blocks in use = those idle slots keep; then every slot erased and every block free."""
    failures = []
    if any(s["is_processing"] for s in slots):
        failures.append(f"slots still processing at the end: {slots}")
    held, usage = sum(s["n_blocks"] for s in slots), server.metrics()["llamacpp:kv_cache_usage_ratio"]
    erased = [server.request("POST", f"/slots/{s['id']}?action=erase") for s in slots]
    if any(r.status != 200 for r in erased):
        failures.append(f"erase failed: {[(r.status, r.text[:100]) for r in erased if r.status != 200]}")
    after = server.request("GET", "/slots").json()
    usage_after = server.metrics()["llamacpp:kv_cache_usage_ratio"]
    if held == 0 and usage != 0 or held > 0 and usage == 0:
        failures.append(f"KV blocks in use ({usage:.4f} of the pool) disagree with the slots' {held} blocks")
    if usage_after != 0 or any(s["n_blocks"] or s["n_tokens"] for s in after):
        failures.append(f"KV blocks not free after erasing every slot: usage {usage_after}, slots {after}")
    return {"kv_blocks_kept_by_idle_slots": held, "kv_usage_before_erase": usage,
            "kv_usage_after_erase": usage_after}, failures


# -- report -------------------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def soak(model: str | None, seconds: float, clients: int, n_ctx: int, parallel: int, threads: int, n_cases: int,
         warmup: float, seed: int, log_path: Path, cache_slots: int = 4) -> dict:
    """cache_slots 0: no expert cache, experts in RAM (decode steps then run whole layers in C)."""
    cache = ["--mmap", "--expert-cache-slots", str(cache_slots)] if cache_slots else ["--no-mmap"]
    args = ["-c", str(n_ctx), "-np", str(parallel), "-t", str(threads), "--max-body-size", str(MAX_BODY),
            *cache, "--log-interval", "0", "--strict-model-name"] + (["-m", model] if model else [])
    # --strict-model-name: a request naming another model (a path among them) stays one of the refused cases
    server = ServerProcess(args, log_path, key=KEY)
    try:
        vocab = server.request("GET", "/v1/models").json()["data"][0]["meta"]["n_vocab"]
        rng = random.Random(seed)
        cases = reference(server, make_cases(rng, n_cases, vocab, n_ctx))
        warm, _ = run_clients(server, cases, clients, warmup, seed + 1, n_ctx, vocab)
        wait_idle(server)
        rss_start = server.rss()
        t0 = time.time()
        tally, clock = run_clients(server, cases, clients, seconds, seed + 2, n_ctx, vocab)
        wall = time.time() - t0
        slots = wait_idle(server)
        rss_end = server.rss()
        kv, kv_failures = kv_checks(server, slots)
    finally:
        rc = server.stop()
    growth = (rss_end - rss_start) / rss_start
    failures = verdict([warm, tally], growth) + kv_failures
    return {"seconds": round(wall, 1), "paused_s": round(clock.paused, 1), "clients": clients, "n_ctx": n_ctx, "parallel": parallel, "threads": threads,
            "cases": n_cases, "requests": sum(tally.kinds.values()), "served": tally.served,
            "by_kind": dict(tally.kinds), "by_status": {str(k): v for k, v in sorted(tally.statuses.items(), key=str)},
            "ttft_p50_ms": _ms(percentile(tally.ttft, 50)), "ttft_p99_ms": _ms(percentile(tally.ttft, 99)),
            "itl_p50_ms": _ms(percentile(tally.itl, 50)), "itl_p99_ms": _ms(percentile(tally.itl, 99)),
            "slowest_request_s": round(tally.slowest, 2),
            "rss_start_mib": round(rss_start / 2**20, 1), "rss_end_mib": round(rss_end / 2**20, 1),
            "rss_growth_pct": round(100 * growth, 2), **kv, "server_exit": rc,
            "failures": failures, "passed": not failures}


def verdict(tallies: list[Tally], rss_growth: float) -> list[str]:
    """The pass criteria the clients' tallies and the RSS decide: what each client saw go wrong, no 5xx,
    RSS growth under 5%."""
    failures = [f for t in tallies for f in t.failures]
    five = Counter()
    for t in tallies:
        five.update({s: n for s, n in t.statuses.items() if isinstance(s, int) and s >= 500})
    if five:
        failures.append(f"5xx answers: {dict(five)}")
    if rss_growth >= 0.05:
        failures.append(f"RSS grew {100 * rss_growth:.1f}% after warm-up")
    return failures


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def markdown(r: dict) -> str:
    table = md_table(["figure", "value"], [(k, v) for k, v in r.items() if k != "failures"])
    return "\n".join([table, f"\nfailures: {len(r['failures'])}", *(f"- {f}" for f in r["failures"][:20])])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="model file (default: the built-in model)")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("-c", "--ctx-size", type=int, default=512)
    ap.add_argument("-np", "--parallel", type=int, default=4)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--cases", type=int, default=24, help="greedy requests with a reference answer")
    ap.add_argument("--warmup", type=float, default=15.0, help="seconds of load before RSS is read")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--expert-cache-slots", type=int, default=4,
                    help="expert cache slots per layer over the file's map; 0: experts in RAM, no cache")
    add(ap, "output")
    ap.add_argument("--log", type=Path, default=None, help="server log (default: a temporary file)")
    a = ap.parse_args(argv)
    log = a.log or Path(tempfile.mkdtemp(prefix="moerun-soak-")) / "serve.log"
    r = soak(a.model, a.seconds, a.clients, a.ctx_size, a.parallel, a.threads, a.cases, a.warmup, a.seed, log,
             a.expert_cache_slots)
    print(json.dumps(r, indent=1) if a.output == "json" else markdown(r))
    print(f"server log: {log}", file=sys.stderr)
    return 0 if r["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
