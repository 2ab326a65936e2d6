"""The expert cache changes where experts are read from, never the result."""

import os
import shutil
from pathlib import Path

import pytest
import torch
from hf_models import FAMILIES

from moerun.engine.kv_cache import KVPool, SeqKV
from moerun.errors import ModelFormatError
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
@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru", "arc"])
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


# The home tier read through the file (os.preadv): a GGUF loaded with its experts in the memory map.
GGUF = Path(__file__).parent.parent / "moerun" / "data" / "default-qwen3moe.gguf"


def mapped_model(path=GGUF):
    model = load_model(path, home="mmap").model
    assert model.store.reader is not None, "a GGUF store over the memory map reads misses from its file"
    return model


@pytest.mark.parametrize("slots,prefill", [(0, "bypass"), (1, "bypass"), (1, "cache"), (3, "cache"), (8, "bypass")])
def test_file_reads_equal_resident(slots, prefill):
    model = mapped_model()
    ref = run_steps(model)
    cache = ExpertCache(model.store, slots=slots, prefill=prefill)
    model.experts = CachedExperts(cache)
    assert torch.equal(run_steps(model), ref)
    if slots == 1:
        assert cache.stats.get(phase="decode").bytes_paged_in > 0


def test_file_reads_with_experts_of_different_sizes(hf_model, tmp_path):
    """Q4_K_M keeps some layers' down projections in Q6_K, so experts differ in size from layer to layer: the
    bypass scratch buffers, reused across layers, must fit each (a soak on a3b-L4 Q4_K_M found them short)."""
    from hf_models import build, hf_config, save

    from moerun.tools.convert import convert_hf_to_gguf

    cfg = hf_config("qwen3moe")
    cfg.hidden_size, cfg.moe_intermediate_size, cfg.head_dim, cfg.num_hidden_layers = 256, 256, 64, 8
    path = convert_hf_to_gguf(save(build("qwen3moe", config=cfg), tmp_path / "hf"), tmp_path / "m.gguf",
                              ftype="Q4_K_M", progress=False)
    model = mapped_model(path)
    store = model.store
    by_size = sorted(store.layers, key=store.expert_bytes)
    small, big = by_size[0], by_size[-1]
    assert store.expert_bytes(small) < store.expert_bytes(big), "the test needs experts of different sizes"
    cache = ExpertCache(store, slots=1, prefill="bypass")
    for layer, n in ((big, 2), (small, 4), (big, 4)):  # few big buffers, then more small ones, then more big
        for e, ex in cache._home(layer, list(range(n))).items():
            want = store.get(layer, e)
            for a, b in ((ex.gate, want.gate), (ex.up, want.up), (ex.down, want.down)):
                assert torch.equal(a.data, b.data)
    ref = run_steps(model)
    model.experts = CachedExperts(cache)
    assert torch.equal(run_steps(model), ref)


def test_file_reads_never_use_the_map():
    """Misses and bypasses come from the file, not the map: scribbling over the (copy-on-write, private) map
    after loading leaves the cached logits unchanged, and no fetched expert views the map."""
    model = mapped_model()
    ref = run_steps(model)
    store = model.store
    mapped = [(t.data.data_ptr(), t.data.data_ptr() + t.nbytes) for parts in store._stacks.values() for t in parts]
    for parts in store._stacks.values():
        for t in parts:
            t.data.fill_(0x55)
    cache = ExpertCache(store, slots=2, prefill="bypass")
    fetched = []
    model.experts = CachedExperts(cache)
    model.experts.fetch = lambda *a: fetched.append(out := cache.fetch(*a)) or out
    assert torch.equal(run_steps(model), ref)
    ptrs = [q.data.data_ptr() for out in fetched for ex in out.values() for q in (ex.gate, ex.up, ex.down)]
    assert ptrs and not any(lo <= p < hi for p in ptrs for lo, hi in mapped)


def test_file_truncated_while_paging_raises_clear_error(tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copy(GGUF, path)
    model = mapped_model(path)
    model.experts = CachedExperts(ExpertCache(model.store, slots=1))
    first = min(span.offset for parts in model.store.reader.spans.values() for span in parts)
    os.truncate(path, first + 1000)
    with pytest.raises(ModelFormatError, match="truncated: expert"):
        run_steps(model)


def test_store_in_ram_has_no_reader(hf_model):
    _, folder = hf_model("qwen2moe")
    store = load_model(folder).model.store
    assert store.reader is None
    assert ExpertStore(*({i: store._stacks[i][j] for i in store.layers} for j in range(3)), owned=True).reader is None
