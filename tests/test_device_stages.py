"""Issue 14 on the CPU: the GPU code path run through the CPU stand-in ('standin:N', moerun.device).

Dense weights, KV and expert slots on the stand-in device, routed experts at home, misses paged in or
computed at home: the logits equal the all-resident CPU run, whatever the slots, the miss path, the stage
split; and the miss path's choice never changes a greedy token.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from hf_models import FAMILIES, reference_logits

from moerun import device
from moerun.cli import main
from moerun.config import RuntimeConfig, SamplingParams
from moerun.engine.scheduler import Request, Scheduler
from moerun.model.offload import DeviceExperts
from moerun.placement import costmodel as cm
from moerun.runtime import build

STANDIN = ("standin:0",)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """family -> a 3-layer Q8_0 GGUF of its tiny preset (the CPU kernels on the home side and the stand-in)."""
    from moerun.tools.make_model import make_model
    from moerun.tools.presets import preset

    root, out = tmp_path_factory.mktemp("standin"), {}

    def get(family: str):
        if family not in out:
            out[family] = make_model(preset(f"tiny-{family}", layers=3), root / f"{family}.gguf", ftype="Q8_0",
                                     progress=False, threads=1)
        return out[family]

    return get


def logits_of(rt, tokens: torch.Tensor) -> torch.Tensor:
    """Prefill in two chunks, then four single-token steps (fixed inputs): every step's logits, stacked."""
    eng = rt.engine
    seq = eng.new_sequence()
    model = eng.model
    out = [model.forward(tokens[:20], seq.kv), model.forward(tokens[20:], seq.kv)]
    for t in tokens[:4]:
        out.append(model.forward(t.view(1), seq.kv))
    seq.free()
    return torch.cat(out).cpu()


def greedy(rt, prompt: str = "Hello world, this is the stand-in", n: int = 16) -> list[int]:
    eng = rt.engine
    return eng.generate(eng.tokenizer.encode(prompt), SamplingParams.greedy(max_tokens=n, ignore_eos=True)).run().tokens


def device_experts(rt) -> list[DeviceExperts]:
    return [st.model.experts for st in rt.stages if isinstance(st.model.experts, DeviceExperts)]


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_logits_equal_all_resident_run(hf_model, tokens32, family):
    """Acceptance: dense and slots on the stand-in, experts at home; 1, 2 and 4 slots per layer; fp32."""
    hf, folder = hf_model(family)
    ref = logits_of(build(RuntimeConfig(model=str(folder), threads=1)), tokens32)
    assert (ref[:32] - reference_logits(hf, tokens32)).abs().max() < 1e-4  # the CPU run is right
    for slots in (1, 2, 4):
        rt = build(RuntimeConfig(model=str(folder), devices=STANDIN, expert_cache_slots=slots, threads=1))
        (dx,) = device_experts(rt)
        assert dx.cache is not None and dx.cache.slots(0) == slots and dx.cache.dev.kind == "standin"
        assert rt.engine.pool.segments[0][2].device.type == "cpu"  # the stand-in's memory is the host's
        got = logits_of(rt, tokens32)
        err = (got - ref).abs().max().item()
        assert err < 1e-4, f"{family}, {slots} slots: max abs error {err:.2e}"
        c = rt.engine.expert_cache.stats.get()
        assert c.misses > 0 and c.hits + c.misses == c.queries


@pytest.mark.parametrize("family", FAMILIES)
def test_miss_path_never_changes_greedy_tokens(gguf, family):
    """Forced page-in, forced home and the cost model's choice: identical tokens (pairs are summed in one
    order, whoever computed them), and the same as the CPU run's."""
    path = str(gguf(family))
    ref = greedy(build(RuntimeConfig(model=path, threads=1, repack=False)))
    seen = {}
    for mode in ("fetch", "home", "auto"):
        rt = build(RuntimeConfig(model=path, devices=STANDIN, expert_cache_slots=2, miss_path=mode, threads=1))
        assert greedy(rt) == ref, mode
        seen[mode] = rt.engine.expert_cache.stats.get()
    assert seen["home"].misses_home == seen["home"].misses > 0 and seen["home"].bytes_paged_in == 0
    assert seen["fetch"].misses_home == 0 and seen["fetch"].bytes_paged_in > 0
    assert seen["fetch"].misses_streamed > 0  # the prefill's misses pass through the stream buffer (bypass)


