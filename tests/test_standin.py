"""The stand-in keeps CUDA's rules where they bite (moerun.standin), and the GPU path's faults it exposes stay fixed.

Each rule is checked both ways: what a GPU would get wrong fails here, what is ordered right passes."""

from __future__ import annotations

import pytest
import torch

from moerun import device, standin
from moerun.experts.store import ExpertStore
from moerun.experts.transfer import StreamBuffer, Transfers
from moerun.quant.qtypes import QTensor, QType

SD = device.parse("standin:0")


@pytest.fixture(autouse=True)
def sim():
    with standin.fresh(seed=1) as s:
        yield s


def test_a_side_stream_copy_reads_as_poison_until_waited_for():
    copy, compute = device.Stream(SD), device.compute_stream(SD)
    dst = device.empty(SD, 4096).view(torch.float32)
    copy.wait(device.Event(SD).record(compute))  # ordered after the allocation
    src = torch.arange(1024, dtype=torch.float32)
    device.copy_(dst, src, copy)
    done = device.Event(SD).record(copy)
    assert torch.isnan(dst).all()  # not landed: a kernel reading it now would read garbage
    compute.wait(done)
    assert torch.equal(dst, src)


def test_event_query_completes_copies_at_random_and_synchronize_always():
    copy = device.Stream(SD)
    seen = set()
    for _ in range(16):
        dst = device.empty(SD, 64)
        copy.wait(device.Event(SD).record(device.compute_stream(SD)))
        device.copy_(dst, torch.full((64,), 7, dtype=torch.uint8), copy)
        ev = device.Event(SD).record(copy)
        seen.add(ev.query())
        ev.synchronize()
        assert (dst == 7).all()
    assert seen == {True, False}


def test_a_copy_into_fresh_compute_memory_must_wait_for_the_compute_stream():
    copy, compute = device.Stream(SD), device.compute_stream(SD)
    device.Event(SD).record(compute)  # the compute stream has queued work
    dst = device.empty(SD, 256)
    with pytest.raises(standin.StandinError, match="without waiting"):
        device.copy_(dst, torch.zeros(256, dtype=torch.uint8), copy)
    copy.wait(device.Event(SD).record(compute))
    device.copy_(dst, torch.zeros(256, dtype=torch.uint8), copy)


def test_freed_blocks_are_handed_out_again_poisoned_and_a_late_copy_into_one_faults():
    copy, compute = device.Stream(SD), device.compute_stream(SD)
    a = device.empty(SD, 1024)
    a.fill_(3)
    ptr = a.data_ptr()
    del a
    b = device.empty(SD, 1024)
    assert b.data_ptr() == ptr and (b == standin.POISON).all()  # the same memory, at once, poisoned
    copy.wait(device.Event(SD).record(compute))
    device.copy_(b, torch.ones(1024, dtype=torch.uint8), copy)
    del b  # freed while its copy is queued: nothing recorded it to the copy stream
    c = device.empty(SD, 1024)
    assert c.data_ptr() == ptr
    with pytest.raises(standin.StandinError, match="freed and handed out again"):
        copy.synchronize()


def test_record_stream_keeps_a_block_until_the_stream_is_done_with_it():
    copy, compute = device.Stream(SD), device.compute_stream(SD)
    b = device.empty(SD, 1024)
    ptr = b.data_ptr()
    copy.wait(device.Event(SD).record(compute))
    device.copy_(b, torch.ones(1024, dtype=torch.uint8), copy)
    device.record_stream(b, copy)
    del b
    c = device.empty(SD, 1024)
    assert c.data_ptr() != ptr  # still the copy stream's
    copy.synchronize()
    del c
    assert device.empty(SD, 1024).data_ptr() in (ptr, ptr)  # free again once the copy landed


