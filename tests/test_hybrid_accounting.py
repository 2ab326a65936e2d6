"""Hybrid models (linear-attention layers beside attention layers): the recurrent state and KV bytes per
sequence, the planner's figures for one and several contexts, serve's slot arithmetic, inspect and estimate on
a file."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from moerun.arch import FAMILIES, Arch, Source, expected_shapes, resolve
from moerun.arch.summary import sequence_bytes, summarize
from moerun.cli import main
from moerun.cli_serve import check_slots_fit
from moerun.errors import MoerunError
from moerun.formats import open_model
from moerun.formats.names import tensor_class
from moerun.formats.records import TensorRecord
from moerun.placement import costmodel as cm
from moerun.placement.devices import GPU, Inventory
from moerun.placement.planner import STATE_COPIES, Budgets, Plan, PlanError, plan
from moerun.quant.qtypes import QType, tensor_bytes
from moerun.tools.presets import preset

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10
LINEAR = {"attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_ba.weight",
          "ssm_norm.weight", "ssm_out.weight"}
# the tiny hybrid's figures: a linear layer keeps conv [96, 3] + state [4, 8, 16] float32; the attention layer
# 2 KV heads x 16 for keys and values per position
LAYER_STATE = (96 * 3 + 4 * 8 * 16) * 4  # 3200
STATE = 3 * LAYER_STATE  # 9600
KV_TOKEN_F32 = 2 * 2 * 16 * 4  # 256


def hybrid_spec(**changes):
    """tiny-qwen3moe made a Qwen3-Next-like hybrid: linear, linear, linear, full."""
    return replace(preset("tiny-qwen3moe"), n_layers=4, moe_layers=(True,) * 4,
                   layer_kinds=("linear", "linear", "linear", "full"), attn_gate=True, qk_norm="head",
                   ssm_conv=4, ssm_k_heads=2, ssm_v_heads=4, ssm_k_dim=8, ssm_v_dim=16, rope_dim=4,
                   family="qwen3next", shared_ffn=48, shared_gate=True, ssm_ba=True, **changes)


def next_80b(hybrid: bool = True):
    """Qwen3-Next-80B-A3B's shape: 48 layers (three linear to one full), hidden 2048, 16 heads / 2 KV heads
    x 256, linear layers of 16 key heads and 32 value heads of 128, conv 4; hybrid=False: all attention."""
    kinds = tuple("full" if (i + 1) % 4 == 0 else "linear" for i in range(48)) if hybrid else ()
    return replace(preset("tiny-qwen3moe"), family="qwen3next", n_layers=48, moe_layers=(True,) * 48,
                   hidden=2048, n_heads=16, n_kv_heads=2, head_dim=256, rope_dim=64, vocab=1024,
                   n_experts=512, n_experts_used=10, expert_ffn=512, shared_ffn=512, shared_gate=True,
                   attn_gate=True, qk_norm="head", layer_kinds=kinds, ssm_conv=4, ssm_k_heads=16,
                   ssm_v_heads=32, ssm_k_dim=128, ssm_v_dim=128, ssm_ba=True, context_length=262144)


def fake_arch(spec) -> Arch:
    """Records of the expected shapes, llama.cpp-like qtypes (experts Q4_K where rows allow, else Q8_0; float
    norms, router, vectors and conv1d; the rest Q8_0), no file."""
    sources = {}
    for cn, shape in expected_shapes(spec).items():
        cls = tensor_class(cn.kind)
        qt = (QType.F32 if cls in ("norms", "router") or len(shape) == 1 or shape[-1] % 32 else
              QType.Q4_K if cls == "routed_experts" and shape[-1] % 256 == 0 else QType.Q8_0)
        rec = TensorRecord(cn.gguf, qt, shape, Path("fake.gguf"), 0, tensor_bytes(qt, shape))
        sources[cn] = Source((rec,))
    return Arch(FAMILIES[spec.family], spec, sources)


def gpu(i: int, gib: float) -> GPU:
    return GPU(i, f"fake-{i}", int(gib * GiB), int(gib * GiB) - 300 * MiB, 4, 16, 256, 10000)


BIG_CPU = Inventory(64 * GiB, 60 * GiB, 8, 16, ("avx2",))
TWO_GPUS = Inventory(64 * GiB, 60 * GiB, 8, 16, ("avx2",), (gpu(0, 8), gpu(1, 8)))


# ------------------------------------------------------------------------------------------------ the spec


def test_state_and_kv_bytes_per_sequence():
    spec = hybrid_spec()
    assert spec.hybrid and [spec.linear(i) for i in range(4)] == [True, True, True, False]
    assert spec.state_layout(0).conv == (96, 3) and spec.state_layout(0).ssm == (4, 8, 16)
    assert spec.state_layout(3) is None and spec.kv_layout(0) is None
    assert spec.state_bytes() == STATE
    for positions in (1, 16, 4096, 1 << 20):  # fixed: it does not grow, whatever the KV type
        assert [spec.kv_bytes(i, positions, 2) for i in range(3)] == [LAYER_STATE] * 3
    assert spec.kv_bytes(0, 0, 4) == 0
    assert spec.kv_bytes(3, 100, 4) == 100 * KV_TOKEN_F32
    seq = sequence_bytes(spec, 4)
    assert (seq.kv_per_token, seq.window_bytes, seq.state_bytes) == (KV_TOKEN_F32, 0, STATE)
    assert (seq.kv_layers, seq.window_layers, seq.linear_layers) == (1, 0, 3)
    assert seq.at(4096) == sum(spec.kv_bytes(i, 4096, 4) for i in range(4)) == 4096 * 256 + STATE
    half = sequence_bytes(spec, 2)
    assert (half.kv_per_token, half.state_bytes) == (KV_TOKEN_F32 // 2, STATE)


def test_next_80b_state_and_kv_against_all_attention():
    """Per-sequence memory of Qwen3-Next-80B-A3B's shape against the same model, attention in every layer."""
    hyb, full = next_80b(), next_80b(hybrid=False)
    layer_state = (8192 * 3 + 32 * 128 * 128) * 4  # conv [2*16*128 + 32*128, 3] + state [32, 128, 128]
    assert hyb.state_bytes() == 36 * layer_state == 79_036_416  # 75.375 MiB
    for dtype, per_layer in ((2, 2 * KiB), (4, 4 * KiB)):  # keys and values of 2 heads x 256 per position
        assert sequence_bytes(hyb, dtype).kv_per_token == 12 * per_layer
        assert sequence_bytes(full, dtype).kv_per_token == 48 * per_layer
    rows = {}
    for dtype, name in ((2, "float16"), (4, "float32")):
        for ctx in (4096, 32768):
            h = sum(hyb.kv_bytes(i, ctx, dtype) for i in range(48))
            f = sum(full.kv_bytes(i, ctx, dtype) for i in range(48))
            assert h == sequence_bytes(hyb, dtype).at(ctx) and f == ctx * 48 * dtype * 1024
            rows[name, ctx] = (h / MiB, f / MiB)
    assert rows == {("float16", 4096): (171.375, 384.0), ("float16", 32768): (843.375, 3072.0),
                    ("float32", 4096): (267.375, 768.0), ("float32", 32768): (1611.375, 6144.0)}
    for (name, ctx), (h, f) in rows.items():  # shown with pytest -s
        print(f"next-80b {name} ctx {ctx}: hybrid {h:.3f} MiB (state 75.375 + KV {h - 75.375:.3f}), "
              f"all-attention {f:.1f} MiB, {f / h:.2f}x")
    # the planner's figures: attention KV per token; the state, live and checkpoint, per context
    p = plan(fake_arch(hyb), BIG_CPU, Budgets(ctx_size=32768, kv_dtype_bytes=2))
    assert p.kv_bytes_per_token == 24 * KiB and p.state_bytes_per_seq == STATE_COPIES * 79_036_416
    assert p.devices[0].kv_bytes == p.context_bytes() == 768 * MiB + 2 * 79_036_416


