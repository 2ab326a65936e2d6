"""-hf REPO[:QUANT], --hf-file FILE and -m hf://... on the command line (issue 39, item 2): run, chat, serve, bench,
estimate and inspect load what moerun.hub downloads, here from a local stand-in for the hub (tests/hub_server.py,
through HF_ENDPOINT) with a real huggingface_hub client in a fresh `python -m moerun` process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import HubServer, Repo, hub_env, read_folder

from moerun.tools.make_model import make_model

GGUF_REPO = "moerun-test/tiny-GGUF"
ST_REPO = "moerun-test/tiny-safetensors"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-cli-models")
    files = {path.name: path.read_bytes() for path in
             (make_model("tiny-qwen3moe", root / f"tiny-{q}.gguf", ftype=q, progress=False) for q in ("Q4_K_M", "Q8_0"))}
    st = read_folder(make_model("tiny-qwen3moe", root / "st", fmt="safetensors", progress=False))
    with HubServer({GGUF_REPO: Repo(files), ST_REPO: Repo(st)}) as server:
        yield server


def moerun(hub, home: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moerun", *args], env=hub_env(home, hub.url), input=stdin,
                          capture_output=True, text=True, timeout=180, check=False)


def test_run_and_chat_load_a_hub_model(hub, tmp_path):
    r = moerun(hub, tmp_path, "run", "-hf", GGUF_REPO, "-p", "hi", "-n", "3", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 3
    assert hub.gets() == ["tiny-Q4_K_M.gguf"]  # llama.cpp's default quant
    r = moerun(hub, tmp_path, "run", "-m", f"hf://{GGUF_REPO}:q8_0", "-p", "hi", "-n", "2")
    assert r.returncode == 0, r.stderr
    r = moerun(hub, tmp_path, "chat", "-hf", GGUF_REPO, "--hf-file", "tiny-Q8_0.gguf", "-n", "2", stdin="hello\n")
    assert r.returncode == 0, r.stderr
    assert sorted(hub.gets()) == ["tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf"]  # each once: the cache serves the rest


def test_inspect_estimate_and_bench_take_hub_models(hub, tmp_path):
    r = moerun(hub, tmp_path, "inspect", "-hf", f"{GGUF_REPO}:Q8_0", "--json")
    assert r.returncode == 0, r.stderr
    path = Path(json.loads(r.stdout)["path"])
    assert path.name == "tiny-Q8_0.gguf" and path.is_relative_to(tmp_path / "hub")
    r = moerun(hub, tmp_path, "inspect", f"hf://{ST_REPO}", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["format"] == "safetensors"
    r = moerun(hub, tmp_path, "estimate", "-hf", GGUF_REPO, "--no-measure", "--json")
    assert r.returncode == 0, r.stderr
    assert Path(json.loads(r.stdout)["model"]).name == "tiny-Q4_K_M.gguf"
    r = moerun(hub, tmp_path, "bench", "-hf", f"{GGUF_REPO}:Q8_0", "-m", "default", "-p", "0", "-n", "2", "-r", "1",
               "-o", "json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)) == 2  # the built-in model and the hub's


@pytest.mark.parametrize("args,line", [
    (("run", "-hf", f"{GGUF_REPO}:Q5_K_M", "-p", "hi"), f"error: {GGUF_REPO} has no GGUF file for quant Q5_K_M"),
    (("serve", "-hf", "moerun-test/nothing", "--port", "1"), "error: no repository moerun-test/nothing on the hub"),
    (("inspect", "--hf-file", "x.gguf"), "error: --hf-file x.gguf needs the repository it is in"),
    (("run", "-m", "default", "-hf", GGUF_REPO, "-p", "hi"), f"error: -m default and -hf {GGUF_REPO} both name a model"),
])
def test_hub_errors_are_one_line(hub, tmp_path, args, line):
    r = moerun(hub, tmp_path, *args)
    assert r.returncode == 1 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith(line), r.stderr


def test_a_model_is_needed(hub, tmp_path):
    for args, says in ((("estimate", "--no-measure"), "give MODEL or -hf REPO[:QUANT]"),
                       (("bench", "-n", "1"), "give -m MODEL or -hf REPO[:QUANT]")):
        r = moerun(hub, tmp_path, *args)
        assert r.returncode == 2 and says in r.stderr, r.stderr
