"""The continuous-batching scheduler in process, on the built-in model: batched equals alone, prompts in
chunks between decode steps, cancellation frees KV blocks, the queue bound, slot prefix reuse, failures."""

import pytest
import torch

from moerun.config import RuntimeConfig, SamplingParams
from moerun.engine.engine import common_prefix
from moerun.engine.scheduler import QueueFullError, Request, Scheduler
from moerun.runtime import build

PROMPTS = ["def fib(n):", "import os\n", "class Foo:\n    def", "    return self.", "for i in range(",
           "x = [", "while True:\n", "# compute the"]


@pytest.fixture(scope="module")
def engine():
    return build(RuntimeConfig(ctx_size=256, ubatch=16, threads=1)).engine


@pytest.fixture
def scheduler(engine):
    made = []

    def make(**kw):
        made.append(Scheduler(engine, **kw))
        return made[-1]

    yield make
    for sched in made:  # give the pool back, so the next test's scheduler can size it
        for slot in sched.slots:
            slot.seq.free()


def alone(engine, prompt, params):
    gen = engine.generate(prompt, params).run()
    gen.seq.free()
    return gen.tokens, gen.text


def run(sched, *reqs):
    for r in reqs:
        sched.submit(r)
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
    return steps


def collect(req):
    req.events = []
    req.emit = req.events.append
    return req


def text_of(req):
    return "".join(e.text for e in req.events)


def test_batched_requests_get_what_they_would_get_alone(engine, scheduler):
    tok = engine.tokenizer
    params = [SamplingParams.greedy(max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True),
              SamplingParams.greedy(max_tokens=24, repeat_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=0, top_p=0.9, seed=3, max_tokens=20)]
    cases = [(tok.encode(p), params[i % len(params)]) for i, p in enumerate(PROMPTS)]
    expected = [alone(engine, ids, p) for ids, p in cases]
    sched = scheduler(parallel=8)
    reqs = [collect(Request(ids, p)) for ids, p in cases]
    steps = run(sched, *reqs)
    assert steps < sum(len(r.tokens) for r in reqs) / 4  # they really ran together
    for r, (tokens, text) in zip(reqs, expected):
        assert r.tokens == tokens and text_of(r) == text
        assert r.finish_reason in ("stop", "length") and r.events[-1].finish_reason == r.finish_reason
        assert r.timings.predicted_n == len(r.tokens) and r.timings.prompt_n == len(r.prompt)


def test_stop_string_and_eos_end_a_request(engine, scheduler):
    tok = engine.tokenizer
    ids = tok.encode(PROMPTS[0])
    _, text = alone(engine, ids, SamplingParams.greedy(max_tokens=24, ignore_eos=True))
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip()
    r = collect(Request(ids, SamplingParams.greedy(max_tokens=24, ignore_eos=True, stop=(stop,))))
    run(scheduler(parallel=2), r)
    assert r.finish_reason == "stop" and text_of(r) == text[:text.index(stop)]