# ------------------------------------------------------------------------------------------------ summary


def test_summary_counts_the_linear_layers_tensors():
    spec = hybrid_spec()
    arch = fake_arch(spec)
    shapes = expected_shapes(spec)
    assert {cn.kind for cn in shapes if cn.layer == 0} >= LINEAR
    assert not {cn.kind for cn in shapes if cn.layer == 3} & (LINEAR - {"attn_gate.weight"})
    s = summarize(arch)
    assert s.total_params == sum(math.prod(x) for x in shapes.values())
    by = {cn: tensor_bytes(arch.sources[cn].records[0].qtype, x) for cn, x in shapes.items()}
    experts = sum(b for cn, b in by.items() if tensor_class(cn.kind) == "routed_experts")
    emb = by[next(cn for cn in by if cn.kind == "token_embd.weight")]
    linear = sum(b for cn, b in by.items() if cn.kind in LINEAR and spec.linear(cn.layer))
    assert linear > 0
    # every linear-layer tensor is read each token, as attention's are; one embedding row; k of E experts
    assert s.bytes_per_token == sum(by.values()) - experts - emb + emb // spec.vocab + round(experts * 2 / 8)
    expert_params = sum(math.prod(x) for cn, x in shapes.items() if tensor_class(cn.kind) == "routed_experts")
    assert s.active_params == s.total_params - expert_params + round(expert_params * 2 / 8)


