"""The built-in model's names: `default` and its file's name mean it in inspect, estimate, bench and -m, unless
a file of that name is in the working directory (a real file wins)."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from moerun.builtin import DEFAULT_MODEL, NAMES, default_model_path, model_path
from moerun.cli import main


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(autouse=True)
def elsewhere(tmp_path, monkeypatch):
    """Each test in an empty working directory, with its own hardware cache."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MOERUN_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_names_resolve_to_the_built_in_model():
    builtin = default_model_path()
    assert builtin.name == DEFAULT_MODEL and builtin.is_file()
    assert NAMES == ("default", DEFAULT_MODEL)
    for name in (None, "default", DEFAULT_MODEL):
        assert model_path(name) == builtin
    assert model_path("other.gguf") == Path("other.gguf")  # not there: left to the reader to say so


def test_a_real_file_of_that_name_wins(elsewhere):
    for name in NAMES:
        (elsewhere / name).write_bytes(b"not a model")
        assert model_path(name) == Path(name)
        r = invoke("inspect", name)  # the built-in model would be described; this file is not a model
        assert r.exit_code == 1 and r.output.startswith(f"error: {name}")


@pytest.mark.parametrize("name", NAMES)
def test_inspect_and_estimate_take_the_name(name):
    builtin = str(default_model_path())
    r = invoke("inspect", name, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["path"] == builtin
    r = invoke("estimate", name, "--json", "--device", "cpu", "--no-measure")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["model"] == builtin


def test_bench_and_run_take_the_name():
    r = invoke("bench", "-m", "default", "-p", "8", "-n", "2", "-r", "1", "-o", "json", "--no-warmup")
    assert r.exit_code == 0, r.output
    assert {row["model_filename"] for row in json.loads(r.stdout)} == {str(default_model_path())}
    r = invoke("run", "-m", "default", "-p", "import os", "-n", "4", "--temp", "0", "--no-display-prompt")
    plain = invoke("run", "-p", "import os", "-n", "4", "--temp", "0", "--no-display-prompt")
    assert r.exit_code == 0, r.output
    assert r.stdout == plain.stdout and r.stdout.strip()