def test_a_launch_on_another_device_than_the_current_one_fails(sim):
    class Kernel:  # a launchable stand-in for a Triton kernel: kernel[grid](*args)
        calls = 0

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                Kernel.calls += 1
            return run

    w1 = device.to_device(torch.ones(64), device.parse("standin:1"))
    with pytest.raises(standin.StandinError, match="standin:1"):
        device.launch(Kernel(), (1,), w1)
    with device.use(device.parse("standin:1")):
        device.launch(Kernel(), (1,), w1)
    assert Kernel.calls == 1


def test_an_event_recorded_off_the_current_device_fails():
    with pytest.raises(standin.StandinError, match="current"):
        device.Event(device.parse("standin:1")).record()
    with device.use(device.parse("standin:1")):
        device.Event(device.parse("standin:1")).record()


def test_counting_sees_every_device_to_host_read_and_every_launch():
    x = torch.arange(8.0)
    with device.counting(SD) as c:
        y = x * 2 + 1  # two kernels
        y.view(2, 4)  # a view: none
        int(y[0]), bool(y[1] > 0), y[2].item()  # three reads (select is a view, `>` a kernel)
        y.tolist()
        y.nonzero()
        torch.bincount(torch.tensor([1, 2, 2]))
        y[y > 3]  # a boolean mask: its size comes back to the host
        (h,) = device.to_host([y], dev=SD)
        h.tolist(), int(h[0])  # host memory: free
    assert c.syncs == {"item": 3, "tolist": 1, "nonzero": 1, "bincount": 1, "index": 1, "to_host": 1}, c.syncs
    assert c.launches["mul"] == 1 and c.launches["add"] == 1 and "view" not in c.launches


def test_a_capture_fails_on_a_sync_and_its_replay_uses_the_baked_values():
    g = device.Graph(SD)
    inp, out = torch.zeros(4), torch.zeros(4)
    step = 3  # a Python value: baked into the graph
    with g.capture():
        out.copy_(inp * step + 1)
    assert g.kernels == 3
    inp.copy_(torch.arange(4.0))
    step = 100
    g.replay()
    assert torch.equal(out, torch.arange(4.0) * 3 + 1)
    with pytest.raises(standin.StandinError, match="captured"), device.Graph(SD).capture():
        int(inp.sum())


