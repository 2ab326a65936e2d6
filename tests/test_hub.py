"""Models on the hub (issue 39, item 2): `-m hf://...`, `-hf REPO[:QUANT]`, `--hf-file FILE` through moerun.hub.

The choice of file is checked on file lists (as llama.cpp's common/download.cpp chooses). Downloads run a real
huggingface_hub client, in a fresh process whose HF_ENDPOINT points at a local stand-in for the hub
(tests/hub_server.py) and whose HF_HOME is the test's own: download, resume after a cut connection, the cache
reused offline and with the hub gone, and each error as one line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import HubServer, Repo, hub_env, read_folder, run_resolve, write_shards, write_split

from moerun.formats import open_model
from moerun.hub import HubError, HubRef, Plan, choose_gguf, gguf_parts, gguf_quants, parse, plan, resolve
from moerun.tools.make_model import make_model

GGUF_REPO = "moerun-test/tiny-GGUF"
ST_REPO = "moerun-test/tiny-safetensors"
PRIVATE_REPO = "moerun-test/private-GGUF"
GATED_REPO = "moerun-test/gated-GGUF"
BIG_REPO = "moerun-test/routing-GGUF"
BIG_FILE = "routing-qwen3moe-F16.gguf"
BIG_MODEL = Path(__file__).resolve().parents[1] / "moerun" / "data" / "routing-qwen3moe.gguf"
SPLIT = ("tiny-F16-00001-of-00002.gguf", "tiny-F16-00002-of-00002.gguf")
ST_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
ST_EXTRA = {"README.md", "pytorch_model.bin", "consolidated.safetensors", "original/params.json"}


# ------------------------------------------------------------------------------------------ references


@pytest.mark.parametrize("args, ref", [
    (("hf://u/r", None, None), HubRef("u/r")),
    (("hf://u/r:q8_0", None, None), HubRef("u/r", "q8_0")),
    (("hf://u/r.x-1_2:UD-Q4_K_XL", None, None), HubRef("u/r.x-1_2", "UD-Q4_K_XL")),
    (("hf://u/r/sub/M-Q4_K_M.gguf", None, None), HubRef("u/r", file="sub/M-Q4_K_M.gguf")),
    (("hf://u/r", None, "M.gguf"), HubRef("u/r", file="M.gguf")),
    ((None, "u/r", None), HubRef("u/r")),
    ((None, "u/r:Q4_K_M", None), HubRef("u/r", "Q4_K_M")),
    ((None, "u/r:Q4_K_M", "x/M-Q8_0.gguf"), HubRef("u/r", file="x/M-Q8_0.gguf")),
])
def test_references(args, ref):
    assert parse(*args) == ref


@pytest.mark.parametrize("model", [None, "model.gguf", "/models/Qwen", "default", "hf.gguf", "./hf://x"])
def test_local_models_pass_through(model):
    assert parse(model) is None
    assert resolve(model) == model


@pytest.mark.parametrize("args, says", [
    (("hf://", None, None), "expected hf://user/repo"),
    (("hf://qwen", None, None), "expected hf://user/repo"),
    (("hf://u/r:", None, None), "the quant after ':' is empty"),
    (("hf://u/r:Q4/M.gguf", None, None), "expected hf://user/repo"),
    (("hf://u/r/config.json", None, None), "must be a .gguf file"),
    (("hf://u/r/../M.gguf", None, None), "is not a file path"),
    (("hf://u/r/a/M.gguf", None, "M.gguf"), "expected hf://user/repo"),
    ((None, "qwen", None), "-hf qwen: expected a repository user/repo[:QUANT]"),
    ((None, "u/r/x", None), "expected a repository"),
    ((None, "u/r:Q4 K", None), "not a quant tag"),
    (("m.gguf", "u/r", None), "both name a model"),
    ((None, None, "M.gguf"), "--hf-file M.gguf needs the repository"),
])
def test_malformed_references(args, says):
    with pytest.raises(HubError, match=None) as e:
        resolve(*args)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_module_imports_no_hub_client():
    code = "import sys, moerun.hub; assert 'huggingface_hub' not in sys.modules, 'imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------------------ which file


REPO_FILES = ["README.md", "M-IQ4_XS.gguf", "M-Q2_K.gguf", "M-Q4_K_M.gguf", "M-Q8_0.gguf", "mmproj-M-F16.gguf",
              "BF16/M-BF16-00001-of-00002.gguf", "BF16/M-BF16-00002-of-00002.gguf", "imatrix-M-Q6_K.gguf"]


@pytest.mark.parametrize("files, quant, chosen", [
    (REPO_FILES, None, "M-Q4_K_M.gguf"),  # no tag: Q4_K_M
    ([f for f in REPO_FILES if "Q4_K_M" not in f], None, "M-Q8_0.gguf"),  # then Q8_0
    (["b-Q2_K.gguf", "a-Q3_K_S.gguf", "mmproj-F16.gguf"], None, "a-Q3_K_S.gguf"),  # then the first GGUF
    (REPO_FILES, "q8_0", "M-Q8_0.gguf"),  # any case
    (REPO_FILES, "bf16", "BF16/M-BF16-00001-of-00002.gguf"),  # a split model: its first part
    (REPO_FILES, "F16", None),  # only a projector has it
    (REPO_FILES, "Q6_K", None),  # only an imatrix file has it
    (REPO_FILES, "XS", None),  # a tag is a whole tag: XS is not IQ4_XS
    (REPO_FILES, "IQ4_XS", "M-IQ4_XS.gguf"),
    (["M-IQ2_K.gguf", "M-Q2_K.gguf"], "Q2_K", "M-Q2_K.gguf"),  # not IQ2_K (llama.cpp would take it)
    (["M.Q5_K_M.gguf"], "Q5_K_M", "M.Q5_K_M.gguf"),  # the tag after a dot
    (["M-00002-of-00002.gguf", "M-00001-of-00002.gguf"], None, "M-00001-of-00002.gguf"),
    (["README.md", "config.json"], None, None),
])
def test_gguf_choice(files, quant, chosen):
    assert choose_gguf(sorted(files), quant) == chosen


def test_quants_and_parts():
    assert gguf_quants(sorted(REPO_FILES)) == ["BF16", "IQ4_XS", "Q2_K", "Q4_K_M", "Q8_0"]
    assert gguf_parts(REPO_FILES, "BF16/M-BF16-00001-of-00002.gguf") == (
        "BF16/M-BF16-00001-of-00002.gguf", "BF16/M-BF16-00002-of-00002.gguf")
    assert gguf_parts(REPO_FILES, "M-Q8_0.gguf") == ("M-Q8_0.gguf",)


def test_safetensors_plans():
    one = ["README.md", "config.json", "model.safetensors", "tokenizer.json", "pytorch_model.bin",
           "additional_chat_templates/tool_use.jinja", "onnx/model.onnx", "generation_config.json"]
    assert plan(one, HubRef("u/r")) == Plan(("config.json", "generation_config.json", "tokenizer.json",
                                             "additional_chat_templates/tool_use.jinja", "model.safetensors"), "")
    sharded = ["config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
               "consolidated.safetensors", "tokenizer.model"]
    assert plan(sharded, HubRef("u/r")) == Plan(("config.json", "tokenizer.model", "model.safetensors.index.json"),
                                                "", index=True)


@pytest.mark.parametrize("files, ref, says", [
    (REPO_FILES, HubRef("u/r", "Q5_K_M"), ("u/r has no GGUF file for quant Q5_K_M; its quants: BF16, IQ4_XS, "
                                           "Q2_K, Q4_K_M, Q8_0 (pick one: -hf u/r:QUANT)")),
    (["config.json", "model.safetensors"], HubRef("u/r", "Q4_K_M"), "u/r has no GGUF file, so no quant Q4_K_M"),
    (REPO_FILES, HubRef("u/r", file="M-Q5_K_M.gguf"), "u/r has no file M-Q5_K_M.gguf; its GGUF files: "),
    (["README.md", "model.safetensors"], HubRef("u/r"), "u/r has no GGUF file and no safetensors model"),
])
def test_nothing_fits(files, ref, says):
    with pytest.raises(HubError) as e:
        plan(files, ref)
    assert str(e.value).startswith(says)


# ------------------------------------------------------------------------------------------ the stand-in hub


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    """The served repositories' files: tiny Qwen3-MoE GGUFs (Q4_K_M, Q8_0, F16 split in two, a projector) and a
    safetensors folder in two shards with files that must not be fetched."""
    root = tmp_path_factory.mktemp("hub-models")
    gguf_files = {"README.md": b"# tiny\n", "mmproj-tiny-F16.gguf": b"GGUF" + bytes(100)}
    for ftype in ("Q4_K_M", "Q8_0", "F16"):
        path = make_model("tiny-qwen3moe", root / f"tiny-{ftype}.gguf", ftype=ftype, progress=False)
        if ftype != "F16":
            gguf_files[path.name] = path.read_bytes()
    for part in write_split(root / "tiny-F16.gguf", root / "split" / "tiny-F16"):
        gguf_files[part.name] = part.read_bytes()
    folder = make_model("tiny-qwen3moe", root / "st", fmt="safetensors", progress=False)
    write_shards(folder)
    st_files = read_folder(folder)
    st_files.update({"README.md": b"# tiny\n", "pytorch_model.bin": bytes(1 << 20),
                     "consolidated.safetensors": bytes(1 << 16), "original/params.json": b"{}"})
    assert set(st_files) == ST_FILES | ST_EXTRA
    return {"gguf": gguf_files, "st": st_files, "big": BIG_MODEL.read_bytes()}


@pytest.fixture
def hub(models):
    repos = {GGUF_REPO: Repo(models["gguf"]), ST_REPO: Repo(models["st"]),
             PRIVATE_REPO: Repo({"tiny-Q8_0.gguf": models["gguf"]["tiny-Q8_0.gguf"]}, private=True),
             GATED_REPO: Repo({"tiny-Q8_0.gguf": models["gguf"]["tiny-Q8_0.gguf"]}, gated=True),
             BIG_REPO: Repo({BIG_FILE: models["big"]})}
    with HubServer(repos) as server:
        yield server


def _ok(results: list[list[str]]) -> list[Path]:
    assert all(kind == "ok" for kind, _ in results), results
    return [Path(p) for _, p in results]


def _errors(results: list[list[str]]) -> list[str]:
    assert all(kind == "error" and "\n" not in m for kind, m in results), results
    return [m for _, m in results]


def test_download_gguf(hub, models, tmp_path):
    results, stderr = run_resolve(
        hub_env(tmp_path, hub.url),
        {"args": [None, GGUF_REPO]}, {"args": [f"hf://{GGUF_REPO}:q8_0"]},
        {"args": [None, GGUF_REPO, "tiny-Q8_0.gguf"]}, {"args": [f"hf://{GGUF_REPO}/tiny-Q4_K_M.gguf"]},
        {"args": [None, f"{GGUF_REPO}:f16"]})
    default, q8, q8_file, q4_file, split = _ok(results)
    assert (default.name, q8.name, q8_file, q4_file) == ("tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf", q8, default)
    assert split.name == SPLIT[0] and (split.parent / SPLIT[1]).is_file()
    assert default.is_relative_to(tmp_path / "hub" / "models--moerun-test--tiny-GGUF" / "snapshots")
    for path in (default, q8, split, split.parent / SPLIT[1]):
        assert path.read_bytes() == models["gguf"][path.name]
    assert sorted(hub.gets()) == sorted(["tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf", *SPLIT])  # each once, nothing else
    meta = open_model(default).metadata
    assert meta["general.architecture"] == "qwen3moe" and meta["general.name"] == "tiny-qwen3moe"
    assert open_model(split).metadata["split.count"] == 2
    assert "Traceback" not in stderr


def test_download_safetensors(hub, models, tmp_path):
    results, _ = run_resolve(hub_env(tmp_path, hub.url), {"args": [f"hf://{ST_REPO}"]}, {"args": [None, ST_REPO]})
    folder, again = _ok(results)
    assert again == folder and folder.is_dir()
    assert set(read_folder(folder)) == ST_FILES  # no README, *.bin, stray *.safetensors or subfolders
    assert all((folder / f).read_bytes() == models["st"][f] for f in ST_FILES)
    assert not set(hub.gets()) & ST_EXTRA
    model = open_model(folder)
    assert model.format == "safetensors" and len(model.records) > 20


def test_resume_after_a_cut_connection(hub, models, tmp_path):
    """huggingface_hub writes what it receives in chunks of 10 MiB and, when the connection drops, asks for the rest
    from the end of the last whole chunk: the cut comes after the first chunk (the 27 MB routing model)."""
    chunk = 10 << 20
    hub.cut[BIG_FILE] = chunk + 12345
    results, stderr = run_resolve(hub_env(tmp_path, hub.url), {"args": [None, BIG_REPO]})
    (path,) = _ok(results)
    assert path.name == BIG_FILE and path.read_bytes() == models["big"]
    ranges = [r for m, p, r in hub.log if m == "GET" and p.endswith(BIG_FILE)]
    assert ranges == [None, f"bytes={chunk}-"]  # resumed, not restarted
    assert "Trying to resume download" in stderr
    assert open_model(path).metadata["general.name"] == "moerun-routing-qwen3moe"


def test_cache_reused_offline(hub, models, tmp_path):
    online = hub_env(tmp_path, hub.url)
    calls = [{"args": [None, GGUF_REPO]}, {"args": [f"hf://{GGUF_REPO}:F16"]}, {"args": [None, ST_REPO]}]
    first = _ok(run_resolve(online, *calls)[0])
    hub.stop()
    offline = dict(online, HF_HUB_OFFLINE="1")
    results, stderr = run_resolve(offline, *calls, {"args": [None, GGUF_REPO, "tiny-Q4_K_M.gguf"]})
    assert _ok(results) == [*first, first[0]] and stderr == ""
    errors = _errors(run_resolve(offline, {"args": [f"hf://{GGUF_REPO}:Q8_0"]}, {"args": [None, PRIVATE_REPO]})[0])
    assert errors[0].startswith("HF_HUB_OFFLINE is set and the cached copy of moerun-test/tiny-GGUF (")
    assert errors[0].endswith("has no GGUF file for quant Q8_0; its quants: F16, Q4_K_M (pick one: "
                              "-hf moerun-test/tiny-GGUF:QUANT)")
    assert errors[1] == f"HF_HUB_OFFLINE is set and {PRIVATE_REPO} is not in the cache at {tmp_path / 'hub'}"
    # the hub gone without HF_HUB_OFFLINE: the cache, with a note; or one line saying what failed
    results, stderr = run_resolve(online, calls[0], {"args": [None, PRIVATE_REPO]})
    assert results[0] == ["ok", str(first[0])]
    assert stderr.startswith(f"note: cannot reach the hub at {hub.url} (") and stderr.count("\n") == 1
    assert "using the cached copy of moerun-test/tiny-GGUF (HF_HUB_OFFLINE=1 skips the hub)" in stderr
    (error,) = _errors(results[1:])
    assert error.startswith(f"cannot reach the hub at {hub.url} (")
    assert error.endswith(f"and {PRIVATE_REPO} is not in the cache at {tmp_path / 'hub'}")


def test_errors_are_one_line(hub, tmp_path):
    results, stderr = run_resolve(
        hub_env(tmp_path, hub.url),
        {"args": [None, "moerun-test/nope"]}, {"args": [None, PRIVATE_REPO]},
        {"args": [f"hf://{GGUF_REPO}:Q5_K_M"]}, {"args": [None, GGUF_REPO, "tiny-Q5_K_M.gguf"]},
        {"args": [f"hf://{ST_REPO}:Q4_K_M"]}, {"args": [None, GATED_REPO]})
    assert _errors(results) == [
        "no repository moerun-test/nope on the hub (or it is private: set HF_TOKEN)",
        f"no repository {PRIVATE_REPO} on the hub (or it is private: set HF_TOKEN)",
        (f"{GGUF_REPO} has no GGUF file for quant Q5_K_M; its quants: F16, Q4_K_M, Q8_0 "
         f"(pick one: -hf {GGUF_REPO}:QUANT)"),
        (f"{GGUF_REPO} has no file tiny-Q5_K_M.gguf; its GGUF files: mmproj-tiny-F16.gguf, "
         "tiny-F16-00001-of-00002.gguf, tiny-F16-00002-of-00002.gguf, tiny-Q4_K_M.gguf, tiny-Q8_0.gguf"),
        f"{ST_REPO} has no GGUF file, so no quant Q4_K_M",
        (f"{GATED_REPO} is gated: accept its conditions at {hub.url}/{GATED_REPO} and set HF_TOKEN to a token of "
         "that account"),
    ]
    assert "Traceback" not in stderr
    assert hub.gets() == []


def test_token(hub, models, tmp_path):
    results, _ = run_resolve(hub_env(tmp_path, hub.url, HF_TOKEN=hub.token), {"args": [None, PRIVATE_REPO]})
    (path,) = _ok(results)
    assert path.read_bytes() == models["gguf"]["tiny-Q8_0.gguf"]
    results, _ = run_resolve(hub_env(tmp_path, hub.url, HF_TOKEN="hf_wrong"), {"args": [None, "moerun-test/nope"]})
    assert _errors(results) == ["no repository moerun-test/nope on the hub (or HF_TOKEN's account cannot read it)"]


def test_progress_bars(hub, tmp_path):
    env = hub_env(tmp_path, hub.url)
    _, quiet = run_resolve(env, {"args": [f"hf://{GGUF_REPO}:Q8_0"]})
    _, shown = run_resolve(env, {"args": [f"hf://{GGUF_REPO}:F16"], "progress": True})
    assert quiet == ""
    assert "Fetching 2 files" in shown and "100%" in shown
