"""The expert cache changes where experts are read from, never the result."""

import pytest
import torch
from hf_models import FAMILIES

from moerun.engine.kv_cache import KVPool, SeqKV
from moerun.experts.cache import ExpertCache
from moerun.experts.store import ExpertStore
from moerun.loading import load_model
from moerun.model.moe import CachedExperts, ResidentExperts

TOKENS = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(3))


def run_steps(model):
    """A 16-token prefill, then 8 single-token decode steps: logits of every step."""
    kv = SeqKV(KVPool(model.spec, 64), 64)
    out = [model.forward(TOKENS[:16], kv)]
    out += [model.forward(TOKENS[i:i + 1], kv) for i in range(16, 24)]
    return torch.cat(out)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru"])
@pytest.mark.parametrize("slots,prefill", [(1, "bypass"), (1, "cache"), (3, "cache"), (8, "bypass")])
def test_cached_logits_equal_resident(hf_model, family, policy, slots, prefill):
    _, folder = hf_model(family)
    model = load_model(folder).model
    ref = run_steps(model)
    cache = ExpertCache(model.store, slots=slots, policy=policy, prefill=prefill)
    model.experts = CachedExperts(cache)
    got = run_steps(model)
    assert torch.equal(got, ref)
    st = cache.stats
    decode = st.get(phase="decode")
    assert decode.queries > 0 and decode.hits + decode.misses == decode.queries
    if slots == 1:
        assert decode.evictions > 0 and decode.bytes_paged_in > 0
    if prefill == "bypass":
        assert st.get(phase="prefill").bytes_paged_in == 0


def test_owned_store_equals_mmap_store(hf_model):
    _, folder = hf_model("qwen2moe")
    model = load_model(folder).model
    ref = run_steps(model)
    s = model.store
    owned = ExpertStore(*({i: s._stacks[i][j] for i in s.layers} for j in range(3)), owned=True)
    model.experts = ResidentExperts(owned)
    assert torch.equal(run_steps(model), ref)
    assert owned.total_bytes == s.total_bytes