# ------------------------------------------------------------------------------------------------ planner


def test_cpu_plan_separates_kv_per_token_from_state_per_sequence():
    arch = fake_arch(hybrid_spec())
    for dtype in (2, 4):
        p = plan(arch, BIG_CPU, Budgets(ctx_size=4096, kv_dtype_bytes=dtype))
        assert p.kv_bytes_per_token == KV_TOKEN_F32 * dtype // 4  # the one attention layer
        assert p.state_bytes_per_seq == STATE_COPIES * STATE  # float32 whatever the KV type
        d = p.devices[0]
        assert d.kv_bytes == 4096 * p.kv_bytes_per_token + STATE_COPIES * STATE == p.context_bytes()
        assert d.state_bytes == STATE_COPIES * STATE
        dense = sum(tensor_bytes(s.records[0].qtype, s.records[0].shape) for cn, s in arch.sources.items()
                    if tensor_class(cn.kind) != "routed_experts")
        assert d.dense_bytes == dense and p.ram_bytes == dense + d.kv_bytes + sum(
            tensor_bytes(s.records[0].qtype, s.records[0].shape) for cn, s in arch.sources.items()
            if tensor_class(cn.kind) == "routed_experts")
    two = plan(arch, BIG_CPU, Budgets(devices=("cpu", "cpu"), ctx_size=4096))  # layers 0-1 and 2-3
    assert [d.state_bytes for d in two.devices] == [STATE_COPIES * LAYER_STATE * n for n in (2, 1)]
    one = plan(arch, BIG_CPU, Budgets(ctx_size=4096))
    assert sum(d.kv_bytes for d in two.devices) == one.devices[0].kv_bytes
    assert Plan.from_json(json.loads(json.dumps(two.to_json()))) == two


