"""Issue 35's budgets, counted on the stand-in with the GPU's kernels (Triton, interpreted): syncs and launches per
decode step, the GPU decode layers' parity with the torch layer loop, and the speed the counts predict."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: its kernels are built for the interpreter

import pytest
import torch

pytest.importorskip("triton")

from moerun import gpu_counts
from moerun.model.gpu_decode import GpuDecode
from moerun.tools.make_model import make_model
from moerun.tools.presets import preset

# whole models' steps traced on the stand-in (~120 s in all): `python -m pytest -m slow`, and CI
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


STRUCTURES = {short: gpu_counts.STRUCTURES[name][:2]  # the real shapes' structure at small widths
              for short, name in (("a3b", "a3b-L12 Q4_K_M"), ("gptoss", "gpt-oss-20b MXFP4"))}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("counts"), {}

    def get(name: str) -> dict[int, str]:
        if name not in made:
            base, kw = STRUCTURES[name]
            made[name] = {n: str(make_model(preset(base, layers=n, **kw), root / f"{name}-L{n}.gguf", ftype="Q8_0",
                                            progress=False, threads=1)) for n in (2, 4)}
        return made[name]

    return get


@pytest.fixture
def a3b_like(models):
    return models("a3b")


@pytest.fixture(scope="module")
def counted():
    """count_decode's counts by (model file, options), each traced once for the module (a trace is seconds under the
    interpreter; several tests read the same one)."""
    seen = {}

    def get(path: str, **kw) -> gpu_counts.Counts:
        key = (path, tuple(sorted(kw.items())))
        if key not in seen:
            seen[key] = gpu_counts.count_decode(path, **kw)
        return seen[key]

    return get


def per_layer(counted, paths, **kw):
    two, four = (counted(paths[n], **kw) for n in (2, 4))
    layer = (four.kernels - two.kernels) / 2
    return two, four, layer, two.kernels - 2 * layer


@pytest.mark.parametrize("batch", [1, 2])  # odd batches' steps: the parity test below (3 rows)
def test_all_in_vram_one_sync_per_step_and_few_launches(counted, a3b_like, batch):
    two, four, layer, outside = per_layer(counted, a3b_like, batch=batch)
    assert two.n_syncs == four.n_syncs == 1 and dict(four.syncs) == {"to_host": 1}  # the sampled ids only
    assert layer <= 16, four.launches
    assert outside <= 12, two.launches
    assert four.launches["graph"] == 1 and four.n_launches <= 6, four.launches  # the step replayed: few host launches


def test_gptoss_structure_the_same_bounds(counted, models):
    two, four, layer, outside = per_layer(counted, models("gptoss"))
    assert two.n_syncs == four.n_syncs == 1 and layer <= 16 and outside <= 12, four.launches
    assert four.launches["graph"] == 1, four.launches


def test_hybrid_one_sync_per_moe_layer_at_most(counted, a3b_like):
    two, four, _, _ = per_layer(counted, a3b_like, slots=32)
    assert two.n_syncs <= 1 + 2 and four.n_syncs <= 1 + 4, four.syncs


def test_predicted_h200_decode_for_a3b_l12(counted, a3b_like):
    _two, four, layer, outside = per_layer(counted, a3b_like, batch=1)
    step = gpu_counts.Counts()
    step.launches["kernel"] = int(12 * layer + outside)
    step.syncs["to_host"] = 1
    nbytes = gpu_counts.bytes_per_token(preset("a3b-L12"), "Q4_K_M")
    captured = gpu_counts.predict(four, nbytes, gpu_counts.H200)  # as counted: the replayed graph
    assert 350e6 < nbytes < 500e6
    graph = gpu_counts.predict(step, nbytes, gpu_counts.H200, graph=True)
    assert graph.tok_s >= 1000, graph.row()
    eager = gpu_counts.predict(step, nbytes, gpu_counts.H200)
    assert eager.tok_s < graph.tok_s and captured.host_us < eager.host_us


@pytest.mark.parametrize(("name", "batch"), [("a3b", 3), ("gptoss", 2)])
def test_gpu_decode_layers_equal_the_torch_layer_loop(models, monkeypatch, name, batch):
    """Sliding windows wrap their rings within the steps (gpt-oss's window is 8 at the tiny size)."""
    from moerun.config import RuntimeConfig
    from moerun.runtime import build

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MOERUN_STANDIN_KERNELS", "triton")
    tokens = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(3))

    def run(fused: bool):
        if not fused:
            monkeypatch.setattr(GpuDecode, "usable", staticmethod(lambda m, kvs: False))
        rt = build(RuntimeConfig(model=models(name)[2], devices=("standin:0",), threads=1, kv_contexts=batch))
        m, eng = rt.engine.model, rt.engine
        eng.resize_pool(batch * eng.ctx_size, seqs=batch)
        seqs = [eng.new_sequence() for _ in range(batch)]
        for s in seqs:
            m.forward(tokens[:7], s.kv)
        out = torch.cat([m.decode(tokens[7 + t:7 + t + batch], [s.kv for s in seqs]) for t in range(2)])
        return out, m._gpu is not None

    got, used = run(True)
    ref, unused = run(False)
    assert used and not unused
    assert (got - ref).abs().max().item() < 1e-4
    assert os.environ["TRITON_INTERPRET"] == "1"


