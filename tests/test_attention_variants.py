"""Shared attention layers against transformers: YaRN frequencies, partial rotary, attention sinks, sliding
windows (moerun.model.layers)."""

from __future__ import annotations

import pytest
import torch

from moerun.arch.spec import Yarn
from moerun.model.layers import apply_rope, attend, rope_frequencies, rope_tables


@pytest.mark.parametrize("kw", [{"factor": 32.0, "original": 4096, "bf": 32.0, "bs": 1.0, "truncate": False},
                                {"factor": 40.0, "original": 4096, "bf": 32.0, "bs": 1.0, "truncate": True,
                                 "mscale": 1.0, "mscale_all_dim": 1.0}])
def test_yarn_frequencies_match_transformers(kw):
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": kw["factor"],
              "original_max_position_embeddings": kw["original"], "beta_fast": kw["bf"], "beta_slow": kw["bs"],
              "truncate": kw["truncate"]}
    if "mscale" in kw:
        params |= {"mscale": kw["mscale"], "mscale_all_dim": kw["mscale_all_dim"]}
    cfg = PretrainedConfig(hidden_size=512, num_attention_heads=8, head_dim=64, max_position_embeddings=131072,
                           rope_parameters=params)
    ref, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    y = Yarn(kw["factor"], kw["original"], kw["bf"], kw["bs"], factor, kw["truncate"])
    assert torch.allclose(rope_frequencies(64, 150000.0, y), ref, rtol=1e-6, atol=0)
    cos, sin = rope_tables(torch.arange(5), 64, 150000.0, y)
    freqs = torch.arange(5).float()[:, None] * ref[None]
    assert torch.allclose(cos, freqs.cos() * factor, atol=1e-6) and torch.allclose(sin, freqs.sin() * factor, atol=1e-6)


def test_partial_rotary_rotates_the_first_dims_only():
    x = torch.randn(3, 2, 16)
    cos, sin = rope_tables(torch.tensor([0, 5, 9]), 8, 10000.0)
    out = apply_rope(x, cos, sin, "neox")
    assert torch.equal(out[..., 8:], x[..., 8:])
    assert torch.allclose(out[..., :8], apply_rope(x[..., :8], cos, sin, "neox"))
    assert not torch.allclose(out[1:, :, :8], x[1:, :, :8])


def test_sinks_match_gpt_oss_eager_attention():
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    T, nh, nkv, D = 7, 4, 2, 8
    torch.manual_seed(0)
    q, k, v = torch.randn(T, nh, D), torch.randn(T, nkv, D), torch.randn(T, nkv, D)
    sinks = torch.randn(nh)
    pos = torch.arange(T)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    module = SimpleNamespace(num_key_value_groups=nh // nkv, sinks=sinks, training=False)
    ref, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None], mask, scaling=D**-0.5)
    got = attend(q, k, v, pos, pos, sinks=sinks)
    assert torch.allclose(got, ref[0].reshape(T, nh * D), atol=1e-6)
    assert not torch.allclose(got, attend(q, k, v, pos, pos), atol=1e-3)  # the sinks change the result


@pytest.mark.parametrize("T", [5, 40])  # the decode path and the SDPA path
def test_sliding_window_sees_the_last_positions_only(T):
    torch.manual_seed(1)
    S, W = 40, 6
    q, k, v = torch.randn(T, 2, 8), torch.randn(S, 2, 8), torch.randn(S, 2, 8)
    q_pos, k_pos = torch.arange(S - T, S), torch.arange(S)
    got = attend(q, k, v, q_pos, k_pos, window=W)
    for t in range(T):  # each query against exactly its window, unmasked
        p = int(q_pos[t])
        lo = max(0, p - W + 1)
        ref = attend(q[t:t + 1], k[lo:p + 1], v[lo:p + 1], q_pos[t:t + 1], k_pos[lo:p + 1])
        assert torch.allclose(got[t:t + 1], ref, atol=1e-5)


@pytest.mark.parametrize("window", [0, 50])
def test_long_prompt_with_sinks_in_query_blocks_matches_gpt_oss(window):
    """Past QUERY_BLOCK queries with sinks, attention goes a block of queries at a time against the keys the block
    sees: transformers' eager gpt-oss attention with its causal (and sliding) mask, 300 queries after 20 cached."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from moerun.model.layers import QUERY_BLOCK

    T, S, nh, nkv, D = 300, 320, 4, 2, 8
    assert T > 2 * QUERY_BLOCK
    torch.manual_seed(2)
    q, k, v = torch.randn(T, nh, D), torch.randn(S, nkv, D), torch.randn(S, nkv, D)
    sinks = torch.randn(nh)
    q_pos, k_pos = torch.arange(S - T, S), torch.arange(S)
    seen = k_pos[None, :] <= q_pos[:, None]
    if window:
        seen &= k_pos[None, :] > q_pos[:, None] - window
    mask = torch.zeros(T, S).masked_fill(~seen, float("-inf"))[None, None]
    module = SimpleNamespace(num_key_value_groups=nh // nkv, sinks=sinks, training=False)
    ref, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None], mask, scaling=D**-0.5)
    got = attend(q, k, v, q_pos, k_pos, sinks=sinks, window=window)
    assert torch.allclose(got, ref[0].reshape(T, nh * D), atol=1e-5)
