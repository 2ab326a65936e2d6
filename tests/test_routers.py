"""The router variants (moerun.model.moe.route) against transformers' own routers: DeepSeek-V2's softmax
(greedy and group-limited), DeepSeek-V3's sigmoid with correction bias and group-limited top-k, gpt-oss's
top-k of biased logits then softmax. Same experts, same weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moerun.arch.spec import ModelSpec
from moerun.model.moe import route
from moerun.model.ops import ReferenceOps

E, K, H, T = 16, 4, 32, 24


def spec(**kw) -> ModelSpec:
    base = {"family": "x", "n_layers": 1, "hidden": H, "n_heads": 4, "n_kv_heads": 4, "head_dim": 8, "vocab": 64,
            "n_experts": E, "n_experts_used": K, "expert_ffn": 16, "moe_layers": (True,)}
    return ModelSpec(**(base | kw))


def same(w, ids, ref_w, ref_ids):
    """Equal as sets of (expert, weight) per token (the order of the k choices may differ)."""
    for t in range(ids.shape[0]):
        got = dict(zip(ids[t].tolist(), w[t].tolist()))
        want = dict(zip(ref_ids[t].tolist(), ref_w[t].tolist()))
        assert got.keys() == want.keys(), t
        assert all(abs(got[e] - want[e]) < 1e-6 for e in got), t


@pytest.mark.parametrize("method,groups", [("greedy", 1), ("group_limited_greedy", 4)])
def test_deepseek_v2_softmax(method, groups):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, topk_method=method,
                           n_group=groups, topk_group=2, routed_scaling_factor=1.5)
    torch.manual_seed(0)
    hf = DeepseekV2TopkRouter(cfg)
    torch.nn.init.normal_(hf.weight)
    x = torch.randn(T, H)
    _, ref_w, ref_ids = hf(x)
    s = spec(norm_topk=False, n_groups=groups, topk_groups=2 if groups > 1 else 1, routed_scale=1.5)
    w, ids = route(ReferenceOps(), x, SimpleNamespace(router=hf.weight.data, router_b=None, score_b=None), s)
    same(w, ids, ref_w, ref_ids)


def test_deepseek_v3_sigmoid_groups_bias():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, norm_topk_prob=True)
    torch.manual_seed(1)
    hf = DeepseekV3TopkRouter(cfg)
    torch.nn.init.normal_(hf.weight)
    hf.e_score_correction_bias.normal_()  # large enough to change choices
    x = torch.randn(T, H)
    _, ref_w, ref_ids = hf(x)
    s = spec(router="sigmoid", score_bias=True, n_groups=4, topk_groups=2, group_score="top2", routed_scale=2.5)
    lw = SimpleNamespace(router=hf.weight.data, router_b=None, score_b=hf.e_score_correction_bias.data)
    w, ids = route(ReferenceOps(), x, lw, s)
    same(w, ids, ref_w, ref_ids)
    no_bias = route(ReferenceOps(), x, SimpleNamespace(router=hf.weight.data, router_b=None, score_b=None), s)[1]
    assert not torch.equal(no_bias.sort(-1).values, ids.sort(-1).values)  # the bias matters to the choice


def test_gpt_oss_topk_then_softmax():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    cfg = GptOssConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=K)
    torch.manual_seed(2)
    hf = GptOssTopKRouter(cfg)
    torch.nn.init.normal_(hf.weight)
    torch.nn.init.normal_(hf.bias)
    x = torch.randn(T, H)
    _, ref_w, ref_ids = hf(x)
    lw = SimpleNamespace(router=hf.weight.data, router_b=hf.bias.data, score_b=None)
    w, ids = route(ReferenceOps(), x, lw, spec(router="topk_softmax", router_bias=True))
    same(w, ids, ref_w, ref_ids)


def test_groups_must_divide_the_experts():
    with pytest.raises(ValueError, match="groups"):
        spec(n_groups=3, topk_groups=1)
    with pytest.raises(ValueError, match="groups"):
        spec(n_groups=4, topk_groups=5)
