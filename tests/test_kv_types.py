"""KV cache types (issue 20, item 4): f16, bf16, q8_0 and q4_0 keys and values against float32 on the tiny
models of every family here, the planner's bytes, and bad types refused clearly."""

from __future__ import annotations

import pytest
import torch
from hf_models import FAMILIES

from moerun.config import RuntimeConfig
from moerun.engine.engine import Engine
from moerun.engine.kv_cache import KVPool
from moerun.loading import load_model
from moerun.runtime import plan_for
from moerun.text import Tokenizer

PROMPT = [5, 17, 300, 42, 99, 7, 256, 11, 3, 140, 77, 21, 8, 9, 400, 33] * 4
STEPS = [12, 99, 7, 256, 5, 31, 2, 8]
# relative RMS error of the logits (a prompt in two chunks, then steps) against float32 keys and values, what
# each type is allowed: about twice the most measured over these four models on 2026-12-02 (f16 2.4e-4 to
# 4.0e-4, bf16 1.8e-3 to 2.7e-3, q8_0 8.9e-3 to 3.6e-2, q4_0 9.5e-2 to 0.28). The values themselves round
# trip at 0.17% (bf16), 0.54% (q8_0) and 8.6% (q4_0) of their norm; these small random models' sharp
# attention amplifies that about five times.
BOUNDS = {"f16": 1e-3, "bf16": 6e-3, "q8_0": 8e-2, "q4_0": 0.5}


def logits(folder, kv_type):
    loaded = load_model(folder)
    eng = Engine(loaded.model, Tokenizer.from_model_file(loaded.file), ctx_size=256, kv_types=(kv_type, kv_type))
    seq = eng.new_sequence()
    out = [eng.model.forward(torch.tensor(PROMPT[:40]), seq.kv), eng.model.forward(torch.tensor(PROMPT[40:]), seq.kv)]
    out += [eng.model.forward(torch.tensor([t]), seq.kv) for t in STEPS]
    return torch.cat(out), eng.pool


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_kv_stays_near_float32(hf_model, family):
    _, folder = hf_model(family)
    ref, ref_pool = logits(folder, None)
    errs = {}
    for t, bound in BOUNDS.items():
        got, pool = logits(folder, t)
        errs[t] = ((got - ref).norm() / ref.norm()).item()
        assert errs[t] < bound, (t, errs)
        assert pool.k_type.name == t and not pool.plain
    assert errs["f16"] < errs["q8_0"] < errs["q4_0"]
    # bytes: q8_0 stores 34 bytes per 32 values, 0.53x f16's 64; q4_0 18
    f16 = logits(folder, "f16")[1].nbytes
    assert logits(folder, "q8_0")[1].nbytes / f16 == pytest.approx(34 / 64)
    assert logits(folder, "q4_0")[1].nbytes / f16 == pytest.approx(18 / 64)
    assert ref_pool.nbytes == 2 * f16


def test_blocks_are_gguf_quants_own():
    import gguf
    import numpy as np

    from moerun.engine.kv_types import KV_TYPES

    x = torch.randn(50, 2, 16, generator=torch.Generator().manual_seed(3))
    for name, qt in (("q8_0", gguf.GGMLQuantizationType.Q8_0), ("q4_0", gguf.GGMLQuantizationType.Q4_0)):
        t = KV_TYPES[name]
        stored = t.encode(x, torch.uint8)
        assert np.array_equal(stored.numpy(), gguf.quants.quantize(x.reshape(50, 32).numpy(), qt))
        back = torch.from_numpy(gguf.quants.dequantize(stored.numpy(), qt)).view(50, 2, 16)
        assert torch.equal(t.decode(stored, (2, 16), torch.float32), back)


def test_the_planner_counts_the_real_bytes(tmp_path):
    def per_token(**kw):
        return plan_for(RuntimeConfig(ctx_size=1024, **kw)).kv_bytes_per_token

    f32, f16, q8 = per_token(), per_token(cache_type_k="f16", cache_type_v="f16"), \
        per_token(cache_type_k="q8_0", cache_type_v="q8_0")
    assert f32 == 2 * f16
    assert q8 / f16 == pytest.approx(34 / 64, rel=0.01)
    mixed = per_token(cache_type_k="q8_0", cache_type_v="f16")
    assert mixed == pytest.approx((q8 + f16) / 2, rel=0.01)


def test_bad_types_are_one_clear_error(hf_model):
    with pytest.raises(ValueError, match="cache_type_k must be one of"):
        RuntimeConfig(cache_type_k="q5_1")
    model = load_model(hf_model("qwen3moe")[1]).model
    spec = model.spec
    with pytest.raises(ValueError, match="blocks of 32"):  # 2 KV heads x 16 = 32 values a row fit; 8 do not
        KVPool(type(spec)(**{**spec.__dict__, "head_dim": 4}), 64, kv_types=("q8_0", None))


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_the_fused_decode_path_reads_the_types_as_torch_does(tmp_path, kv):
    """Decode steps through the C block (moerun/kernels/csrc/attn.c reading halves or Q8_0 blocks) against the torch path
    over the same cache type: F32 weights (no activation rounding), head_dim 32 (whole Q8_0 blocks per head)."""
    from hf_models import build, hf_config, save

    config = hf_config("qwen3moe")
    config.head_dim = 32
    folder = save(build("qwen3moe", config=config), tmp_path / "hd32")
    out = {}
    for fused in (True, False):
        loaded = load_model(folder)
        eng = Engine(loaded.model, Tokenizer.from_model_file(loaded.file), ctx_size=256, kv_types=(kv, kv))
        if not fused:
            eng.model.fused = None
        seq = eng.new_sequence()
        eng.model.forward(torch.tensor(PROMPT), seq.kv)
        assert eng.model._fused_ok(1, [seq.kv]) == fused
        out[fused] = torch.cat([eng.model.forward(torch.tensor([t]), seq.kv) for t in STEPS])
    assert (out[True] - out[False]).abs().max().item() < 1e-4


def test_the_config_names_the_types_the_cache_has():
    from moerun.config import KV_CACHE_TYPES
    from moerun.engine.kv_types import KV_TYPES

    assert tuple(KV_TYPES) == KV_CACHE_TYPES
