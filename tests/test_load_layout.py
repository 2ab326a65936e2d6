"""Where load_model puts each weight: memory moerun owns, or the file's own pages where a copy buys nothing."""

from __future__ import annotations

import mmap
import time

import pytest
import torch

from moerun.hostmem import HUGE_PAGE, Arena, weights_arena
from moerun.loading import load_model
from moerun.tools.make_model import make_model
from moerun.tools.presets import preset


def _in_map(loaded, t: torch.Tensor) -> bool:
    mf = loaded.file
    rec = next(iter(mf.records.values()))
    lo = mf.raw(rec).data_ptr() - rec.offset  # the map's first byte
    return lo <= t.data_ptr() < lo + len(mf._maps[mf.path])


def test_every_dense_weight_is_a_copy_the_embeddings_too(tmp_path):
    """A file cut short under a running server must fail requests, not the process: nothing dense views its map."""
    path = make_model(preset("tiny-qwen3moe", layers=2), tmp_path / "m.gguf", ftype="Q8_0", progress=False, threads=1)
    loaded = load_model(path, home="mmap")
    m = loaded.model
    assert not any(_in_map(loaded, t.data) for t in (m.embd, m.head, m.layers[0].wq, m.layers[1].wo))
    assert torch.equal(m.embd.data.reshape(-1), loaded.file.raw("token_embd.weight"))


def test_a_repack_the_extension_refuses_is_named_not_called_a_truncated_file(tmp_path, monkeypatch):
    """An extension older than the Python side (an updated checkout not rebuilt) refuses a new layout: the error says
    so, where it used to blame the file ("truncated ... changed on disk?")."""
    from moerun.errors import ModelFormatError
    from moerun.kernels import reads

    path = make_model(preset("tiny-qwen3moe", layers=2), tmp_path / "m.gguf", ftype="Q8_0", progress=False, threads=1)
    real = reads.read_all

    def refusing(jobs, *a, **kw):
        got = real(jobs, *a, **kw)
        return [-3 if j.interleave is not None else rc for j, rc in zip(jobs, got)]  # QK_ETYPE from the repack

    monkeypatch.setattr(reads, "read_all", refusing)
    with pytest.raises(ModelFormatError, match=r"cannot interleave tensor .*\(Q8_0.*rebuild") as e:
        load_model(path)
    assert "truncated" not in str(e.value)


