"""moerun.device: names, the stand-in's memory, streams and events, copies, the one-sync download."""

from __future__ import annotations

import pytest
import torch

from moerun import device
from moerun.experts.stats import CacheStats
from moerun.experts.store import ExpertStore
from moerun.experts.transfer import StreamBuffer, Transfers
from moerun.quant.qtypes import QTensor, QType


def test_names():
    assert [device.canonical(n) for n in ("CPU", "CUDA0", "cuda1", "cuda:2", " standin:0 ", "STANDIN3")] == [
        "cpu", "cuda:0", "cuda:1", "cuda:2", "standin:0", "standin:3"]
    for bad in ("gpu", "cuda", "cuda:x", "standin", "tpu:0", ""):
        with pytest.raises(ValueError, match="unknown device"):
            device.canonical(bad)
    d = device.parse("standin:1")
    assert (d.kind, d.index, d.name, d.accelerator, d.is_cuda, d.torch) == ("standin", 1, "standin:1", True, False,
                                                                           torch.device("cpu"))
    assert not device.CPU.accelerator and device.parse("cuda:3").torch == torch.device("cuda", 3)


def test_standin_memory_from_the_environment(monkeypatch):
    sd = device.parse("standin:0")
    monkeypatch.delenv(device.STANDIN_VRAM_ENV, raising=False)
    assert device.memory(sd) == (8 << 30, 8 << 30)
    monkeypatch.setenv(device.STANDIN_VRAM_ENV, "24GiB")
    assert device.memory(sd) == (24 << 30, 24 << 30)
    monkeypatch.setenv(device.STANDIN_VRAM_ENV, "lots")
    with pytest.raises(device.DeviceError, match="MOERUN_STANDIN_VRAM=lots"):
        device.memory(sd)
    free, total = device.memory(device.CPU)
    assert 0 < free <= total


def test_missing_cuda_device_is_one_line():
    n = device.cuda_count()
    with pytest.raises(device.DeviceError, match="no CUDA device" if n == 0 else "only"):
        device.check(device.parse(f"cuda:{max(n, 0) + (n > 0) * 7}"))


def test_standin_streams_events_and_copies():
    sd = device.parse("standin:0")
    s, c = device.Stream(sd), device.compute_stream(sd)
    a = device.Event(sd, timing=True).record(s)
    dst, src = device.empty(sd, 1 << 20), torch.arange(1 << 20, dtype=torch.int32).to(torch.uint8)
    s.wait(device.Event(sd).record(c))  # the copy stream after the compute that allocated dst
    device.copy_(dst, src, s)  # lands when waited for (moerun.standin)
    b = device.Event(sd, timing=True).record(s)
    c.wait(b)
    assert torch.equal(dst, src) and b.query() and b.seconds_to(a) == 0.0 and a.seconds_to(b) >= 0.0
    x, ids = torch.randn(3, 4), torch.tensor([[1, 2]])
    assert all(r is t for r, t in zip(device.to_host([x, ids]), (x, ids)))  # host tensors come back as they are
    assert device.upload(x, torch.device("cpu")) is x
    assert device.pin(x, sd).pinned  # nothing to register off CUDA
    with pytest.raises(ValueError):
        device.pin(x.t(), sd)
    assert device.is_oom(torch.OutOfMemoryError("x")) and not device.is_oom(RuntimeError("x"))


def _store(E=6, I=32, H=64):
    g = QTensor(torch.randint(0, 255, (E, I, H), dtype=torch.uint8), QType.F32, (E, I, H // 4))
    u = QTensor(torch.randint(0, 255, (E, I, H), dtype=torch.uint8), QType.F32, (E, I, H // 4))
    d = QTensor(torch.randint(0, 255, (E, H // 4, I * 4), dtype=torch.uint8), QType.F32, (E, H // 4, I))
    return ExpertStore({0: g}, {0: u}, {0: d})


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "staged"])
def test_transfers_copy_experts_bytes_exactly(pinned):
    """Page-ins from pinned RAM (straight) and through the staging buffers land every byte, and are timed."""
    sd, store = device.parse("standin:0"), _store()
    t, stats = Transfers(store, sd, {0} if pinned else set()), CacheStats()
    nbytes = store.expert_bytes(0)
    bufs = [device.empty(sd, nbytes) for _ in range(5)]
    t.adopt()
    total, ready = t.load(0, [(e, b) for e, b in zip((5, 1, 3, 0, 2), bufs)], "decode")
    t.wait(ready, 0, "decode")
    assert total == 5 * nbytes
    for e, b in zip((5, 1, 3, 0, 2), bufs):
        ref = torch.empty(nbytes, dtype=torch.uint8)
        store.get(0, e).copy_into(ref)
        assert torch.equal(b, ref)
    t.settle(stats, wait=True)
    assert stats.get(0, "decode").seconds_copy > 0


def test_stream_buffer_runs_every_expert_once_in_chunks():
    sd, store = device.parse("standin:0"), _store(E=6)
    sb = StreamBuffer(Transfers(store, sd, {0}), chunk=2)
    seen = []
    for chunk, nbytes in sb.run(0, [4, 0, 5, 2, 1], "prefill"):
        assert len(chunk) <= 2 and nbytes == len(chunk) * store.expert_bytes(0)
        for e, ex in chunk.items():
            assert torch.equal(ex.gate.data.reshape(-1), store.get(0, e).gate.data.reshape(-1))
        seen += list(chunk)
    assert seen == [4, 0, 5, 2, 1]
