"""Issue 14 on a real GPU (skipped without CUDA; bench/gpu_check.sh runs them on a lent machine).

The same checks as tests/test_device_stages.py on the stand-in, on cuda:0: tiny models of every family
against the CPU run, all placements, two stages on one GPU, a copy that overlaps compute, out of memory.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import FAMILIES, reference_logits

from moerun import device
from moerun.config import RuntimeConfig, SamplingParams
from moerun.engine.kv_cache import KVPool, SeqKV
from moerun.engine.sampler import Sampler
from moerun.engine.scheduler import Request, Scheduler
from moerun.loading import load_model
from moerun.model.offload import DeviceExperts
from moerun.runtime import build

pytestmark = pytest.mark.gpu
GPU = ("cuda:0",)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    from moerun.tools.make_model import make_model
    from moerun.tools.presets import preset

    root, out = tmp_path_factory.mktemp("gpu"), {}

    def get(family: str, ftype: str = "Q8_0"):
        if (family, ftype) not in out:
            out[family, ftype] = make_model(preset(f"tiny-{family}", layers=3), root / f"{family}-{ftype}.gguf",
                                            ftype=ftype, progress=False, threads=1)
        return out[family, ftype]

    return get


def logits_of(model, pool_or_rt, tokens):
    kv = pool_or_rt.engine.new_sequence().kv if hasattr(pool_or_rt, "engine") else SeqKV(pool_or_rt, 64)
    out = [model.forward(tokens[:20], kv), model.forward(tokens[20:], kv)]
    out += [model.forward(t.view(1), kv) for t in tokens[:4]]
    return torch.cat(out).float().cpu()


def greedy(rt, n=16):
    eng = rt.engine
    ids = eng.tokenizer.encode("Hello world, this is the GPU")
    return eng.generate(ids, SamplingParams.greedy(max_tokens=n, ignore_eos=True)).run().tokens


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("slots", [1, 2, 4, None], ids=["1-slot", "2-slots", "4-slots", "all-in-vram"])
def test_gpu_logits_equal_cpu(hf_model, tokens32, family, slots):
    """fp32 HF weights: the GPU's float matmuls against the CPU's, within 1e-4 like the stand-in."""
    hf, folder = hf_model(family)
    ref = reference_logits(hf, tokens32)
    rt = build(RuntimeConfig(model=str(folder), devices=GPU, expert_cache_slots=slots))
    assert rt.engine.pool.segments[0][2].is_cuda and rt.stages[0].model.dev.is_cuda
    got = logits_of(rt.engine.model, rt, tokens32)[:32]
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_triton_kernels_on_quantized_weights(gguf, tokens32, family):
    """Q8_0 and Q4_K blocks on the GPU through the Triton kernels, against the torch reference on the CPU."""
    for ftype in ("Q8_0", "Q4_K_M"):
        path = str(gguf(family, ftype))
        ref_model = load_model(path, kernels=False).model
        ref = logits_of(ref_model, KVPool(ref_model.spec, 64), tokens32)
        rt = build(RuntimeConfig(model=path, devices=GPU, expert_cache_slots=2, miss_path="fetch"))
        assert type(rt.stages[0].model.ops).__name__ == "TritonOps"
        got = logits_of(rt.engine.model, rt, tokens32)
        assert (got - ref).abs().max().item() < 2e-3, ftype


def test_gpu_miss_paths_agree(hf_model):
    _, folder = hf_model("qwen2moe")
    toks = {mode: greedy(build(RuntimeConfig(model=str(folder), devices=GPU, expert_cache_slots=2, miss_path=mode)))
            for mode in ("fetch", "home", "auto")}
    assert toks["fetch"] == toks["home"] == toks["auto"] == greedy(build(RuntimeConfig(model=str(folder))))


def test_two_stages_on_one_gpu(gguf):
    path = str(gguf("mixtral"))
    one = greedy(build(RuntimeConfig(model=path, devices=GPU, expert_cache_slots=2)))
    rt = build(RuntimeConfig(model=path, devices=GPU * 2, tensor_split=(1.0, 2.0), expert_cache_slots=2))
    assert [d.layers for d in rt.plan.devices] == [(0, 1), (1, 3)]
    assert rt.plan.devices[0].budget == rt.plan.devices[1].budget  # one GPU's budget, shared
    assert greedy(rt) == one


def test_home_experts_are_pinned_and_pageable_copies_are_refused(gguf):
    rt = build(RuntimeConfig(model=str(gguf("qwen3moe")), devices=GPU, expert_cache_slots=2, mmap=False))
    (dx,) = [st.model.experts for st in rt.stages if isinstance(st.model.experts, DeviceExperts)]
    assert dx._pinned and all(r.pinned for r in dx._pinned)
    assert all(r.tensor.is_pinned() for r in dx._pinned)
    dst = torch.empty(16, dtype=torch.uint8, device="cuda")
    with pytest.raises(device.DeviceError, match="pageable"):
        device.copy_(dst, torch.zeros(16, dtype=torch.uint8))


def test_copy_stream_overlaps_compute():
    """A host-to-device copy on the copy stream while matmuls run on the compute stream: together they take clearly
    less than one after the other (events on each stream). The matmuls are sized to the measured copy, so that
    overlapping could save up to half and the margin is far outside the noise on any GPU."""
    dev = device.parse("cuda:0")
    src = device.pinned_empty(512 << 20, dev)
    dst = device.empty(dev, 512 << 20)
    a = torch.randn(4096, 4096, device="cuda")
    copy, comp = device.Stream(dev), device.compute_stream(dev)
    copy.wait(device.Event(dev).record(comp))  # dst came from the compute stream's pool

    def timed(fn_copy: bool, n_mm: int) -> float:
        device.synchronize(dev)
        t0 = device.Event(dev, timing=True).record(comp)
        copy.wait(t0)
        if fn_copy:
            device.copy_(dst, src, copy)
        for _ in range(n_mm):
            a @ a
        done = device.Event(dev, timing=True).record(copy)
        comp.wait(done)
        t1 = device.Event(dev, timing=True).record(comp)
        t1.synchronize()
        return t0.seconds_to(t1)

    timed(True, 2)  # warm-up
    c, one = timed(True, 0), timed(False, 10) / 10
    n = max(1, round(c / one))  # as long on the compute stream as the copy takes on its own
    m, both = timed(False, n), timed(True, n)
    assert both < 0.75 * (c + m), (c, m, both, n)


def test_out_of_memory_fails_the_request_and_serving_goes_on(gguf):
    rt = build(RuntimeConfig(model=str(gguf("qwen3moe")), devices=GPU, expert_cache_slots=2, ctx_size=4096,
                             ubatch=4096))
    eng, tok = rt.engine, rt.engine.tokenizer
    sched = Scheduler(eng, parallel=1)
    torch.cuda.synchronize()
    used, total = torch.cuda.memory_allocated(), torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((used + (24 << 20)) / total)
    try:
        p = SamplingParams.greedy(max_tokens=4, ignore_eos=True)
        big = Request(list(range(3, 4000)), p)
        small = Request(tok.encode("a short one"), p)
        for r in (big, small):
            r.events = []
            r.emit = r.events.append
            sched.submit(r)
            while sched.has_work():
                sched.step()
        assert big.finish_reason == "error" and big.events[-1].error.startswith("out of device memory")
        assert small.finish_reason == "length" and len(small.tokens) == 4
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_sampling_on_the_device_brings_back_one_id():
    logits = torch.randn(1000, device="cuda")
    s = Sampler(SamplingParams(temperature=1.0, seed=7), 1000, device="cuda")
    t = s.sample(logits, torch.tensor([1, 2, 3]))
    assert t.is_cuda and t.dim() == 0
    again = Sampler(SamplingParams(temperature=1.0, seed=7), 1000, device="cuda").sample(logits, torch.tensor([1, 2, 3]))
    assert int(t) == int(again)