@pytest.mark.parametrize("contexts", [1, 3])
def test_gpu_plan_holds_each_contexts_kv_and_state(contexts):
    arch = fake_arch(hybrid_spec())
    b = Budgets(devices=("cuda:0", "cuda:1"), ctx_size=2048, kv_dtype_bytes=2, kv_contexts=contexts,
                tensor_split=(1, 1))
    p = plan(arch, TWO_GPUS, b)
    assert [d.layers for d in p.devices] == [(0, 2), (2, 4)]
    first, second = p.devices
    assert first.kv_bytes == first.state_bytes == contexts * 2 * STATE_COPIES * LAYER_STATE  # linear, linear
    assert second.kv_bytes == contexts * (STATE_COPIES * LAYER_STATE + 2048 * KV_TOKEN_F32 // 2)
    assert second.state_bytes == contexts * STATE_COPIES * LAYER_STATE
    assert p.kv_bytes_per_token == KV_TOKEN_F32 // 2 and p.state_bytes_per_seq == STATE_COPIES * STATE
    assert p.totals()["kv_bytes"] == contexts * p.context_bytes()


def test_overflow_suggests_a_context_that_fits_beside_the_state():
    spec = next_80b()
    arch = fake_arch(replace(spec, n_experts=16, n_experts_used=2))
    small = Inventory(64 * GiB, 60 * GiB, 8, 16, ("avx2",),
                      (GPU(0, "fake-0", 3 * GiB, 3 * GiB, 4, 16, 256, 10000),))
    b = Budgets(devices=("cuda:0",), vram=8 * GiB, ctx_size=65536, kv_dtype_bytes=2, kv_contexts=2, ubatch=64)
    with pytest.raises(PlanError, match=r"it fits with -c (\d+) and no expert slots") as e:
        plan(arch, small, b)
    ctx = int(e.value.args[0].split("it fits with -c ")[1].split()[0])
    p = plan(arch, small, replace(b, ctx_size=ctx, vram=None, cache_slots=0))
    assert p.devices[0].used_bytes <= 3 * GiB
    assert p.devices[0].kv_bytes == 2 * (ctx * 24 * KiB + STATE_COPIES * spec.state_bytes())


# ------------------------------------------------------------------------------------------------ serve


def test_serve_slots_count_the_state_per_slot():
    arch = fake_arch(hybrid_spec())
    p = plan(arch, BIG_CPU, Budgets(ctx_size=4096))
    one = 4096 * p.kv_bytes_per_token + STATE_COPIES * STATE
    rest = p.ram_bytes - one
    check_slots_fit(replace(p, ram_budget=rest + 4 * one), 4)  # exactly four slots
    with pytest.raises(MoerunError, match="of KV cache and recurrent state") as e:
        check_slots_fit(replace(p, ram_budget=rest + 4 * one - 1), 4)
    msg = e.value.args[0]
    assert "-np 3 with -c 4096" in msg
    ctx = int(msg.split("-np 4 with -c ")[1].split()[0])
    assert 4 * (ctx * p.kv_bytes_per_token + STATE_COPIES * STATE) <= 4 * one - 1 < 4 * (
        (ctx + 1) * p.kv_bytes_per_token + STATE_COPIES * STATE)


# ------------------------------------------------------------------------------------------------ a file


@pytest.fixture(scope="module")
def hybrid_gguf(tmp_path_factory):
    from moerun.tools.make_model import make_model

    path = tmp_path_factory.mktemp("hybrid") / "hybrid.gguf"
    return make_model(hybrid_spec(), path, progress=False, threads=1)


def test_inspect_shows_the_layer_kinds_state_and_kv(hybrid_gguf):
    r = CliRunner().invoke(main, ["inspect", str(hybrid_gguf), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["family"] == "qwen3next" and d["layer_kinds"] == ["linear", "linear", "linear", "full"]
    assert d["linear_layers"] == 3
    assert d["linear_attention"] == {"key_heads": 2, "value_heads": 4, "key_dim": 8, "value_dim": 16,
                                     "conv_kernel": 4, "conv_dim": 96, "value_order": "grouped",
                                     "state_bytes_per_layer": LAYER_STATE}
    assert (d["kv_bytes_per_token"], d["kv_window_bytes"], d["state_bytes_per_seq"]) == \
        (KV_TOKEN_F32, 0, STATE)
    with open_model(hybrid_gguf) as mf:
        s = summarize(resolve(mf))
    counted = sum(math.prod(x) for x in expected_shapes(hybrid_spec()).values())
    assert d["total_params"] == s.total_params == counted
    assert (d["active_params"], d["bytes_per_token"]) == (s.active_params, s.bytes_per_token)
    text = CliRunner().invoke(main, ["inspect", str(hybrid_gguf)]).output
    assert "4 (4 MoE; 3 linear attention, 1 full attention)" in text
    assert "gated DeltaNet on 3 of 4 layers: 2 key heads x 8, 4 value heads x 16, conv kernel 4" in text
    assert "on 4 of 16 dims; full attention on 1 of 4 layers; output gate" in text
    assert "256 B per token over 1 layer (float32); recurrent state 9.38 KiB per sequence over 3 layers" \
        in text


def test_inspect_of_a_windowed_model_has_no_state(tmp_path):
    from moerun.tools.make_model import make_model

    spec = preset("tiny-gptoss")
    path = make_model(spec, tmp_path / "gptoss.gguf", progress=False, threads=1, shape_only=True)
    d = json.loads(CliRunner().invoke(main, ["inspect", str(path), "--json"]).output)
    assert d["layer_kinds"] == ["sliding", "full"]
    assert d["linear_layers"] == 0 and d["linear_attention"] is None
    assert (d["kv_bytes_per_token"], d["state_bytes_per_seq"]) == (KV_TOKEN_F32, 0)  # the full layer's
    assert d["kv_window_bytes"] == spec.kv_bytes(0, spec.context_length, 4) == spec.kv_layout(0).held(
        spec.context_length) * KV_TOKEN_F32
    text = CliRunner().invoke(main, ["inspect", str(path)]).output
    assert "256 B per token over 1 layer (float32); 12.00 KiB per sequence in the windows of 1 layer" in text


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOERUN_CACHE", str(tmp_path / "cache"))


def _estimate(path, *args) -> dict:
    r = CliRunner().invoke(main, ["estimate", str(path), "--no-measure", "--json", "--device", "cpu",
                                  "-t", "1", "--ram-bw", "10", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_estimate_reads_and_writes_the_state_each_token(hybrid_gguf, cache):
    d = _estimate(hybrid_gguf)
    with open_model(hybrid_gguf) as mf:
        s = summarize(resolve(mf))
    by = d["bytes_per_token_by_class"]
    assert by["recurrent_state"] == 2 * STATE  # read once, written once, float32
    assert d["bytes_per_token"] == pytest.approx(s.bytes_per_token + 2 * STATE, abs=4)
    assert (d["kv_bytes_per_token"], d["state_bytes_per_seq"]) == (KV_TOKEN_F32, STATE_COPIES * STATE)
    mem = d["memory"]["devices"][0]
    assert mem["state_bytes"] == STATE_COPIES * STATE
    assert mem["kv_bytes"] == 4096 * KV_TOKEN_F32 + STATE_COPIES * STATE
    # the bound: every byte, the state's too, at the given 10 GB/s
    assert d["decode"]["bound"]["total_s"] == pytest.approx(d["bytes_per_token"] / 10e9, rel=1e-4)
    four = _estimate(hybrid_gguf, "-b", "4")
    assert four["bytes_per_token_by_class"]["recurrent_state"] == 4 * 2 * STATE  # each sequence its own state
    assert four["bytes_per_token_by_class"]["attention"] == by["attention"]  # the weights once per step
    text = CliRunner().invoke(main, ["estimate", str(hybrid_gguf), "--no-measure", "--device", "cpu"]).output
    assert "weights and recurrent state read per token" in text and "recurrent_state" in text
    assert "with recurrent state 18.75 KiB" in text


def test_prefill_runs_the_delta_rule_in_the_linear_layers(hybrid_gguf):
    with open_model(hybrid_gguf) as mf:
        arch = resolve(mf)
    spec = arch.spec
    p = plan(arch, BIG_CPU, Budgets(ctx_size=4096))
    w = cm.workload(arch, p)
    assert w.linear == (True, True, True, False) and w.state_flops == cm.state_flops(spec) > 0
    assert cm.state_flops(spec) == 4 * (6 * 8 * 16 + 4 * 64 * 8 + 2 * 64 * 16) + 2 * 96 * 4
    assert [x.layer for x in w.parts if x.cls == cm.STATE_CLASS] == [0, 1, 2]
    zero = cm.Figure(0, "default")
    rates = cm.Rates(cm.Figure(10, "given"), cm.Figure(1, "given"), zero, zero, cm.Figure(1e9, "default"),
                     cm.Figure(2e9, "default"))
    attn = replace(w, linear=(), state_flops=0.0)  # the same weights, attention's FLOPs in every layer
    n, ub = 600, 512
    diff = sum(3 * (m * w.state_flops - 4 * spec.n_heads * spec.head_dim * m * (done + (m + 1) / 2)) / 2e9
               for done, m in ((0, 512), (512, 88)))
    assert cm.prefill_time(w, rates, n, ub).compute - cm.prefill_time(attn, rates, n, ub).compute == \
        pytest.approx(diff)