def test_uneven_tensor_split_over_two_standin_stages(gguf):
    path = str(gguf("qwen2moe"))  # shared experts too
    ref = greedy(build(RuntimeConfig(model=path, threads=1, repack=False)))
    rt = build(RuntimeConfig(model=path, devices=STANDIN * 2, tensor_split=(1.0, 2.0), expert_cache_slots=1,
                             miss_path="fetch", threads=1))
    assert [d.layers for d in rt.plan.devices] == [(0, 1), (1, 3)]
    assert [st.layers for st in rt.stages] == [(0, 1), (1, 3)]
    assert [seg[:2] for seg in rt.engine.pool.segments] == [(0, 1), (1, 3)]  # KV per stage
    assert greedy(rt) == ref
    stats = rt.stage_stats()
    assert [label for label, _ in stats] == ["stage 0 (standin:0, layers 0-0)", "stage 1 (standin:0, layers 1-2)"]
    assert all(s.get().queries > 0 for _, s in stats)
    assert set(stats[0][1].layers()) == {0} and set(stats[1][1].layers()) == {1, 2}


def test_experts_that_fit_live_on_the_device_and_n_cpu_moe_stays_home(gguf):
    path = str(gguf("qwen3moe"))
    ref = greedy(build(RuntimeConfig(model=path, threads=1, repack=False)))
    rt = build(RuntimeConfig(model=path, devices=STANDIN, threads=1))  # 8 GiB: every expert fits
    (dx,) = device_experts(rt)
    assert set(dx.resident) == {0, 1, 2} and dx.cache is None and rt.engine.expert_cache is None
    assert greedy(rt) == ref
    rt = build(RuntimeConfig(model=path, devices=STANDIN, n_cpu_moe=2, expert_cache_slots=2, threads=1))
    (dx,) = device_experts(rt)
    assert dx.home_layers == {0, 1} and dx.cache.slots(0) == 0 and dx.cache.slots(2) == 2
    assert greedy(rt) == ref
    assert set(rt.engine.expert_cache.stats.layers()) == {2}  # the CPU's layers never ask the cache


def test_cost_model_pages_in_prefill_and_computes_decode_at_home():
    """The threshold is the cost model's: one a3b-sized Q4_K expert (1.7 MB, 4.7 M weights) over a
    25 GB/s PCIe 4.0 link against a desktop's CPU kernels at 50 GB/s and 800 GFLOP/s."""
    costs = cm.MissCosts(hidden=2048, home_gbps=50.0, home_flops=800e9, link_gbps=25.0, device_gbps=900.0,
                         device_flops=20e12, launch_s=20e-6)
    bytes_e, params_e = 1_769_472, 3 * 2048 * 768
    assert costs.choose(bytes_e, params_e, 1) == "home"
    n = next(n for n in range(1, 512) if costs.choose(bytes_e, params_e, n) == "fetch")
    assert 2 <= n <= 16
    assert all(costs.choose(bytes_e, params_e, m) == "fetch" for m in range(n, 512))


def test_auto_streams_a_prompt_when_the_link_is_fast(gguf):
    path = str(gguf("mixtral"))
    rt = build(RuntimeConfig(model=path, devices=STANDIN, expert_cache_slots=1, h2d_gbps=1e4, vram_gbps=1e4,
                             threads=1))
    ref = greedy(build(RuntimeConfig(model=path, threads=1, repack=False)))
    assert greedy(rt) == ref
    c = rt.engine.expert_cache.stats
    assert c.get(phase="prefill").misses_streamed > 0 and c.get(phase="prefill").bytes_streamed > 0


def _free(nbytes):
    def memory(dev):
        return (nbytes, 8 << 30) if dev.kind == "standin" else (8 << 30, 16 << 30)
    return memory


