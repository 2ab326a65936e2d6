"""A load's reads started before torch's import (moerun.weights.preload): the weights are the plain load's, bit for
bit, whatever was foreseen; what was not is read by the loader and its early copy given back; nothing waits on reads
nobody needs."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from hub_server import write_split

from moerun.arch import resolve
from moerun.builtin import default_model_path
from moerun.config import RuntimeConfig, SamplingParams
from moerun.errors import ModelFormatError
from moerun.formats import open_model
from moerun.hostmem import PAGE
from moerun.kernels import cpu, native
from moerun.loading import load_model
from moerun.runtime import build
from moerun.tools.make_model import make_model
from moerun.tools.presets import preset
from moerun.weights.loader import interleave_on_read, load_weights
from moerun.weights.preload import Preload, weights_ahead

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the reads ahead need the CPU kernels")

FAMILIES = {  # over 2 MiB each (smaller files get no arena): MLA's row-read tensors, DeltaNet, MXFP4, biased routing
    "tiny-deepseek2": {"layers": 2}, "tiny-qwen35moe": {}, "tiny-gptoss": {}, "tiny-glm4moe": {}, "tiny-qwen3moe": {}}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("preload")
    return {name: make_model(preset(name, vocab=16384, **kw), d / f"{name}.gguf", ftype="Q4_K_M", progress=False,
                             threads=1) for name, kw in FAMILIES.items()}


def _weights(path, preload: Preload | None = None, interleave: bool = True):
    mf = open_model(path) if preload is None else preload.mf
    arch = resolve(mf)
    on_read = interleave_on_read(True) if interleave else None
    try:
        return load_weights(mf, arch, copy_experts=True, interleave=on_read, preload=preload), arch
    finally:
        if preload is not None:
            preload.close()


def _same(got, want) -> None:
    assert got.keys() == want.keys()
    for cn, t in want.items():
        g = got[cn]
        assert (g.qtype, g.shape, g.interleave) == (t.qtype, t.shape, t.interleave), cn
        assert torch.equal(g.data, t.data), cn


def _reading_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "moerun-read"]


@pytest.mark.parametrize("early", [True, False], ids=["read-early", "read-at-finish"])
@pytest.mark.parametrize("name", FAMILIES)
def test_a_preloaded_load_is_the_plain_load_and_takes_every_read_it_needs(files, name, early, monkeypatch):
    want, arch = _weights(files[name])
    if not early:  # no thread until the loader's finish(): every job is still to run when it is claimed
        monkeypatch.setattr(native.ReadJobs, "start", lambda self, n: None)
    p = weights_ahead(files[name])
    monkeypatch.undo()
    assert isinstance(p, Preload)
    got, _ = _weights(files[name], p)
    _same(got, want)
    copied = {src.records[0].name for src in arch.sources.values() if src.direct}
    assert set(p.unclaimed) == set(p.mf.records) - copied  # only what the model does not read from its record
    assert any(t.interleave == 8 for t in got.values())  # the interleaved layouts were read ahead too
    assert not _reading_threads()


def test_a_wrong_guess_costs_a_read_not_a_wrong_weight_and_its_pages_go_back(files):
    path = files["tiny-qwen3moe"]
    want, _ = _weights(path)
    p = weights_ahead(path, repack=False)  # read as stored; the loader asks for the interleaved layouts
    pieces = dict(p._pieces)
    got, _ = _weights(path, p)
    _same(got, want)
    recs, isa = p.mf.records, cpu.features()["isa"]
    wrong = [n for n in p.unclaimed if native.interleaves_stored(recs[n].qtype, recs[n].shape, isa)]
    assert wrong and any(got_t.interleave == 8 for got_t in got.values())
    whole = torch.frombuffer(p.arena._map, dtype=torch.uint8)
    for piece in (pc for pc in pieces.values() if pc.name in wrong):
        lo, hi = -(-piece.start // PAGE) * PAGE, (piece.start + piece.nbytes) // PAGE * PAGE
        if hi > lo:  # the whole pages of a piece given back read as new ones: zeros
            assert not whole[lo:hi].any(), piece.name


def test_a_claim_is_taken_once_and_only_in_the_layout_read(files):
    p = weights_ahead(files["tiny-qwen3moe"])
    try:
        rec = next(r for r in p.mf.records.values() if r.name.endswith("attn_q.weight"))
        assert p.claim(rec, None) is None  # read ahead interleaved, not as stored
        _, dst = p.claim(rec, rec.qtype)
        assert dst.numel() == rec.nbytes and p.claim(rec, rec.qtype) is None
        assert rec.name not in p.unclaimed
    finally:
        p.close()


def test_closing_before_the_load_ends_the_reads(files):
    p = weights_ahead(files["tiny-glm4moe"])
    p.close()
    p.close()
    assert not _reading_threads()
    assert p.claim(next(iter(p.mf.records.values())), None) is None
    p.mf.close()


def test_cancelled_and_skipped_jobs_read_nothing(tmp_path):
    from moerun.kernels import _cpu

    f = tmp_path / "bytes"
    f.write_bytes(bytes(range(256)) * 64)
    fd = os.open(f, os.O_RDONLY)
    try:
        dst = np.zeros((3, 4096), dtype=np.uint8)
        jobs = [native.read_job(fd, 1000 * i, dst[i].ctypes.data, 4096) for i in range(3)]
        t = native.ReadJobs(_cpu, jobs)
        t.skip(1)
        got = t.wait()  # starts a thread where none was
        assert got == [4096, 0, 4096] and not dst[1].any()
        assert bytes(dst[2]) == f.read_bytes()[2000:6096]
        t = native.ReadJobs(_cpu, jobs)
        t.cancel()
        dst[:] = 0
        assert t.wait() == [native.PENDING] * 3 and not dst.any()
    finally:
        os.close(fd)


def test_a_file_cut_short_after_the_preload_is_a_format_error(files, tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    path.write_bytes(files["tiny-qwen3moe"].read_bytes())
    monkeypatch.setattr(native.ReadJobs, "start", lambda self, n: None)  # nothing read before the cut
    p = weights_ahead(path)
    monkeypatch.undo()
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100_000)
    with pytest.raises(ModelFormatError, match="truncated"):
        load_model(p.mf, home="ram", preload=p)
    assert not _reading_threads()


def test_the_reads_start_without_torch(files):
    code = ("import sys; from moerun.weights.preload import Preload, weights_ahead; "
            f"p = weights_ahead({str(files['tiny-qwen35moe'])!r}); "
            "assert isinstance(p, Preload) and p._jobs.threads >= 1; "
            "assert 'torch' not in sys.modules, 'torch imported'; p.close(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_greedy_tokens_do_not_depend_on_the_reads_ahead(files):
    def tokens(ahead) -> list[int]:
        cfg = RuntimeConfig(model=str(files["tiny-qwen35moe"]), threads=1)
        assert cfg.copies_whole_model
        rt = build(cfg, ahead(cfg))
        try:
            eng = rt.engine
            return eng.generate(eng.tokenizer.encode("The reads ahead"),
                                SamplingParams.greedy(max_tokens=12, ignore_eos=True)).run().tokens
        finally:
            rt.close()

    assert tokens(lambda cfg: weights_ahead(files["tiny-qwen35moe"], cfg.repack)) == tokens(lambda cfg: None)


def test_a_split_model_is_read_ahead_from_every_part(tmp_path):
    parts = write_split(default_model_path(), tmp_path / "default", parts=3)
    want, _ = _weights(default_model_path())
    p = weights_ahead(parts[0])
    assert isinstance(p, Preload) and len({r.file for r in p.mf.records.values()}) == 3
    got, _ = _weights(parts[0], p)
    _same(got, want)
    assert not p.unclaimed


def test_the_reads_start_from_the_tensors_and_the_load_gets_the_whole_header(files):
    path = files["tiny-qwen3moe"]
    p = weights_ahead(path)
    try:
        assert "tokenizer.ggml.tokens" not in p._tensors.metadata  # the vocabulary is not decoded before the reads
        whole = open_model(path)
        assert p.mf.metadata == whole.metadata and p.mf.records == whole.records
        assert p.mf is p.mf and not p._tensors._maps  # parsed once; the first parse's map given back
        whole.close()
    finally:
        p.close()
