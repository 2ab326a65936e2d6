"""Whole decode layers in C (attention, routing and the routed experts in one call per layer, a run of them in
one call: moerun/kernels/csrc/attn.c qk_decode_layers, moerun/model/fused.py) against the per-layer path, where
Python runs the experts between kernel calls (itself tied to the torch reference in test_fused_decode.py)."""

from __future__ import annotations

import pytest
import torch

from moerun.engine.kv_cache import KVPool, SeqKV
from moerun.experts.cache import ExpertCache
from moerun.loading import load_model
from moerun.model.moe import CachedExperts, ResidentExperts
from moerun.tools.convert import convert_hf_to_gguf

cpu = pytest.importorskip("moerun.kernels.cpu")
kl = pytest.importorskip("moerun.kernels.layer")
pytestmark = pytest.mark.skipif(not cpu.available(), reason="CPU kernels not built")


@pytest.fixture(scope="module")
def q8_model(hf_model, tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            _, folder = hf_model(family)
            path = convert_hf_to_gguf(folder, tmp_path_factory.mktemp(family) / "m.gguf", ftype="Q8_0", progress=False)
            cache[family] = load_model(path).model
        return cache[family]

    return get


def prefill(model, tokens) -> SeqKV:
    kv = SeqKV(KVPool(model.spec, 64), 64)
    model.forward(tokens[:10], kv)
    return kv


def steps(model, kv, tokens, n=6):
    """n one-token steps after the prefill -> their logits [n, V]."""
    return torch.cat([model.forward(t.view(1), kv) for t in tokens[10:10 + n]])


def decode_steps(model, tokens, n=6):
    return steps(model, prefill(model, tokens), tokens, n)


class Forbidden:
    def __init__(self, what):
        self.what = what

    def __call__(self, *a, **k):
        raise AssertionError(f"{self.what} ran in Python: the whole-layer path was not taken")


@pytest.mark.parametrize("family", ["qwen3moe", "qwen2moe", "mixtral", "olmoe"])
def test_whole_layers_equal_the_per_layer_path(q8_model, tokens32, family, monkeypatch):
    model = q8_model(family)
    assert all(model.fused.whole(j) for j in range(len(model.layers)))
    routes = []
    model.on_route = lambda layer, phase, pos, ids, w: routes.append((layer, phase))  # forces per-layer steps
    per_layer = decode_steps(model, tokens32)
    assert ("decode" in {p for _, p in routes}) and len({la for la, _ in routes}) == len(model.layers)
    model.on_route = None
    kv = prefill(model, tokens32)  # a 10-token step: the torch path
    with monkeypatch.context() as m:
        m.setattr(model, "moe", Forbidden("the MoE block"))
        m.setattr(model, "_head", Forbidden("the head"))  # embeddings to logits in one call
        whole = steps(model, kv, tokens32)
    err = (whole - per_layer).abs().max().item()
    assert err < 1e-5, f"{family}: whole vs per-layer max abs {err:.2e}"


def test_an_expert_cache_sees_every_decode_step(q8_model, tokens32):
    model = q8_model("qwen3moe")
    resident = decode_steps(model, tokens32)
    cache = ExpertCache(model.store, slots=2)
    model.experts = CachedExperts(cache)
    try:
        cached = decode_steps(model, tokens32)
    finally:
        model.experts = ResidentExperts(model.store)
    assert cache.stats.get(phase="decode").queries == 6 * len(model.layers) * model.spec.n_experts_used
    assert (cached - resident).abs().max().item() < 1e-5


def test_layer_stacks_and_caches_are_checked(q8_model, tokens32):
    model = q8_model("qwen3moe")
    f = model.fused
    with pytest.raises(ValueError, match="experts"):
        kl.LayerStack([])
    part = model.fused.layers[0]  # the same layer without its experts: attention and routing only
    lw = model.layers[0]
    mixer = kl.Attention(n_heads=model.spec.n_heads, n_kv_heads=model.spec.n_kv_heads, head_dim=model.spec.head_dim,
                         wq=lw.wq, wk=lw.wk, wv=lw.wv, wo=lw.wo)
    part = kl.Layer(hidden=model.spec.hidden, attn_norm=lw.attn_norm, ffn_norm=lw.ffn_norm, attention=mixer,
                    router=lw.router, n_used=model.spec.n_experts_used)
    assert not part.whole
    with pytest.raises(ValueError, match="experts"):
        kl.LayerStack([part])
    kv = SeqKV(KVPool(model.spec, 64), 64)
    kv.reserve(1)
    rows = f.rows([kv], torch.tensor([0]))
    x = torch.zeros(1, model.spec.hidden)
    pool = kv.pool
    with pytest.raises(ValueError, match="layers"):  # one layer's caches for two layers
        f.decode_layers(0, 2, x, rows, pool.caches(0, 1))
    with pytest.raises(ValueError):
        f.decode_layers(0, 1, torch.zeros(2, model.spec.hidden), rows, pool.caches(0, 1))
    n = len(model.layers)
    f.decode_layers(0, n, x.clone(), rows, pool.caches(0, n))  # bound to the pool's caches
    for bad in (pool.n_slots, -1):  # a slot the caches do not hold, checked before anything is written
        table = kv.slot_table.clone()
        table[0] = bad
        before = [c.clone() for pair in pool.caches(0, n) for c in pair]
        with pytest.raises(ValueError, match="slot"):
            f.decode_layers(0, n, x.clone(), kl.AttnRows([table], torch.tensor([0]), rows.cos, rows.sin),
                            pool.caches(0, n))
        assert all(torch.equal(a, b) for a, b in zip(before, (c for pair in pool.caches(0, n) for c in pair)))
    small = KVPool(model.spec, 16)  # other caches: bound anew, and its 16 slots checked
    table = torch.arange(32)
    with pytest.raises(ValueError, match="slot"):
        f.decode_layers(0, n, x.clone(), kl.AttnRows([table], torch.tensor([20]), rows.cos, rows.sin),
                        small.caches(0, n))


def test_head_logits_match_the_reference(q8_model, tokens32):
    """The C head (rms_norm, then the head matmul) against torch's rms_norm and the dequantized head."""
    from moerun.model.layers import rms_norm

    model = q8_model("qwen3moe")
    x = torch.randn(5, model.spec.hidden, generator=torch.Generator().manual_seed(0))
    got = model.fused.head_logits(x)
    xn = rms_norm(x, model.out_norm, model.spec.rms_eps)
    w = model.head.dequantize() if hasattr(model.head, "dequantize") else model.head
    ref = (xn.double() @ w.double().T)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert ((got.double() - ref).norm() / ref.norm()).item() < 0.02  # the activations' 8-bit rounding
    same_kernel = model.ops.linear(xn, model.head).float()
    assert (got - same_kernel).abs().max().item() < 1e-4 * same_kernel.abs().max().item()


def shared_prefill(model, tokens, n=2) -> list[SeqKV]:
    """n sequences in one pool (a batched step needs its sequences' caches together), prefilled from tokens[i:]."""
    pool = KVPool(model.spec, 64 * n)
    kvs = [SeqKV(pool, 64) for _ in range(n)]
    for i, kv in enumerate(kvs):
        model.forward(tokens[i:i + 10], kv)
    return kvs


def test_a_step_from_token_ids_equals_a_step_from_embeddings(q8_model, tokens32, monkeypatch):
    """forward / decode from ids in one call (the embedding looked up in C) give what the step from torch's
    embeddings gives, bit for bit, for one sequence and for a batch."""
    model = q8_model("qwen3moe")
    assert model.fused.embd is not None
    with monkeypatch.context() as m:
        m.setattr(model, "embed", Forbidden("the embedding lookup"))
        ids = decode_steps(model, tokens32)
        kvs = shared_prefill(model, tokens32)
        ids_batch = [model.decode(tokens32[10 + j:12 + j], kvs) for j in range(3)]
    with monkeypatch.context() as m:
        m.setattr(model.fused, "embd", None)
        m.setattr(model.fused, "decode_tokens", Forbidden("the step from ids"))
        embeddings = decode_steps(model, tokens32)
        kvs = shared_prefill(model, tokens32)
        emb_batch = [model.decode(tokens32[10 + j:12 + j], kvs) for j in range(3)]
    assert torch.equal(ids, embeddings)
    assert all(torch.equal(a, b) for a, b in zip(ids_batch, emb_batch))


def test_a_token_outside_the_vocabulary_is_refused(q8_model, tokens32):
    model = q8_model("qwen3moe")
    kv = prefill(model, tokens32)
    pool, n = kv.pool, len(model.layers)
    before = [c.clone() for pair in pool.caches(0, n) for c in pair]
    for bad in (model.spec.vocab, -1):
        with pytest.raises(ValueError, match="token id"):
            model.forward(torch.tensor([bad]), kv)
    assert kv.length == 10
    assert all(torch.equal(a, b) for a, b in zip(before, (c for pair in pool.caches(0, n) for c in pair)))
    assert model.forward(tokens32[10:11], kv).shape == (1, model.spec.vocab)  # the sequence goes on
    with pytest.raises(ValueError, match="embedding"):
        kl.Embedding(model.embd, model.spec.hidden + 32)