def test_a_budget_that_cannot_fit_is_one_line(gguf, monkeypatch):
    path = str(gguf("qwen3moe"))
    monkeypatch.setattr(device, "memory", _free(64 << 10))  # 64 KiB free on the device
    args = ["run", "-m", path, "-p", "hi", "-n", "2", "--devices", "standin:0"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1 and "Traceback" not in r.output
    (line,) = r.output.strip().splitlines()
    assert line.startswith("error: the dense weights need") and "budget of 64.00 KiB" in line
    r = CliRunner().invoke(main, [*args, "--vram-budget", "1GiB"])  # more than is free
    (line,) = r.output.strip().splitlines()
    assert r.exit_code == 1 and line.startswith("error: the plan needs") and "only 64.00 KiB is free" in line
    monkeypatch.setattr(device, "memory", _free(768 << 10))  # room for the weights, KV and workspace, not 8 slots
    r = CliRunner().invoke(main, [*args, "--vram-budget", "1GiB", "--expert-cache-slots", "8", "-c", "256",
                                  "-ub", "64"])
    (line,) = r.output.strip().splitlines()
    assert r.exit_code == 1 and "it fits with --expert-cache-slots " in line, line
    slots = int(line.split("--expert-cache-slots ")[1].split(",")[0])
    r = CliRunner().invoke(main, [*args, "--vram-budget", "1GiB", "--expert-cache-slots", str(slots), "-c", "256",
                                  "-ub", "64", "--temp", "0"])
    assert r.exit_code == 0, r.output  # what the line says fits, fits


def test_gpus_flag_without_cuda_is_one_line(gguf):
    if device.cuda_available():
        pytest.skip("CUDA is present")
    r = CliRunner().invoke(main, ["run", "-m", str(gguf("olmoe")), "-p", "hi", "--gpus", "0"])
    assert r.exit_code == 1 and r.output.strip() == (
        "error: cuda:0: no CUDA device is available here; run on the CPU with --device cpu")


def test_cli_reports_the_device_stage(gguf):
    args = ["run", "-m", str(gguf("qwen3moe")), "-p", "Hello there", "-n", "8", "--temp", "0", "--ignore-eos",
            "-t", "1", "--devices", "standin:0", "--expert-cache-slots", "2", "--miss-path", "home"]
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    line = next(x for x in r.stderr.splitlines() if x.startswith("expert cache"))
    assert line.startswith("expert cache, stage 0 (standin:0, layers 0-2): ") and "computed at home (100.0%)" in line
    out = json.loads(CliRunner().invoke(main, [*args, "--json"], catch_exceptions=False).stdout)
    total = out["expert_cache"]["total"]["all"]
    assert total["misses_home"] == total["misses"] > 0 and total["home_share"] == 1.0


def test_out_of_memory_fails_the_request_and_the_server_goes_on(gguf, monkeypatch):
    rt = build(RuntimeConfig(model=str(gguf("qwen3moe")), devices=STANDIN, expert_cache_slots=2, threads=1))
    eng, tok = rt.engine, rt.engine.tokenizer
    sched = Scheduler(eng, parallel=2)
    real, calls = eng.model.forward, []

    def forward(tokens, kv, *a, **kw):
        calls.append(len(tokens))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(tokens, kv, *a, **kw)

    monkeypatch.setattr(eng.model, "forward", forward)
    p = SamplingParams.greedy(max_tokens=4, ignore_eos=True)
    for i in range(2):
        req = Request(tok.encode(f"prompt number {i}"), p)
        req.events = []
        req.emit = req.events.append
        sched.submit(req)
        while sched.has_work():
            sched.step()
        if i == 0:
            assert req.finish_reason == "error"
            assert req.events[-1].error.startswith("out of device memory during prefill of 1 request(s): CUDA out")
            assert "smaller -ub, -c or -np" in req.events[-1].error
        else:
            assert req.finish_reason == "length" and len(req.tokens) == 4


@pytest.mark.slow
def test_triton_kernels_on_the_standin(gguf, monkeypatch, tokens32):
    """MOERUN_STANDIN_KERNELS=triton: the stand-in multiplies with the Triton kernels (interpreted), as a GPU
    does; against the torch reference (float32 activations both) within float32 accumulation error."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MOERUN_STANDIN_KERNELS", "triton")
    from moerun.engine.kv_cache import KVPool, SeqKV
    from moerun.loading import load_model

    path = str(gguf("qwen3moe"))
    model = load_model(path, kernels=False).model  # the torch reference: float32 activations
    kv = SeqKV(KVPool(model.spec, 64), 64)
    ref = torch.cat([model.forward(tokens32[:20], kv), model.forward(tokens32[20:], kv),
                     *(model.forward(t.view(1), kv) for t in tokens32[:4])])
    rt = build(RuntimeConfig(model=path, devices=STANDIN, expert_cache_slots=2, miss_path="fetch", threads=1))
    assert type(rt.stages[0].model.ops).__name__ == "TritonOps"
    got = logits_of(rt, tokens32)
    assert (got - ref).abs().max().item() < 1e-3


def test_serve_plans_kv_for_every_slot_on_the_device(gguf, monkeypatch):
    """serve's -np contexts of KV are in a GPU's plan, so a pool that would not fit fails before loading."""
    path = str(gguf("qwen3moe"))
    one = build(RuntimeConfig(model=path, devices=STANDIN, ctx_size=512, threads=1)).plan.devices[0]
    four = build(RuntimeConfig(model=path, devices=STANDIN, ctx_size=512, threads=1, kv_contexts=4)).plan.devices[0]
    assert four.kv_bytes == 4 * one.kv_bytes
    monkeypatch.setattr(device, "memory", _free(one.used_bytes + one.kv_bytes))  # room for two contexts, not four
    from moerun import cli_serve
    from moerun.errors import MoerunError
    from moerun.runtime import plan_for

    seen = []

    def preflight(rcfg, parallel):  # serve's own check, with what serve hands it
        seen.append(rcfg.kv_contexts)
        try:
            plan_for(rcfg)
        except MoerunError as e:
            raise MoerunError(str(e)) from None
        raise MoerunError("the plan fitted")

    monkeypatch.setattr(cli_serve, "preflight", preflight)
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    r = CliRunner().invoke(main, ["serve", "-m", path, "--devices", "standin:0", "-c", "512", "-np", "4",
                                  "--port", str(port)])
    assert seen == [4] and r.exit_code == 1 and "x 4 slots (-np)" in r.output, r.output


def test_experts_paged_from_the_file_when_their_home_is_the_map(gguf):
    """--mmap: a device stage's page-ins are read from the file into pinned staging buffers, its home misses
    into scratch; the same tokens as the CPU run either way."""
    path = str(gguf("olmoe"))
    ref = greedy(build(RuntimeConfig(model=path, threads=1, repack=False)))
    for mode in ("fetch", "home"):
        rt = build(RuntimeConfig(model=path, devices=STANDIN, expert_cache_slots=2, miss_path=mode, mmap=True,
                                 threads=1))
        (dx,) = device_experts(rt)
        assert dx.store.reader is not None and not dx.cache.transfers.pinned_layers and not dx._pinned
        assert greedy(rt) == ref, mode
        c = rt.engine.expert_cache.stats.get()
        assert (c.bytes_paged_in > 0) == (mode == "fetch") and (c.misses_home > 0) == (mode == "home")


def test_a_cuda_placement_takes_the_files_layout_and_refuses_the_interleaved_one(gguf, monkeypatch):
    """Model.place onto a CUDA device (its copies made by device.to_device, replaced here by the identity, as this
    machine has no GPU): weights in the file's layout go, the CPU kernels' interleaved layout is a clear error."""
    from moerun.loading import load_model
    from moerun.quant.qtypes import QTensor

    monkeypatch.setattr(device, "to_device", lambda t, dev: t)
    cuda = device.Device("cuda", 0)
    model = load_model(gguf("qwen3moe"), interleave=False).model
    model.place(cuda, model.ops)
    assert model.dev == cuda and isinstance(model.layers[0].wq, QTensor) and model.layers[0].wq.interleave == 1
    model = load_model(gguf("qwen3moe")).model
    assert any(isinstance(w, QTensor) and w.interleave != 1 for w in (model.layers[0].wq, model.head))
    with pytest.raises(ValueError, match="interleaved layout cannot go to a GPU"):
        model.place(cuda, model.ops)
