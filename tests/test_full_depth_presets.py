"""Full-depth presets (issue 36): every layer and the real vocabulary, fewer routed experts, the real model's
weight bytes per token; bench/full_depth.py against a stand-in llama-quantize. No model of full size is written."""

from __future__ import annotations

import argparse
import importlib.util
import os
import stat
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from moerun.arch import FAMILIES, Arch, expected_shapes
from moerun.arch.summary import summarize
from moerun.arch.tensors import Source
from moerun.formats.gguf import TensorRecord
from moerun.quant.ggml_types import tensor_bytes
from moerun.tools.gguf_out import qtype_for
from moerun.tools.presets import FULL_DEPTH, preset

ROOT = Path(__file__).resolve().parents[1]

# name -> (layers, vocabulary, routed experts by default)
SHAPES = {"qwen3moe-30b": (48, 151936, 32), "qwen35moe-35b": (40, 248320, 32), "gptoss-20b": (24, 201088, 32),
          "glm45-air": (46, 151552, 10), "v2lite": (27, 102400, 16)}


def fake_arch(spec, ftype: str) -> Arch:
    """Records of the spec's tensors typed as make-model types them for `ftype`, no file."""
    sources = {}
    for cn, shape in expected_shapes(spec).items():
        qt = qtype_for(cn, shape, ftype, n_layers=spec.n_layers, tied_embeddings=spec.tie_embeddings)
        sources[cn] = Source((TensorRecord(cn.gguf, qt, shape, Path("none.gguf"), 0, tensor_bytes(qt, shape)),))
    return Arch(FAMILIES[spec.family], spec, sources)


def test_the_full_depth_presets_are_listed():
    assert set(FULL_DEPTH) == set(SHAPES)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_full_depth_shape(name):
    layers, vocab, experts = SHAPES[name]
    spec = preset(name)
    assert (spec.n_layers, spec.vocab, spec.n_experts) == (layers, vocab, experts)
    assert len(spec.moe_layers) == layers and spec.n_experts_used <= spec.n_experts <= FULL_DEPTH[name]
    assert preset(name, experts=FULL_DEPTH[name]).n_experts == FULL_DEPTH[name]


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q8_0"])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_bytes_per_token_are_the_real_models(name, ftype):
    """Every tensor class a token reads has the real model's bytes; only the routers (one F32 row per expert per
    MoE layer, read whole) shrink with the experts, and the total."""
    if name == "gptoss-20b" and ftype == "Q4_K_M":
        ftype = "MXFP4_MOE"  # gpt-oss's experts as released
    fewer = preset(name)
    real = preset(name, experts=FULL_DEPTH[name])
    s, r = summarize(fake_arch(fewer, ftype)), summarize(fake_arch(real, ftype))
    for cls in set(s.by_class) | set(r.by_class):
        if cls not in ("routed_experts", "router"):
            assert s.by_class[cls] == r.by_class[cls], cls
    router = sum(s.by_class["router"].values()), sum(r.by_class["router"].values())
    assert s.bytes_per_token - router[0] == r.bytes_per_token - router[1]
    per_row = 4 * fewer.hidden + 4 * (fewer.score_bias + fewer.router_bias)  # F32: a row, and any biases
    assert router[1] - router[0] == sum(fewer.moe_layers) * (real.n_experts - fewer.n_experts) * per_row
    assert router[1] - router[0] < 0.04 * r.bytes_per_token
    experts = sum(s.by_class["routed_experts"].values()), sum(r.by_class["routed_experts"].values())
    assert experts[0] * real.n_experts == experts[1] * fewer.n_experts  # each expert the real size
    if name != "gptoss-20b":
        assert s.total_bytes < 0.5 * r.total_bytes