def test_long_prompt_is_read_in_chunks_between_decode_steps(engine, scheduler):
    tok = engine.tokenizer
    sched = scheduler(parallel=2)
    a = collect(Request(tok.encode(PROMPTS[1]), SamplingParams.greedy(max_tokens=200, ignore_eos=True)))
    sched.submit(a)
    for _ in range(3):
        sched.step()
    long_prompt = tok.encode("def f(x):\n    return x * 2\n" * 12)[:150]
    b = collect(Request(long_prompt, SamplingParams.greedy(max_tokens=4, ignore_eos=True)))
    sched.submit(b)
    before = len(a.tokens)
    while b.t_first is None:
        sched.step()
    chunks = -(-len(long_prompt) // engine.ubatch)
    assert chunks >= 9
    assert len(a.tokens) - before >= chunks - 1  # a decoded on while b's prompt went in, chunk by chunk
    assert b.timings.prompt_n == len(long_prompt)
    a.cancel()
    run(sched)


def test_cancel_frees_the_slots_kv_blocks_and_others_continue(engine, scheduler):
    tok = engine.tokenizer
    sched = scheduler(parallel=2, max_queue=0)
    alloc = engine.pool.allocator
    assert alloc.n_free == alloc.n_blocks
    p = SamplingParams.greedy(max_tokens=40, ignore_eos=True)
    expected, _ = alone(engine, tok.encode(PROMPTS[2]), p)
    a = collect(Request(tok.encode(PROMPTS[0] * 8), SamplingParams.greedy(max_tokens=200, ignore_eos=True)))
    b = collect(Request(tok.encode(PROMPTS[2]), p))
    sched.submit(a)
    sched.submit(b)
    for _ in range(10):
        sched.step()
    slot_a = sched.slots[a.slot]
    assert slot_a.req is a and slot_a.kv.blocks and len(a.tokens) >= 8
    a.cancel()
    sched.step()
    assert a.finish_reason == "cancelled" and a.events[-1].finish_reason == "cancelled"
    assert slot_a.req is None and slot_a.kv.blocks == [] and slot_a.kv.length == 0
    held = sum(len(s.kv.blocks) for s in sched.slots)
    assert alloc.n_free == alloc.n_blocks - held
    run(sched)
    assert b.tokens == expected


def test_queue_bound(engine, scheduler):
    tok = engine.tokenizer
    sched = scheduler(parallel=2, max_queue=1)
    p = SamplingParams.greedy(max_tokens=3, ignore_eos=True)
    reqs = [Request(tok.encode(PROMPTS[i]), p) for i in range(3)]
    for r in reqs:
        sched.submit(r)
    with pytest.raises(QueueFullError, match="2 waiting|waiting"):
        sched.submit(Request(tok.encode(PROMPTS[3]), p))
    run(sched)
    assert all(r.finish_reason == "length" for r in reqs)
    late = Request(tok.encode(PROMPTS[3]), p)
    run(sched, late)
    assert late.finish_reason == "length"


def test_waiting_request_cancelled_before_it_starts(engine, scheduler):
    tok = engine.tokenizer
    sched = scheduler(parallel=1, max_queue=2)
    p = SamplingParams.greedy(max_tokens=5, ignore_eos=True)
    first, second = collect(Request(tok.encode(PROMPTS[0]), p)), collect(Request(tok.encode(PROMPTS[1]), p))
    sched.submit(first)
    sched.submit(second)
    second.cancel()
    run(sched)
    assert first.finish_reason == "length" and second.finish_reason == "cancelled" and second.tokens == []


def test_a_slot_keeps_its_prefix_for_the_next_request(engine, scheduler):
    tok = engine.tokenizer
    sched = scheduler(parallel=2)
    p = SamplingParams.greedy(max_tokens=8, ignore_eos=True)
    history = tok.encode("def add(a, b):\n    return a + b\n\n")
    first = Request(history, p)
    run(sched, first)
    follow = history + tok.encode("def sub(a, b):")
    second = Request(follow, p)
    run(sched, second)
    kept = common_prefix(history + first.tokens[:-1], follow)  # the slot also holds what first generated
    assert kept >= len(history)
    assert second.slot == first.slot and second.timings.cache_n == kept
    assert second.timings.prompt_n == len(follow) - kept
    expected, _ = alone(engine, follow, p)
    third = Request(follow, p, cache_prompt=False)
    run(sched, third)
    assert third.timings.cache_n == 0 and third.tokens == expected


def test_context_full_ends_with_length(engine, scheduler):
    tok = engine.tokenizer
    prompt = (tok.encode("x = 1\n") * 200)[:engine.ctx_size - 6]
    r = Request(prompt, SamplingParams.greedy(max_tokens=100, ignore_eos=True))
    expected, _ = alone(engine, prompt, r.params)
    run(scheduler(parallel=1), r)
    assert r.finish_reason == "length"
    assert len(r.tokens) == 7  # 6 fill the context; the 7th is sampled from the last position's logits
    assert r.tokens == expected


def test_a_failing_step_fails_its_requests_only(engine, scheduler, monkeypatch):
    tok = engine.tokenizer
    sched = scheduler(parallel=2)
    bad_prompt = tok.encode("this prompt breaks the model")
    real = engine.model.forward

    def forward(tokens, kv, *args, **kw):
        if len(tokens) == len(bad_prompt) and torch.equal(tokens, torch.tensor(bad_prompt)):
            raise RuntimeError("injected failure")
        return real(tokens, kv, *args, **kw)

    monkeypatch.setattr(engine.model, "forward", forward)
    p = SamplingParams.greedy(max_tokens=10, ignore_eos=True)
    bad, good = collect(Request(bad_prompt, p)), collect(Request(tok.encode(PROMPTS[4]), p))
    run(sched, bad, good)
    assert bad.finish_reason == "error" and "injected failure" in bad.events[-1].error
    assert sched.slots[bad.slot].kv.blocks == []
    assert good.finish_reason == "length" and len(good.tokens) == 10