def test_steps_prepared_at_load_replay_without_capturing_and_follow_a_new_pool(models, monkeypatch):
    """prepare(): each bucket's graph made on rows that are all padding (no KV written); a step then only replays
    it; a resized pool (serve's -np) gets graphs of its own (a graph reads and writes its pool's caches)."""
    from moerun import device
    from moerun.config import RuntimeConfig
    from moerun.runtime import build

    monkeypatch.setenv("MOERUN_STANDIN_KERNELS", "triton")
    rt = build(RuntimeConfig(model=models("a3b")[2], devices=("standin:0",), threads=1))
    m, eng = rt.engine.model, rt.engine
    seq = eng.new_sequence()
    m.forward(torch.arange(5), seq.kv)
    before = [t.clone() for t in eng.pool.layer(0)]
    gpu = GpuDecode(m)
    m._gpu = gpu
    assert gpu.prepare(eng.pool, buckets=(1,)) == 1 and gpu.prepare(eng.pool, buckets=(1,)) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, eng.pool.layer(0)))  # padding wrote nothing
    graph = gpu._graphs[1][0]
    with device.counting(m.dev) as c:
        m.decode(torch.tensor([7]), [seq.kv])
    assert gpu._graphs[1][0] is graph and c.launches["graph"] == 1
    seq.free()
    eng.resize_pool(2 * eng.ctx_size, seqs=2)
    seq = eng.new_sequence()
    m.forward(torch.arange(5), seq.kv)
    m.decode(torch.tensor([7]), [seq.kv])
    assert gpu._graphs[1][3] is eng.pool and gpu._graphs[1][0] is not graph


def test_two_stages_launch_each_on_its_own_device(models, monkeypatch):
    """Finding: every Triton kernel launched on cuda:0, stage 1's with pointers into cuda:1 (an illegal address).
    Each stage now runs inside its device's context; the stand-in fails a launch off the current device."""
    from moerun.config import RuntimeConfig
    from moerun.runtime import build

    monkeypatch.setenv("MOERUN_STANDIN_KERNELS", "triton")
    tokens = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(5))

    def run(devices):
        rt = build(RuntimeConfig(model=models("a3b")[2], devices=devices, threads=1))
        seq = rt.engine.new_sequence()
        m = rt.engine.model
        return torch.cat([m.forward(tokens[:6], seq.kv), *(m.forward(t.view(1), seq.kv) for t in tokens[6:])])

    one, two = run(("standin:0",)), run(("standin:0", "standin:1"))
    assert (one - two).abs().max().item() < 1e-4


@pytest.mark.parametrize("slots", [None, 32])
def test_a_prefill_chunk_meets_the_same_budget(models, monkeypatch, slots):
    """All in VRAM: no sync inside a prompt chunk (its logits are read with the sampled id); experts behind a
    cache: one per MoE layer (the routing ids)."""
    from moerun import device
    from moerun.config import RuntimeConfig
    from moerun.runtime import build

    monkeypatch.setenv("MOERUN_STANDIN_KERNELS", "triton")
    rt = build(RuntimeConfig(model=models("a3b")[2], devices=("standin:0",), expert_cache_slots=slots, threads=1))
    m = rt.engine.model
    seq = rt.engine.new_sequence()
    m.forward(torch.arange(4), seq.kv, last_only=True)  # a cache behind the chunk
    with device.counting(m.dev) as c:
        m.forward(torch.arange(4, 28), seq.kv, last_only=True)  # 24 rows: more than one 16-row tile
    assert c.n_syncs == (0 if slots is None else 2), c.syncs
