"""KV cache: cached decode equals a full recompute; blocks are reused; overflow is a clear error."""

import pytest
import torch

from moerun.engine.kv_cache import ContextOverflowError, KVPool, SeqKV
from moerun.loading import load_model


@pytest.mark.parametrize("family", ["qwen3moe", "mixtral"])
def test_cached_steps_equal_full_recompute(hf_model, family):
    _, folder = hf_model(family)
    model = load_model(folder).model
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(7))
    full = model.forward(tokens)  # [40, V]
    kv = SeqKV(KVPool(model.spec, 64, block_size=8), max_len=64)
    chunks = [tokens[:13], tokens[13:29], *tokens[29:].split(1)]  # two prefill chunks, then single steps
    got = torch.cat([model.forward(c, kv) for c in chunks])
    assert kv.length == 40
    assert (got - full).abs().max().item() < 1e-4


def test_overflow_and_block_reuse(hf_model):
    _, folder = hf_model("qwen3moe")
    model = load_model(folder).model
    pool = KVPool(model.spec, 32, block_size=8)
    kv = SeqKV(pool, max_len=32)
    model.forward(torch.arange(30), kv)
    with pytest.raises(ContextOverflowError, match="exceed the context size of 32"):
        model.forward(torch.arange(5), kv)
    assert kv.length == 30  # a failed step leaves the cache as it was
    kv.free()
    assert pool.allocator.n_free == pool.allocator.n_blocks
    other = SeqKV(pool, max_len=32)
    other.reserve(32)
    with pytest.raises(ContextOverflowError, match="KV cache full"):
        SeqKV(pool, max_len=32).reserve(1)


def test_scattered_blocks_read_the_same_as_consecutive_ones(hf_model):
    """A sequence whose blocks are not consecutive in the pool (gather path) gives the same logits."""
    _, folder = hf_model("olmoe")
    model = load_model(folder).model
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(9))
    pool = KVPool(model.spec, 128, block_size=8)
    a, b = SeqKV(pool, 64), SeqKV(pool, 64)
    out_a, out_b = [], []
    for chunk in tokens.split(4):  # interleave two sequences so their blocks alternate in the pool
        out_a.append(model.forward(chunk, a))
        out_b.append(model.forward(chunk, b))
    assert not a._contiguous and not b._contiguous
    solo = SeqKV(KVPool(model.spec, 64, block_size=8), 64)
    out_solo = [model.forward(chunk, solo) for chunk in tokens.split(4)]
    assert solo._contiguous
    assert torch.equal(torch.cat(out_a), torch.cat(out_b))
    assert (torch.cat(out_a) - torch.cat(out_solo)).abs().max().item() < 1e-5