def _resident(t: torch.Tensor) -> float:
    """The share of t's pages in RAM (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    start = t.data_ptr() - t.data_ptr() % mmap.PAGESIZE
    pages = -(-(t.data_ptr() + t.numel() - start) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * mmap.PAGESIZE), vec) == 0
    return sum(v & 1 for v in vec) / pages


@pytest.mark.parametrize("nbytes", [64 << 20, (64 << 20) + 12345])  # a file's size is rarely whole pages
def test_an_arena_faults_its_pages_in_and_hands_out_disjoint_pieces(nbytes):
    arena = Arena(nbytes, chunk=4 << 20)
    arena._thread.join()  # its thread faults the whole arena in, unasked
    pages = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    assert arena.nbytes == nbytes and arena.faulted == pages
    a, b = arena.take(3 << 20), arena.take(5000)
    assert a.data_ptr() % HUGE_PAGE == 0 and b.data_ptr() % 64 == 0
    assert b.data_ptr() >= a.data_ptr() + a.numel()  # disjoint, in order
    a.fill_(1)
    b.fill_(2)
    assert _resident(a) == 1.0 and arena.take(64 << 20) is None  # no room: the caller maps its own
    rest = arena.take(1 << 20)
    given_back = arena.close()
    used = -(-(rest.data_ptr() + rest.numel() - a.data_ptr()) // mmap.PAGESIZE) * mmap.PAGESIZE
    assert given_back == pages - used
    assert arena.take(1) is None  # closed
    assert int(a.sum()) == a.numel() and int(b.sum()) == 2 * b.numel()  # the pieces outlive the close
    whole = torch.frombuffer(arena._map, dtype=torch.uint8)
    assert _resident(whole[arena._top - given_back:arena._hi]) < 0.1  # the pages nobody took went back


def test_a_piece_that_reaches_the_faulting_stops_it_before_it_is_handed_out():
    arena = Arena(256 << 20)
    while arena.faulted < 16 << 20:  # the thread writes from the top down: past 240 MiB by now
        time.sleep(0.001)
    piece = arena.take(250 << 20)  # reaches the pages the thread is writing
    assert not arena._running and arena.faulted <= arena.nbytes
    piece.fill_(7)
    assert int(piece.sum()) == 7 * piece.numel()  # nothing writes over the loader's bytes
    arena.close()
    assert int(piece.sum()) == 7 * piece.numel()


def test_closing_stops_the_faulting_early():
    arena = Arena(512 << 20, chunk=2 << 20)
    arena.close()
    assert arena.faulted <= arena.nbytes and not arena._thread.is_alive()


def test_the_loader_reads_into_the_arena_and_the_model_is_the_same(tmp_path):
    path = make_model(preset("tiny-qwen3moe", layers=2), tmp_path / "m.gguf", ftype="Q4_K_M", progress=False,
                      threads=1)
    plain = load_model(path, home="ram")
    arena = Arena(path.stat().st_size)
    inside = load_model(path, home="ram", arena=arena)
    assert arena.take(1) is None  # closed by the load
    lo = torch.frombuffer(arena._map, dtype=torch.uint8).data_ptr()
    m, ref = inside.model, plain.model
    owned = [m.head.data, m.layers[0].wq.data, m.layers[1].wo.data]
    assert all(lo <= t.data_ptr() < lo + len(arena._map) for t in owned)
    tokens = torch.tensor([1, 5, 9, 3])
    assert torch.equal(m.forward(tokens), ref.forward(tokens))
    for a, b in zip(owned, [ref.head.data, ref.layers[0].wq.data, ref.layers[1].wo.data]):
        assert torch.equal(a, b)


def test_a_cli_load_gets_an_arena_only_when_it_copies_the_whole_file(tmp_path):
    from moerun.builtin import default_model_path
    from moerun.config import RuntimeConfig

    path = default_model_path()  # the built-in model: a few MiB
    assert path.stat().st_size >= HUGE_PAGE and RuntimeConfig(model=str(path)).copies_whole_model
    arena = weights_arena(path)
    assert arena is not None and arena.nbytes == path.stat().st_size
    arena.close()
    for kw in ({"mmap": True}, {"expert_cache_slots": 2}, {"ram_budget": 1 << 30}, {"device": "cuda:0"},
               {"expert_parallel": 2}, {"pipeline_world_size": 2}):
        assert not RuntimeConfig(model=str(path), **kw).copies_whole_model, kw
    hf = tmp_path / "hf"
    make_model(preset("tiny-qwen3moe", layers=2), hf, fmt="safetensors", progress=False, threads=1)
    small = make_model(preset("tiny-qwen3moe", layers=2), tmp_path / "m.gguf", ftype="Q8_0", progress=False, threads=1)
    assert weights_arena(hf) is None and weights_arena(tmp_path / "missing.gguf") is None
    assert weights_arena(small) is None  # under a huge page


def test_the_plan_counts_an_arenas_pages_as_memory_for_the_weights(monkeypatch):
    import psutil

    from moerun import runtime
    from moerun.builtin import default_model_path
    from moerun.config import RuntimeConfig

    path = default_model_path()
    size = path.stat().st_size
    tight = psutil.virtual_memory()._replace(available=size // 2)  # what is left once the arena holds the weights'
    monkeypatch.setattr(psutil, "virtual_memory", lambda: tight)
    homes = []
    for held in (0, size):
        mf, _, plan, home = runtime._prepare(RuntimeConfig(model=str(path), ctx_size=64), held)
        mf.close()
        homes.append((plan.home, home))
    assert homes == [("disk", "mmap"), ("ram", "ram")]
