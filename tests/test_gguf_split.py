"""A model split by llama.cpp's gguf-split (written here by gguf-py's writer, as gguf-split writes it) opens from
its first part: every part's tensors, the same bytes and the same logits as the whole file; a missing part, a
later part or a misnamed part is one clear error."""

import shutil

import pytest
import torch
from hub_server import write_split

from moerun.builtin import default_model_path
from moerun.errors import ModelFormatError
from moerun.formats import open_model
from moerun.loading import load_model


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    return write_split(default_model_path(), tmp_path_factory.mktemp("split") / "default", parts=3)


def test_a_split_model_is_the_whole_model(parts):
    whole, split = open_model(default_model_path()), open_model(parts[0])
    assert split.metadata["split.count"] == 3 and len({r.file for r in split.records.values()}) == 3
    assert sorted(split.records) == sorted(whole.records)
    for name, rec in whole.records.items():
        assert torch.equal(split.raw(name), whole.raw(rec)) and split.records[name].qtype == rec.qtype
    tokens = torch.tensor([1, 5, 9, 200, 17])
    a = load_model(default_model_path()).model.forward(tokens)
    b = load_model(parts[0]).model.forward(tokens)
    assert torch.equal(a, b)


def test_split_errors(parts, tmp_path):
    with pytest.raises(ModelFormatError, match="open the first part"):
        open_model(parts[1])
    missing = tmp_path / "m"
    missing.mkdir()
    for p in parts[:2]:
        shutil.copy(p, missing / p.name)
    with pytest.raises(ModelFormatError, match="missing: part of the split model"):
        open_model(missing / parts[0].name)
    renamed = tmp_path / "model.gguf"
    shutil.copy(parts[0], renamed)
    with pytest.raises(ModelFormatError, match="not named NAME-00001-of-00003.gguf"):
        open_model(renamed)
