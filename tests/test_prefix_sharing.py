"""KV blocks shared between sequences by content (moerun.engine.blocks; issue 18, item 5): the allocator's
books, a second sequence adopting a first one's prompt blocks with a cold run's logits while the first goes on
unchanged, copy on write, and the scheduler giving a second slot the first slot's system prompt."""

import pytest
import torch

from moerun.config import RuntimeConfig, SamplingParams
from moerun.engine.blocks import BlockAllocator, block_hashes
from moerun.engine.kv_cache import KVPool, SeqKV
from moerun.engine.scheduler import Request, Scheduler
from moerun.runtime import build

BS = 16


def test_allocator_books():
    a = BlockAllocator(4)
    x = a.allocate(2)
    assert x == [0, 1] and a.n_free == 2
    h = block_hashes(list(range(32)), BS)
    a.publish(x[0], h[0])
    a.publish(x[1], h[1])
    a.free(x)
    assert a.n_free == 4 and a.n_cached == 2
    assert a.peek(h) == 2 and a.lookup(h) == [0, 1] and a.n_free == 2  # held again, out of the free blocks
    a.free([0, 1])
    assert a.allocate(2) == [2, 3]  # blocks holding nothing go first ...
    assert a.allocate(1) == [1] and a.peek(h) == 1  # ... then a cached prefix, from its end (it needs its start)
    assert block_hashes(list(range(32)), BS)[1] != block_hashes([0] + list(range(1, 32)), BS)[0]


@pytest.fixture(scope="module")
def model():
    return build(RuntimeConfig(ctx_size=256, threads=1)).engine.model


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_second_sequence_adopts_the_first_ones_prompt_blocks(model):
    pool = KVPool(model.spec, 8 * 64, seqs=4)
    assert pool.share
    system, a_tail, b_tail = prompt(40, 0), prompt(9, 1), prompt(7, 2)
    a = SeqKV(pool, 128)
    model.forward(torch.tensor(system + a_tail), a)
    a.publish(system + a_tail)
    b = SeqKV(pool, 128)
    assert b.adopt(system + b_tail) and b.length == 32 and b.blocks == a.blocks[:2]  # two whole blocks
    got = model.forward(torch.tensor((system + b_tail)[32:]), b)
    cold = model.forward(torch.tensor(system + b_tail))[32:]
    assert (got - cold).abs().max().item() < 1e-4
    steps_a = torch.cat([model.forward(torch.tensor([t]), a) for t in (5, 6, 7)])
    alone = SeqKV(KVPool(model.spec, 128), 128)
    model.forward(torch.tensor(system + a_tail), alone)
    steps_alone = torch.cat([model.forward(torch.tensor([t]), alone) for t in (5, 6, 7)])
    assert torch.equal(steps_a, steps_alone)  # the shared blocks were not written


def test_writing_into_a_shared_block_copies_it(model):
    pool = KVPool(model.spec, 8 * 64, seqs=4)
    toks = prompt(40, 3)
    a = SeqKV(pool, 128)
    model.forward(torch.tensor(toks), a)
    a.publish(toks)
    b = SeqKV(pool, 128)
    assert b.adopt(toks) and b.length == 32
    b.truncate(20)  # ends inside a shared block: b gets its own copy
    assert b.length == 20 and b.blocks[0] == a.blocks[0] and b.blocks[1] != a.blocks[1]
    before = pool.layer(0)[0][a.blocks[1] * BS:(a.blocks[1] + 1) * BS].clone()
    model.forward(torch.tensor(prompt(6, 4)), b)
    assert torch.equal(pool.layer(0)[0][a.blocks[1] * BS:(a.blocks[1] + 1) * BS], before)


def test_a_second_slot_reuses_the_first_slots_system_prompt():
    engine = build(RuntimeConfig(ctx_size=256, ubatch=64, threads=1)).engine
    tok = engine.tokenizer
    system = tok.encode("You are a careful assistant. Answer in one short line. " * 4)
    params = SamplingParams.greedy(max_tokens=6, ignore_eos=True)
    sched = Scheduler(engine, parallel=2)

    def run(*reqs):
        for r in reqs:
            sched.submit(r)
        while sched.has_work():
            sched.step()

    first = Request(system + tok.encode("Q: 2+2?"), params)
    run(first)
    b, c = Request(system + tok.encode("Q: name a color"), params), Request(system + tok.encode("Q: a city?"), params)
    run(b, c)
    assert {b.slot, c.slot} == {0, 1}
    other = c if c.slot != first.slot else b
    assert other.timings.cache_n >= len(system) // 16 * 16 - 16 > 0  # whole blocks of the system prompt
    cold = Scheduler(build(RuntimeConfig(ctx_size=256, ubatch=64, threads=1)).engine, parallel=1)
    again = Request(other.prompt, params, cache_prompt=False)
    cold.submit(again)
    while cold.has_work():
        cold.step()
    assert again.timings.cache_n == 0 and again.tokens == other.tokens
    snap = sched.snapshot()
    assert snap.prefix_hits >= b.timings.cache_n + c.timings.cache_n and snap.prefix_queries == sum(
        len(r.prompt) for r in (first, b, c))


def test_no_sharing_with_rings_or_recurrent_states(tmp_path):
    from moerun.tools.make_model import make_model

    for name in ("tiny-gptoss", "tiny-qwen3next"):
        path = make_model(name, tmp_path / f"{name}.gguf", progress=False)
        spec = build(RuntimeConfig(model=str(path), threads=1)).engine.model.spec
        pool = KVPool(spec, 4 * 64, seqs=2)
        assert not pool.share and not SeqKV(pool, 64).adopt(list(range(40)))