def test_the_shapes_are_the_released_configs():
    """Against transformers' config classes' defaults, where they are the model's (Qwen3MoeConfig's are
    Qwen3-30B-A3B's but 24 layers where it has 48; Qwen3_5MoeTextConfig's are Qwen3.5-35B-A3B's; GptOssConfig's are
    gpt-oss-120b's: the 20b has 24 layers and 32 experts; Glm4MoeConfig's are GLM-4.5-Air's but head_dim, which
    its config.json sets to 128; DeepseekV2Config's MLA dims are V2-Lite's)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    F = namedtuple("F", "vocab hidden n_heads n_kv_heads expert_ffn n_experts n_experts_used")

    def fields(spec, experts):
        return F(spec.vocab, spec.hidden, spec.n_heads, spec.n_kv_heads, spec.expert_ffn, experts,
                 spec.n_experts_used)

    c = transformers.Qwen3MoeConfig()
    q3 = preset("qwen3moe-30b")
    assert fields(q3, 128) == F(c.vocab_size, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                                c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok)
    assert q3.head_dim == 128 and q3.n_layers == 48

    c = Qwen3_5MoeTextConfig()
    q35 = preset("qwen35moe-35b")
    assert fields(q35, 256) == F(c.vocab_size, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                                 c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok)
    assert (q35.n_layers, q35.head_dim, q35.shared_ffn, q35.rope_dim) == (
        c.num_hidden_layers, c.head_dim, c.shared_expert_intermediate_size,
        int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    assert (q35.ssm_conv, q35.ssm_k_heads, q35.ssm_v_heads, q35.ssm_k_dim, q35.ssm_v_dim) == (
        c.linear_conv_kernel_dim, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
        c.linear_value_head_dim)
    assert [k == "linear" for k in q35.layer_kinds] == [t == "linear_attention" for t in c.layer_types]

    c = transformers.GptOssConfig()
    oss = preset("gptoss-20b")
    assert fields(oss, 32) == F(c.vocab_size, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                                c.intermediate_size, 32, c.num_experts_per_tok)
    assert (oss.head_dim, oss.sliding_window, oss.n_layers) == (c.head_dim, c.sliding_window, 24)
    assert [k == "sliding" for k in oss.layer_kinds] == [t == "sliding_attention" for t in c.layer_types[:24]]

    c = transformers.Glm4MoeConfig()
    glm = preset("glm45-air")
    assert fields(glm, 128) == F(c.vocab_size, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                                 c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok)
    lead = c.first_k_dense_replace
    assert glm.n_layers == c.num_hidden_layers and glm.moe_layers == (False,) * lead + (True,) * (46 - lead)
    assert (glm.dense_ffn, glm.shared_ffn, glm.rope_dim, glm.head_dim) == (
        c.intermediate_size, c.n_shared_experts * c.moe_intermediate_size,
        int(128 * c.rope_parameters["partial_rotary_factor"]), 128)
    assert (glm.n_groups, glm.topk_groups, glm.routed_scale, glm.norm_topk) == (
        c.n_group, c.topk_group, c.routed_scaling_factor, c.norm_topk_prob)

    c = transformers.DeepseekV2Config()
    v2 = preset("v2lite")
    assert (v2.vocab, FULL_DEPTH["v2lite"], v2.kv_lora_rank, v2.qk_nope_dim, v2.qk_rope_dim, v2.v_head_dim,
            v2.shared_ffn) == (c.vocab_size, c.n_routed_experts, c.kv_lora_rank, c.qk_nope_head_dim,
                               c.qk_rope_head_dim, c.v_head_dim, c.n_shared_experts * v2.expert_ffn)
    assert (v2.n_layers, v2.hidden, v2.n_heads, v2.n_experts_used, v2.expert_ffn, v2.q_lora_rank) == (
        27, 2048, 16, 6, 1408, 0)  # V2-Lite's config.json


# ---------------------------------------------------------------------------------------- bench/full_depth.py


def load_script():
    spec = importlib.util.spec_from_file_location("full_depth", ROOT / "bench" / "full_depth.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SHIM = """#!/bin/sh
