"""Batches of Q8_0 / MXFP4 rows through AMX tiles (kernels/csrc/amx.c): the int8 sums of 16 tokens x 16 rows a block
in one tile product, then the VNNI kernels' float steps. A batch through the tiles must give the VNNI kernels' bits
(so a token's logits never depend on the batch it came in), and both must stay within the activations' int8 rounding of
x @ W^T with W dequantized by gguf.quants (independent of moerun)."""

from __future__ import annotations

import pytest
import torch
from test_interleave import emulate_act, gguf_dequant, q4k

from moerun.kernels import cpu
from moerun.kernels.env import env_amx
from moerun.model.ops import ExpertFn
from moerun.quant.qtypes import QType

TILES = cpu.available() and cpu.features()["amx_usable"]
pytestmark = pytest.mark.skipif(not cpu.available(), reason="the CPU kernels are not built")
needs_tiles = pytest.mark.skipif(not TILES, reason="this CPU (or kernel) has no AMX-INT8 tiles")
TYPES = pytest.mark.parametrize("qt", [QType.Q8_0, QType.MXFP4, QType.Q4_K, QType.Q5_K], ids=lambda q: q.name)


def cols(qt: QType, n: int) -> int:
    """n, or the next whole number of a K-quant's 256-blocks."""
    return -(-n // 256) * 256 if qt in (QType.Q4_K, QType.Q5_K) else n


@pytest.fixture(autouse=True)
def tiles_default():
    yield
    cpu.set_amx(None)
    cpu.set_threads(2)


def tiles_ran(fn):
    """fn() -> (its result, whether any of its matrices went through the tiles)."""
    before = cpu._cpu.features()["amx_calls"]
    out = fn()
    return out, cpu._cpu.features()["amx_calls"] > before


@needs_tiles
@TYPES
@pytest.mark.parametrize("N,K,T", [(48, 64, 17), (64, 96, 40), (32, 2880, 16), (80, 256, 70), (16, 32, 15)])
def test_a_batch_through_the_tiles_gives_the_vnni_bits(qt, N, K, T):
    K = cols(qt, K)
    w = q4k(N, K, qt=qt, seed=N + T)
    il = cpu.interleave(w)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(T))
    cpu.set_amx(False)
    vnni, ran = tiles_ran(lambda: cpu.matmul(x, il))
    assert not ran
    cpu.set_amx(True)
    tiles, ran = tiles_ran(lambda: cpu.matmul(x, il))
    assert ran == (T >= 16)
    assert torch.equal(tiles, vnni)
    ref = emulate_act(x, qt) @ gguf_dequant(w).T
    assert float((tiles.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    # one token at a time (the one-token kernels) gives the same bits as the batch
    assert torch.equal(torch.cat([cpu.matmul(x[t:t + 1], il) for t in range(T)]), tiles)


@needs_tiles
@TYPES
def test_the_tiles_do_not_depend_on_the_thread_count(qt):
    w = q4k(96, cols(qt, 192), qt=qt)
    il = cpu.interleave(w)
    x = torch.randn(50, w.shape[1])
    cpu.set_amx(True)
    cpu.set_threads(1)
    one = cpu.matmul(x, il)
    cpu.set_threads(2)
    assert torch.equal(cpu.matmul(x, il), one)


@needs_tiles
@TYPES
@pytest.mark.parametrize("oai", [False, True], ids=["swiglu", "gpt-oss"])
def test_experts_many_tokens_chose_give_the_vnni_bits(qt, oai):
    E, I, H, T, k = 4, cols(qt, 96), cols(qt, 64), 61, 2
    G, U, D = q4k(I, H, qt=qt, lead=(E,), seed=1), q4k(I, H, qt=qt, lead=(E,), seed=2), q4k(H, I, qt=qt, lead=(E,), seed=3)
    Gi, Ui, Di = (cpu.interleave(w) for w in (G, U, D))
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(T, H, generator=gen)
    # expert 0: 5 pairs (the VNNI kernels), 1..3: 16 or more (the tiles; not whole tiles of 16)
    first = torch.tensor([0] * 5 + [1] * 16 + [2] * 19 + [3] * 21)[torch.randperm(T, generator=gen)]
    ids = torch.stack([first, (first + 1 + torch.randint(0, E - 1, (T,), generator=gen)) % E], 1).int()
    wts = torch.rand(T, k, generator=gen) + 0.5
    fn = (ExpertFn(act="swiglu_oai", biases=tuple(torch.randn(E, n, generator=gen) * 0.1 for n in (I, I, H)))
          if oai else ExpertFn())
    cpu.set_amx(False)
    vnni = cpu.moe_ffn(x, ids, wts, Gi, Ui, Di, fn=fn)
    cpu.set_amx(True)
    tiles, ran = tiles_ran(lambda: cpu.moe_ffn(x, ids, wts, Gi, Ui, Di, fn=fn))
    assert ran and torch.equal(tiles, vnni)
    # and each token alone (no expert has 16 tokens then: the VNNI kernels throughout)
    alone, ran = tiles_ran(lambda: torch.cat([cpu.moe_ffn(x[t:t + 1], ids[t:t + 1], wts[t:t + 1], Gi, Ui, Di, fn=fn)
                                              for t in range(T)]))
    assert not ran and torch.equal(alone, tiles)


def test_the_switch(monkeypatch):
    cpu.set_amx(False)
    assert cpu.features()["amx"] is False
    cpu.set_amx(None)
    assert cpu.features()["amx"] is TILES  # on by default wherever the tiles are usable
    with pytest.raises(ValueError):
        cpu.set_amx(2)
    for value, want in (("0", 0), ("1", -1), ("auto", -1), ("", -1)):
        monkeypatch.setenv("MOERUN_AMX", value)
        assert env_amx() == want
    monkeypatch.setenv("MOERUN_AMX", "yes")
    with pytest.warns(UserWarning, match="MOERUN_AMX"):
        assert env_amx() == -1