def _store(E=6, I=32, H=64):
    g = QTensor(torch.randint(0, 255, (E, I, H), dtype=torch.uint8), QType.F32, (E, I, H // 4))
    u = QTensor(torch.randint(0, 255, (E, I, H), dtype=torch.uint8), QType.F32, (E, I, H // 4))
    d = QTensor(torch.randint(0, 255, (E, H // 4, I * 4), dtype=torch.uint8), QType.F32, (E, H // 4, I))
    return ExpertStore({0: g}, {0: u}, {0: d})


def test_the_prefill_stream_orders_its_buffers_after_the_compute_that_freed_their_memory():
    """Finding: the stream buffer's halves came from the compute stream's pool and the copy stream wrote into them at
    once (their first use, and each growth), racing kernels still queued on that memory."""
    store = _store()
    t = Transfers(store, SD, {0})
    device.Event(SD).record(t.compute)  # the compute stream has queued work
    sb = StreamBuffer(t, chunk=2)
    seen = []
    for chunk, _ in sb.run(0, [4, 0, 5], "prefill"):
        for e, ex in chunk.items():
            assert torch.equal(ex.gate.data.reshape(-1), store.get(0, e).gate.data.reshape(-1))
        seen += list(chunk)
    assert seen == [4, 0, 5]


def test_a_failed_host_registration_clears_cudas_sticky_error(monkeypatch):
    """Finding: cudaHostRegister's failure stays as CUDA's last error and surfaces at an unrelated kernel."""
    calls = []

    class Cudart:
        def cudaHostRegister(self, *a):
            calls.append("register")
            return 2  # cudaErrorMemoryAllocation

        def cudaGetLastError(self):
            calls.append("clear")
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    region = device.pin(torch.zeros(64, dtype=torch.uint8), device.parse("cuda:0"))
    assert not region.pinned and calls == ["register", "clear"]


def test_out_of_memory_after_page_ins_leaves_no_slot_read_before_its_copy(tmp_path, monkeypatch, sim):
    """Finding: an out-of-memory error after place() (the page-ins queued, their wait not yet) left the slots marked
    resident; the next step's hits read them before the copies landed (poison on the stand-in)."""
    from moerun.config import RuntimeConfig
    from moerun.experts.cache import ExpertCache
    from moerun.runtime import build
    from moerun.tools.make_model import make_model
    from moerun.tools.presets import preset

    path = make_model(preset("tiny-qwen3moe", layers=2), tmp_path / "m.gguf", ftype="Q8_0", progress=False, threads=1)
    tokens = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3))

    def run(rt, fail: bool):
        eng = rt.engine
        seq = eng.new_sequence()
        eng.model.forward(tokens[:8], seq.kv)
        if fail:  # the step's first wait for its page-ins never comes: out of memory just before it
            def wait_ready(self, *a, **kw):
                raise torch.OutOfMemoryError("CUDA out of memory")

            with monkeypatch.context() as m:
                m.setattr(ExpertCache, "wait_ready", wait_ready)
                length = seq.kv.length
                with pytest.raises(torch.OutOfMemoryError):
                    eng.model.forward(tokens[8:9], seq.kv)
                seq.kv.truncate(length)
        return torch.cat([eng.model.forward(t.view(1), seq.kv) for t in tokens[8:]])

    sim.jitter = 0.0  # copies land only when waited for
    cfg = RuntimeConfig(model=str(path), devices=("standin:0",), expert_cache_slots=4, miss_path="fetch", threads=1)
    ref = run(build(cfg), fail=False)
    got = run(build(cfg), fail=True)
    assert torch.isfinite(got).all() and (got - ref).abs().max() < 1e-4


def test_the_h2d_probe_times_the_device_it_measures(monkeypatch):
    """Finding: measure_h2d_gbps recorded its events on the current device's stream (cuda:0) while copying to another
    GPU. A fake CUDA records which device was current and which stream each event was recorded on."""
    current, records = [0], []

    class Ctx:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            self.prev, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.prev

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self, stream=None):
            records.append((current[0], current[0] if stream is None else stream))

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 1.0

    real_empty = torch.empty
    monkeypatch.setattr(torch.cuda, "device", Ctx)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: index)
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, device=None, **kw: real_empty(*a, **kw))
    assert device.measure_h2d_gbps(device.parse("cuda:1"), nbytes=1 << 10, reps=2) > 0
    assert records and all(r == (1, 1) for r in records), records


def test_resident_experts_are_checked_once_not_every_step(monkeypatch):
    """Finding: TritonOps checked every resident expert's kind on every step. Built with its table once, a step only
    launches."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from moerun.experts.store import Expert
    from moerun.model.gpu_ops import TritonOps
    from moerun.quant.qtypes import QTensor, QType
    from moerun.quant.quantize import quantize

    walks = []

    class Experts(dict):
        def values(self):
            walks.append("values")
            return super().values()

        def items(self):
            walks.append("items")
            return super().items()

        def __iter__(self):
            walks.append("iter")
            return super().__iter__()

    g = torch.Generator().manual_seed(0)

    def q(n, k):
        return QTensor(quantize(torch.randn(n, k, generator=g), QType.Q8_0), QType.Q8_0, (n, k))

    experts = Experts({e: Expert(q(32, 64), q(32, 64), q(64, 32)) for e in range(8)})
    ops = TritonOps()
    table = ops.moe_table(experts)
    walks.clear()
    x, ids, w = torch.randn(2, 64, generator=g), torch.tensor([[1, 5], [5, 2]]), torch.rand(2, 2, generator=g)
    for _ in range(2):
        ops.moe(x, ids, w, experts, table=table)
    assert walks == []