# a stand-in llama-quantize: [--allow-requantize] IN OUT TYPE THREADS
echo "$@" >> "{log}"
[ "$1" = "--allow-requantize" ] && shift
[ -n "{fail}" ] && {{ echo "boom" >&2; printf x > "$2"; exit 3; }}
printf 'quantized %s from %s\\n' "$3" "$(basename "$1")" > "$2"
"""


@pytest.fixture
def shim(tmp_path):
    def make(fail: bool = False) -> tuple[Path, Path]:
        folder = tmp_path / ("bin-fail" if fail else "bin")
        folder.mkdir(exist_ok=True)
        log = tmp_path / "calls.log"
        exe = folder / "llama-quantize"
        exe.write_text(SHIM.format(log=log, fail="1" if fail else ""))
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
        return folder, log

    return make


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_writes_each_type_and_removes_the_intermediate(shim, tmp_path, capsys):
    fd = load_script()
    folder, log = shim()
    out = tmp_path / "out"
    args = ["--llama-bin", str(folder), "--out", str(out), "--models", "tiny-qwen3moe,tiny-gptoss",
            "--types", "Q4_K_M,Q8_0", "--threads", "1"]
    assert fd.main(args) == 0
    assert sorted(p.name for p in out.iterdir()) == ["tiny-gptoss-MXFP4_MOE.gguf", "tiny-gptoss-Q8_0.gguf",
                                                     "tiny-qwen3moe-Q4_K_M.gguf", "tiny-qwen3moe-Q8_0.gguf"]
    assert (out / "tiny-gptoss-MXFP4_MOE.gguf").read_text() == "quantized MXFP4_MOE from tiny-gptoss-F16.gguf\n"
    got = calls(log)
    assert len(got) == 4 and all(c.split()[0].endswith("-F16.gguf") and c.split()[-1] == "1" for c in got)
    assert "--allow-requantize" not in log.read_text()
    # a second run touches nothing: every file is there
    (out / "tiny-qwen3moe-Q8_0.gguf").write_text("the user's own")
    assert fd.main(args) == 0
    assert len(calls(log)) == 4 and (out / "tiny-qwen3moe-Q8_0.gguf").read_text() == "the user's own"
    assert "exists: skipped" in capsys.readouterr().out


def test_keep_and_an_intermediate_that_was_there(shim, tmp_path):
    fd = load_script()
    folder, log = shim()
    out = tmp_path / "out"
    base = ["--llama-bin", str(folder), "--out", str(out), "--models", "tiny-qwen3moe", "--threads", "1"]
    assert fd.main([*base, "--types", "Q4_K_M", "--src-type", "Q8_0", "--keep"]) == 0
    src = out / "tiny-qwen3moe-Q8_0.gguf"
    assert src.is_file() and (out / "tiny-qwen3moe-Q4_K_M.gguf").is_file()
    assert calls(log)[0].startswith("--allow-requantize ")  # from a quantized file
    before = src.stat().st_mtime_ns
    # the kept file is the next run's input, used as it is and not removed (the run did not write it)
    assert fd.main([*base, "--types", "Q6_K", "--src-type", "Q8_0"]) == 0
    assert src.stat().st_mtime_ns == before and (out / "tiny-qwen3moe-Q6_K.gguf").is_file()
    assert calls(log)[-1].split()[1:3] == [str(src), str(out / ".tiny-qwen3moe-Q6_K.gguf.partial")]


def test_not_enough_disk_is_one_line_and_writes_nothing(shim, tmp_path, monkeypatch, capsys):
    fd = load_script()
    folder, log = shim()
    out = tmp_path / "out"
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(fd.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    assert fd.main(["--llama-bin", str(folder), "--out", str(out), "--models", "tiny-qwen3moe"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "GB free" in err[0] and "--out" in err[0]
    assert list(out.iterdir()) == [] and calls(log) == []
    # the estimate: make-model's own types, the F16 intermediate and the outputs
    need = sum(fd.estimated_bytes(preset("tiny-qwen3moe"), t) for t in ("F16", "Q4_K_M", "Q8_0"))
    assert 0 < need < 10**7


def test_types_only_llama_quantize_writes_are_estimated_and_made(shim, tmp_path, capsys):
    """Q5_K_M and IQ4_XS (no make-model ftype): the space check estimates them from Q4_K_M's bytes, never below
    them; a name that is no type at all is one line, and nothing is written."""
    fd = load_script()
    spec = preset("v2lite")  # real shapes: whole K-quant blocks (a tiny model's rows fall back to Q8_0)
    q4, q8 = fd.estimated_bytes(spec, "Q4_K_M"), fd.estimated_bytes(spec, "Q8_0")
    assert q4 < fd.estimated_bytes(spec, "Q5_K_M") < q8 and fd.estimated_bytes(spec, "iq4_xs") == q4
    folder, log = shim()
    out = tmp_path / "out"
    base = ["--llama-bin", str(folder), "--out", str(out), "--models", "tiny-qwen3moe", "--threads", "1"]
    assert fd.main([*base, "--types", "Q5_K_M,IQ4_XS"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["tiny-qwen3moe-IQ4_XS.gguf", "tiny-qwen3moe-Q5_K_M.gguf"]
    assert [c.split()[2] for c in calls(log)] == ["Q5_K_M", "IQ4_XS"]
    capsys.readouterr()
    assert fd.main([*base, "--types", "Q9_Z"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: unknown quantization type Q9_Z: llama-quantize --help lists them"]
    assert len(calls(log)) == 2 and not (out / "tiny-qwen3moe-Q9_Z.gguf").exists()


def test_a_failed_quantize_leaves_no_file(shim, tmp_path, capsys):
    fd = load_script()
    folder, _ = shim(fail=True)
    out = tmp_path / "out"
    assert fd.main(["--llama-bin", str(folder), "--out", str(out), "--models", "tiny-qwen3moe",
                    "--types", "Q4_K_M", "--threads", "1"]) == 1
    err = capsys.readouterr().err
    assert "llama-quantize Q4_K_M" in err and "boom" in err
    assert list(out.iterdir()) == []  # neither the partial output nor the intermediate


def test_bad_arguments_are_one_line(shim, tmp_path, capsys):
    fd = load_script()
    folder, _ = shim()
    assert fd.main(["--llama-bin", str(tmp_path), "--out", str(tmp_path / "o"), "--models", "tiny-qwen3moe"]) == 1
    assert "no llama-quantize" in capsys.readouterr().err
    assert fd.main(["--llama-bin", str(folder), "--out", str(tmp_path / "o"), "--models", "nope"]) == 1
    assert "unknown model nope" in capsys.readouterr().err


@pytest.mark.skipif(not os.environ.get("MOERUN_LLAMA_BIN"), reason="MOERUN_LLAMA_BIN: llama.cpp's build/bin")
def test_with_llama_cpps_own_quantize(tmp_path):
    """The real llama-quantize on a tiny model: the output opens in moerun (MOERUN_LLAMA_BIN set)."""
    from moerun.arch import resolve
    from moerun.formats import open_model

    fd = load_script()
    out = tmp_path / "out"
    assert fd.main(["--llama-bin", os.environ["MOERUN_LLAMA_BIN"], "--out", str(out), "--models", "tiny-qwen3moe",
                    "--types", "Q8_0", "--threads", "1"]) == 0
    with open_model(out / "tiny-qwen3moe-Q8_0.gguf") as mf:
        assert resolve(mf).spec == preset("tiny-qwen3moe")


def test_load_times_take_turns_and_give_cpu_seconds(tmp_path, monkeypatch):
    """--time-load: a warm-up run of each engine, then rounds in turn, the first engine alternating by round; the
    table has each engine's median wall seconds, their ratio and the runs' user and system CPU seconds."""
    fd = load_script()
    log = tmp_path / "order"
    burn = "sum(i * i for i in range(300000))"

    def commands(path, args):
        return {"moerun": [sys.executable, "-c", f"open({str(log)!r}, 'a').write('m'); {burn}"],
                "llama.cpp": [sys.executable, "-c", f"open({str(log)!r}, 'a').write('l')"]}

    monkeypatch.setattr(fd, "load_commands", commands)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 1000)
    rows = fd.time_loads([model], argparse.Namespace(time_load=3))
    assert log.read_text() == "ml" + "ml" + "lm" + "ml"
    cells = [c.strip() for c in rows[2].strip("|").split("|")]
    assert cells[0] == "m.gguf" and float(cells[2]) > 0 and float(cells[3]) > 0
    assert float(cells[4]) == pytest.approx(float(cells[2]) / float(cells[3]), rel=0.25)  # cells rounded to 0.01 s
    user, sys_s = (float(x) for x in cells[5].split(","))
    assert user > 0 and sys_s >= 0  # the burner's CPU, from its rusage
    assert rows[-2].startswith("m.gguf moerun (wall s, in order): ") and len(rows[-2].split(": ")[1].split(",")) == 3

    def failing(path, args):
        return {"moerun": [sys.executable, "-c", "raise SystemExit(3)"]}

    monkeypatch.setattr(fd, "load_commands", failing)
    with pytest.raises(fd.FullDepthError, match="failed \\(3\\)"):
        fd.time_loads([model], argparse.Namespace(time_load=1))
