"""Where load_model puts each weight: memory moerun owns, or the file's own pages where a copy buys nothing."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moerun.loading import load_model
from moerun.tools.make_model import make_model
from moerun.tools.presets import preset


def _in_map(loaded, t: torch.Tensor) -> bool:
    mf = loaded.file
    rec = next(iter(mf.records.values()))
    lo = mf.raw(rec).data_ptr() - rec.offset  # the map's first byte
    return lo <= t.data_ptr() < lo + len(mf._maps[mf.path])


@pytest.mark.parametrize("tied", [False, True])
def test_embeddings_stay_in_the_file_unless_the_head_reads_them(tmp_path, tied):
    spec = replace(preset("tiny-qwen3moe", layers=2), tie_embeddings=tied)
    path = make_model(spec, tmp_path / "m.gguf", ftype="Q8_0", progress=False, threads=1)
    loaded = load_model(path, home="ram")
    m = loaded.model
    assert loaded.arch.spec.tie_embeddings is tied
    # one row a token: the file's pages serve it; a tied head multiplies the whole table every token, so it is
    # copied (and the head is that copy)
    assert _in_map(loaded, m.embd.data) is not tied
    assert not _in_map(loaded, m.head.data)
    assert not any(_in_map(loaded, t.data) for t in (m.layers[0].wq, m.layers[1].wo))
    assert torch.equal(m.embd.data.reshape(-1), loaded.file.raw("token_embd.weight"))

