"""Placement planner against made-up inventories: budgets, layer split, expert slots, overrides, JSON."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from moerun.arch import FAMILIES, Arch, Source, expected_shapes, resolve
from moerun.formats import open_model
from moerun.formats.names import CName, tensor_class
from moerun.formats.records import TensorRecord
from moerun.placement.devices import GPU, Inventory, detect, parse_cpu_features, parse_size
from moerun.placement.planner import (
    MASK_BYTES,
    Budgets,
    Plan,
    PlanError,
    attention_workspace_bytes,
    parse_device,
    parse_override,
    plan,
    workspace_bytes,
)
from moerun.quant.qtypes import QType, tensor_bytes
from moerun.tools.presets import preset

GiB, MiB = 1 << 30, 1 << 20


def fake_arch(spec) -> Arch:
    """An Arch whose sources are records of the right shapes and llama.cpp-like qtypes (no file)."""
    sources = {}
    for cn, shape in expected_shapes(spec).items():
        cls = tensor_class(cn.kind)
        qt = (QType.Q4_K if cls == "routed_experts" else QType.F32 if cls in ("norms", "router")
              else QType.Q8_0)
        rec = TensorRecord(cn.gguf, qt, shape, Path("fake.gguf"), 0, tensor_bytes(qt, shape))
        sources[cn] = Source((rec,))
    return Arch(FAMILIES["qwen3moe"], spec, sources)


def gpu(i: int, gib: float) -> GPU:
    return GPU(i, f"fake-{i}", int(gib * GiB), int(gib * GiB) - 300 * MiB, 4, 16, 256, 10000)


TWO_GPUS = Inventory(64 * GiB, 60 * GiB, 8, 16, ("avx2",), (gpu(0, 8), gpu(1, 24)))
ONE_GPU = Inventory(32 * GiB, 30 * GiB, 6, 12, ("avx2",), (gpu(0, 6),))
CPU_ONLY = Inventory(4 * GiB, 3 * GiB, 2, 2, ("avx2",))


@pytest.fixture(scope="module")
def a3b() -> Arch:
    return fake_arch(preset("a3b-L12"))


def nbytes(arch, pred) -> int:
    return sum(tensor_bytes(s.records[0].qtype, s.records[0].shape) for cn, s in arch.sources.items() if pred(cn))


def check_invariants(p: Plan, arch: Arch) -> None:
    covered = [i for d in p.devices for i in range(*d.layers)]
    assert covered == list(range(arch.spec.n_layers))  # contiguous, in order, each layer once
    for d in p.devices:
        assert d.used_bytes <= d.budget, d
        assert len(d.expert_slots) == d.layers[1] - d.layers[0]
        assert all(0 <= s <= arch.spec.n_experts for s in d.expert_slots)
        vram = sum(t.nbytes for t in p.tensors.values() if t.tier == "vram" and t.device == d.device)
        if d.device != "cpu":
            assert vram == d.dense_bytes
    assert p.ram_bytes <= p.ram_budget
    assert set(p.tensors) == {cn.gguf for cn in arch.sources}
    assert sum(t.nbytes for t in p.tensors.values()) == nbytes(arch, lambda cn: True)


def test_parse_size():
    assert parse_size("6GiB") == 6 * GiB
    assert parse_size("512MiB") == 512 * MiB
    assert parse_size("8G") == 8 * GiB
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4096") == 4096 and parse_size(" 2 gib ") == 2 * GiB
    for bad in ("", "GiB", "6 GiBs", "-1G", "1.2.3G"):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)


def test_detect_and_cpu_features():
    inv = detect(gpus=False)
    assert inv.ram_total >= inv.ram_available > 0 and inv.physical_cores >= 1 and inv.gpus == ()
    assert parse_cpu_features("flags\t: fpu sse4_2 avx avx2 avx512f avx512_vnni\n") == (
        "sse4_2", "avx", "avx2", "avx512f", "avx512_vnni")
    assert "neon" in parse_cpu_features("Features\t: fp asimd asimddp\n")
    assert detect().gpus == () or all(g.total_bytes > 0 for g in detect().gpus)  # never fails without NVIDIA
    g = gpu(0, 24)
    assert g.device == "cuda:0" and g.pcie_gbps == pytest.approx(31.5, rel=0.01)
    assert g.mem_bandwidth_gbps == pytest.approx(640.0)


def test_parse_override_and_devices():
    assert parse_override("exps=CPU") == (("exps", "cpu"),)
    assert parse_override(r"blk\.[0-3]\.ffn_.*_exps=CUDA1,attn=cpu") == (
        (r"blk\.[0-3]\.ffn_.*_exps", "cuda:1"), ("attn", "cpu"))
    assert parse_device("CUDA0") == "cuda:0" and parse_device("cuda:2") == "cuda:2"
    for bad in ("exps", "exps=TPU0", "(=CPU"):
        with pytest.raises(ValueError):
            parse_override(bad)
    with pytest.raises(ValueError, match="not among"):
        Budgets(devices=("cuda:0",), override_tensor=(("exps", "cuda:1"),))
    with pytest.raises(ValueError):
        Budgets(devices=("cuda:0", "cuda:1"), tensor_split=(1.0,))
    with pytest.raises(ValueError):
        Budgets(devices=("cpu", "cuda:0"))


def test_two_gpus_default_split_balances_slots(a3b):
    b = Budgets(devices=("cuda:0", "cuda:1"), vram=(1 * GiB, 3 * GiB), ram=32 * GiB, ctx_size=8192)
    p = plan(a3b, TWO_GPUS, b)
    check_invariants(p, a3b)
    slots = [s for d in p.devices for s in d.expert_slots]
    best = max(min(s for d in plan(a3b, TWO_GPUS, replace(b, tensor_split=(cut, 12 - cut))).devices
                   for s in d.expert_slots) for cut in range(1, 12))
    assert min(slots) == best > 0  # maximin: no other cut gives the worst layer more slots
    assert p.devices[0].layers[1] - p.devices[0].layers[0] < p.devices[1].layers[1] - p.devices[1].layers[0]
    assert p.tensors["token_embd.weight"].device == "cuda:0" and p.tensors["output.weight"].device == "cuda:1"
    assert p.home == "ram" and p.tensors["blk.0.ffn_up_exps.weight"].cached
    assert p.devices[0].kv_bytes == 8192 * 2 * 4 * 128 * 2 * (p.devices[0].layers[1] - p.devices[0].layers[0])
    assert "cuda:1" in p.table() and "expert slots" in p.table()


def test_two_gpus_free_memory_all_experts_fit(a3b):
    p = plan(a3b, TWO_GPUS, Budgets(devices=("cuda:0", "cuda:1")))
    check_invariants(p, a3b)
    assert all(s == 128 for d in p.devices for s in d.expert_slots)
    assert p.devices[0].budget == 8 * GiB - 300 * MiB


def test_tensor_split_proportions(a3b):
    p = plan(a3b, TWO_GPUS, Budgets(devices=("cuda:0", "cuda:1"), tensor_split=(3, 1), ram=32 * GiB))
    check_invariants(p, a3b)
    assert [d.layers for d in p.devices] == [(0, 9), (9, 12)]
    p = plan(a3b, TWO_GPUS, Budgets(devices=("cuda:0", "cuda:1"), tensor_split=(0, 1)))
    assert [d.layers for d in p.devices] == [(0, 0), (0, 12)]


def test_one_gpu_n_cpu_moe_and_cache_caps(a3b):
    b = Budgets(devices=("cuda:0",), vram=2 * GiB, ram=16 * GiB, n_cpu_moe=4, cache_slots=32)
    p = plan(a3b, ONE_GPU, b)
    check_invariants(p, a3b)
    d = p.devices[0]
    assert d.expert_slots[:4] == (0,) * 4 and set(d.expert_slots[4:]) == {32}
    for i in range(12):
        t = p.tensors[f"blk.{i}.ffn_down_exps.weight"]
        assert (t.device, t.cached) == (("cpu", False) if i < 4 else ("cuda:0", True))
        assert t.tier == "ram"
    p = plan(a3b, ONE_GPU, Budgets(devices=("cuda:0",), vram=6 * GiB, cache_mib=512))
    assert p.devices[0].cache_bytes <= 512 * MiB
    # without n_cpu_moe the slots shrink to what the budget allows, but stay equal per layer
    p = plan(a3b, ONE_GPU, Budgets(devices=("cuda:0",), vram=2 * GiB, ram=16 * GiB))
    assert len(set(p.devices[0].expert_slots)) == 1 and 0 < p.devices[0].expert_slots[0] < 128


def test_override_tensor(a3b):
    b = Budgets(devices=("cuda:0",), vram=3 * GiB,
                override_tensor=parse_override(r"blk\.1[01]\.ffn_.*_exps=CPU,blk\.0\.ffn_up_exps=CUDA0,output\.=CPU"))
    p = plan(a3b, ONE_GPU, b)
    check_invariants(p, a3b)
    d = p.devices[0]
    assert d.expert_slots[10:] == (0, 0) and d.expert_slots[0] == 0 and d.expert_slots[1] > 0
    assert p.tensors["blk.11.ffn_gate_exps.weight"].device == "cpu"
    assert p.tensors["blk.0.ffn_up_exps.weight"].tier == "vram"
    assert p.tensors["output.weight"].device == "cpu" and p.tensors["output.weight"].tier == "ram"
    assert p.tensors["output_norm.weight"].device == "cuda:0"  # `output\.` does not match output_norm
    assert p.tensors["blk.0.ffn_gate_exps.weight"].device == "cpu"  # a partly pinned layer is computed at home
    assert d.dense_bytes == sum(t.nbytes for t in p.tensors.values() if t.tier == "vram")


def test_plan_error_message(a3b):
    with pytest.raises(PlanError, match=r"dense weights need 24\d\.\d\d MiB .* cuda:0 has a budget of 200.00 MiB"):
        plan(a3b, ONE_GPU, Budgets(devices=("cuda:0",), vram=200 * MiB))
    # 200 MiB less the workspace (140.5 MiB at -ub 512, 16 MiB of it the prompt attention's mask over -c 4096)
    # and the embeddings, over ~10 MiB of dense + KV a layer
    with pytest.raises(PlanError, match=r"140.50 MiB workspace for -ub 512\) .* about 1 of its 12 layers would fit"):
        plan(a3b, ONE_GPU, Budgets(devices=("cuda:0",), vram=200 * MiB))
    with pytest.raises(PlanError, match="about 5 of its 12 layers would fit"):  # a smaller workspace: more layers
        plan(a3b, ONE_GPU, Budgets(devices=("cuda:0",), vram=200 * MiB, ubatch=32))
    with pytest.raises(PlanError, match="RAM budget"):
        plan(a3b, CPU_ONLY, Budgets(ram=100 * MiB))
    with pytest.raises(PlanError, match="cuda:1"):
        plan(a3b, ONE_GPU, Budgets(devices=("cuda:1",)))


def test_cpu_only_larger_than_ram(a3b):
    total = nbytes(a3b, lambda cn: True)
    assert total > CPU_ONLY.ram_available  # the model does not fit: mmap home + RAM cache
    p = plan(a3b, CPU_ONLY, Budgets(ctx_size=2048, cache_mib=1024))
    check_invariants(p, a3b)
    d = p.devices[0]
    assert p.home == "disk" and d.device == "cpu" and 0 < d.cache_bytes <= 1024 * MiB
    assert p.tensors["blk.5.ffn_up_exps.weight"].tier == "disk" and p.tensors["blk.5.ffn_up_exps.weight"].cached
    assert p.tensors["blk.5.attn_q.weight"].tier == "ram"
    assert plan(a3b, CPU_ONLY, Budgets(ctx_size=2048)).devices[0].cache_bytes > d.cache_bytes  # default: all left
    with pytest.raises(PlanError, match="slots per layer fit"):
        plan(a3b, CPU_ONLY, Budgets(cache_slots=128))
    p = plan(a3b, CPU_ONLY, Budgets(ram=total + GiB))
    assert p.home == "ram" and p.devices[0].cache_bytes == 0 and p.ram_bytes <= total + GiB


def test_json_round_trip(a3b):
    p = plan(a3b, TWO_GPUS, Budgets(devices=("cuda:0", "cuda:1"), vram=2 * GiB, n_cpu_moe=2))
    d = json.loads(json.dumps(p.to_json()))
    assert Plan.from_json(d) == p
    assert d["totals"]["model_bytes"] == nbytes(a3b, lambda cn: True)


def test_real_tiny_model(tmp_path):
    from moerun.tools.make_model import make_model

    path = make_model("tiny-qwen3moe", tmp_path / "tiny.gguf", progress=False, threads=1)
    mf = open_model(path)
    try:
        arch = resolve(mf)
        p = plan(arch, CPU_ONLY, Budgets())
        check_invariants(p, arch)
        assert p.home == "ram"
        p = plan(arch, ONE_GPU, Budgets(devices=("cuda:0",), cache_slots=3))
        check_invariants(p, arch)
        assert all(s == 3 for s in p.devices[0].expert_slots)
        assert CName("ffn_up_exps.weight", 1).gguf in p.tensors
    finally:
        mf.close()


# -- issue 6: splits over several devices, against made-up inventories ---------------------------------------

def test_two_gpus_8_and_24_gib_model_larger_than_both(a3b):
    big = fake_arch(preset("a3b-L12", n_layers=128))  # ~43 GiB of routed experts: they cannot all be cached
    p = plan(big, TWO_GPUS, Budgets(devices=("cuda:0", "cuda:1"), ram=64 * GiB))
    check_invariants(p, big)
    small, large = p.devices
    assert (small.budget, large.budget) == (8 * GiB - 300 * MiB, 24 * GiB - 300 * MiB)
    assert large.layers[1] - large.layers[0] > small.layers[1] - small.layers[0]  # sized by free memory
    slots = [s for d in p.devices for s in d.expert_slots]
    assert 0 < min(slots) < big.spec.n_experts and max(slots) - min(slots) <= 0.05 * big.spec.n_experts
    cut = small.layers[1]  # moving the boundary a layer either way leaves some layers fewer slots
    for other in (cut - 1, cut + 1):
        q = plan(big, TWO_GPUS, Budgets(devices=("cuda:0", "cuda:1"), ram=64 * GiB, tensor_split=(other, 128 - other)))
        assert q.devices[0].layers == (0, other)
        assert min(s for d in q.devices for s in d.expert_slots) <= min(slots)
    for d in p.devices:  # each GPU is full: one more slot per layer would not fit
        assert d.budget - d.used_bytes < sum(p.tensors[f"blk.{i}.ffn_up_exps.weight"].nbytes * 3 // 128
                                             for i in range(*d.layers))


def test_one_gpu_6_gib_and_ram(a3b):
    big = fake_arch(preset("a3b-L12", n_layers=48))
    p = plan(big, ONE_GPU, Budgets(devices=("cuda:0",), ram=24 * GiB))
    check_invariants(p, big)
    d = p.devices[0]
    assert d.layers == (0, 48) and d.budget == 6 * GiB - 300 * MiB
    assert p.home == "ram" and len(set(d.expert_slots)) == 1 and 0 < d.expert_slots[0] < 128
    assert p.ram_bytes == sum(t.nbytes for t in p.tensors.values() if t.tier == "ram") <= 24 * GiB
    with pytest.raises(PlanError, match="budget"):  # dense + KV alone exceed the GPU
        plan(big, ONE_GPU, Budgets(devices=("cuda:0",), ram=24 * GiB, ctx_size=65536))


@pytest.mark.parametrize("split,ranges", [(None, [(0, 6), (6, 12)]), ((3, 1), [(0, 9), (9, 12)]),
                                          ((1, 2, 1), [(0, 3), (3, 9), (9, 12)])])
def test_cpu_stages_split_one_plan(a3b, split, ranges):
    one = plan(a3b, CPU_ONLY, Budgets(ctx_size=2048, cache_mib=1024))
    n = len(ranges)
    p = plan(a3b, CPU_ONLY, Budgets(devices=("cpu",) * n, ctx_size=2048, cache_mib=1024, tensor_split=split))
    check_invariants(p, a3b)
    assert [d.layers for d in p.devices] == ranges and p.home == one.home == "disk"
    for field in ("dense_bytes", "kv_bytes", "cache_bytes"):  # the stages add up to the one-stage plan
        assert sum(getattr(d, field) for d in p.devices) == getattr(one.devices[0], field)
    assert [s for d in p.devices for s in d.expert_slots] == list(one.devices[0].expert_slots)
    assert p.ram_bytes == one.ram_bytes and p.tensors == one.tensors
    embd, head = p.tensors["token_embd.weight"].nbytes, p.tensors["output.weight"].nbytes
    per_layer = [sum(t.nbytes for name, t in p.tensors.items() if name.startswith(f"blk.{i}.") and "exps" not in name)
                 for i in range(12)]
    assert p.devices[0].dense_bytes == embd + sum(per_layer[slice(*ranges[0])])
    assert p.devices[-1].dense_bytes == head + p.tensors["output_norm.weight"].nbytes + sum(
        per_layer[slice(*ranges[-1])])


def test_cpu_stages_budgets():
    assert Budgets(devices=("cpu", "cpu")).devices == ("cpu", "cpu")
    assert Budgets(devices=("CUDA0", "cuda:0")).devices == ("cuda:0", "cuda:0")  # two stages on one GPU
    with pytest.raises(ValueError):
        Budgets(devices=("cuda:0", "standin:0"))
    with pytest.raises(ValueError):
        Budgets(devices=("cpu", "cpu"), tensor_split=(1, 1, 1))


def test_prompt_attention_workspace_grows_with_the_context_and_the_chunk(a3b):
    """A device's prompt attention over the context: the mask where fused kernels run (linear in chunk and
    context), float32 scores where SDPA's math path would, QUERY_BLOCK queries at a time for sinks, MLA's
    expanded keys and values."""
    from moerun.model.layers import QUERY_BLOCK

    spec = a3b.spec  # 32 heads on 4 KV heads of 128: fused
    assert attention_workspace_bytes(spec, 512, 4096) == MASK_BYTES * 512 * 4096
    assert attention_workspace_bytes(spec, 512, 8192) == 2 * attention_workspace_bytes(spec, 512, 4096)
    assert attention_workspace_bytes(spec, 1024, 4096) == 2 * attention_workspace_bytes(spec, 512, 4096)
    assert workspace_bytes(spec, 512, 8192, 0) - workspace_bytes(spec, 512, 4096, 0) == MASK_BYTES * 512 * 4096
    math = replace(spec, head_dim=36)  # no fused kernel: the scores and their softmax in float32
    assert attention_workspace_bytes(math, 512, 4096) == (2 * 4 * 32 + MASK_BYTES) * 512 * 4096
    sinks = replace(spec, attn_sinks=True)  # blocks of QUERY_BLOCK queries: a longer chunk costs no more
    block = attention_workspace_bytes(sinks, QUERY_BLOCK, 4096)
    assert attention_workspace_bytes(sinks, 4 * QUERY_BLOCK, 4096) == block
    assert attention_workspace_bytes(sinks, 512, 4096) > 3 * 4 * 32 * QUERY_BLOCK * 4096
    mla = preset("v2lite-L4")
    expanded = 4 * mla.n_heads * 4096 * (mla.qk_nope_dim + mla.head_dim + mla.v_head_dim)
    assert attention_workspace_bytes(mla, 512, 4096) == MASK_BYTES * 512 * 4096 + expanded

    def work(ctx, ub):
        p = plan(a3b, ONE_GPU, Budgets(devices=("cuda:0",), vram=5 * GiB, ctx_size=ctx, ubatch=ub))
        return p.devices[0].workspace_bytes

    assert work(8192, 512) - work(4096, 512) == MASK_BYTES * 512 * 4096
    assert work(4096, 512) - work(4096, 256) > MASK_BYTES * 256 * 4096  # the activations grow too


def test_a_placement_within_the_attention_workspace_of_its_budget_reports_it(a3b):
    """A budget that held dense weights, KV and the old workspace (a bool mask, one byte per query and key) by
    less than the attention workspace it left out no longer fits, and the line says the workspace."""
    ctx, ub = 4096, 512
    fits = plan(a3b, ONE_GPU, Budgets(devices=("cuda:0",), vram=5 * GiB, ctx_size=ctx, ubatch=ub, cache_slots=0))
    d = fits.devices[0]
    need = d.dense_bytes + d.kv_bytes + d.workspace_bytes
    left_out = (MASK_BYTES - 1) * ub * ctx
    old_need = need - left_out
    budget = old_need + left_out // 2  # fitted before by half of what it left out
    with pytest.raises(PlanError, match=rf"{d.workspace_bytes / MiB:.2f} MiB workspace for -ub {ub}\) but cuda:0 "
                                        rf"has a budget of {budget / MiB:.2f} MiB"):
        plan(a3b, ONE_GPU, Budgets(devices=("cuda:0",), vram=budget, ctx_size=ctx, ubatch=ub, cache_slots=0))
    exact = plan(a3b, ONE_GPU, Budgets(devices=("cuda:0",), vram=need, ctx_size=ctx, ubatch=ub, cache_slots=0))
    assert exact.devices[0].used_bytes == need
    small = GPU(0, "fake-0", 8 * GiB, need - 1, 4, 16, 256, 10000)  # the budget above what is free
    inv = Inventory(32 * GiB, 30 * GiB, 6, 12, ("avx2",), (small,))
    with pytest.raises(PlanError, match=r"workspace .* but only .* is free there; it fits with -c (\d+) ") as e:
        plan(a3b, inv, Budgets(devices=("cuda:0",), vram=need, ctx_size=ctx, ubatch=ub, cache_slots=0))
    shorter = int(e.value.args[0].split("fits with -c ")[1].split()[0])  # the KV and the attention's workspace
    assert ctx - 16 < shorter < ctx  # what the line says fits, fits, with no more than a little to spare
    plan(a3b, inv, Budgets(devices=("cuda:0",), vram=need, ctx_size=shorter, ubatch=ub, cache_slots=0))
