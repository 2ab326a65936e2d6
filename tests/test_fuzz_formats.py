"""Fuzzed model files: mutated GGUF files and Hugging Face folders open, resolve and summarize (what
`moerun inspect` does) or end in a one-line MoerunError; never another exception, a hang past the per-case
alarm, or a large allocation (tracemalloc peak per case). Strategies and the check: tests/fuzz_models.py;
long runs: bench/fuzz_formats.py. tests/test_formats.py keeps its byte-flip fuzz of the readers alone.
"""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
from fuzz_models import (
    DELETE,
    apply_gguf,
    apply_hf,
    build_bases,
    check,
    copy_base,
    gguf_cases,
    gguf_layout,
    hf_base,
    hf_cases,
    write_hf,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CASES = 300
# deadline=None: hypothesis' per-example wall-clock check would fail a case that a busy machine merely slowed;
# hangs are fuzz_models.check's alarm (a hang guard), allocations its tracemalloc peak
FUZZ = settings(max_examples=CASES, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module", autouse=True)
def _address_space_cap():
    """A runaway allocation fails with MemoryError (reported as a bug) instead of taking the machine down."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + 4 * 2**30, hard))
    yield
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return build_bases(tmp_path_factory.mktemp("fuzz-bases"))


@pytest.fixture(scope="module")
def gguf_layouts(bases):
    return {name: gguf_layout(path.read_bytes()) for name, path in bases.items() if name.endswith(".gguf")}


@pytest.fixture(scope="module")
def hf_bases(bases):
    return {name: hf_base(path) for name, path in bases.items() if name.endswith("-hf")}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz-work")


def _assert_safe(outcome, ops):
    assert outcome.kind != "bug", f"{outcome.label} for ops {ops!r}" + (
        f"\n{outcome.exc!r}" if outcome.exc is not None else "")


def test_bases_are_valid(bases):
    for path in bases.values():
        assert check(path).kind == "ok"


@FUZZ
@given(data=st.data())
def test_fuzz_gguf_inspect(data, gguf_layouts, work):
    name, ops = data.draw(gguf_cases(gguf_layouts), label="case")
    path = work / "case.gguf"
    path.write_bytes(apply_gguf(gguf_layouts[name], ops))
    _assert_safe(check(path), ops)


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors_inspect(data, hf_bases, work):
    name, ops = data.draw(hf_cases(hf_bases), label="case")
    folder = write_hf(work / "case-hf", *apply_hf(hf_bases[name], ops))
    _assert_safe(check(folder), ops)


def test_peak_rss_stays_bounded(bases, tmp_path):
    """Backstop for allocations tracemalloc cannot see: a batch of hostile counts leaves max RSS nearly flat."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    path = copy_base(bases["tiny-qwen3moe-F32.gguf"], tmp_path / "c.gguf")
    layout = gguf_layout(path.read_bytes())
    for label in ("n_kv", "n_tensors", "kv[tokenizer.ggml.tokens].count", "tensor[token_embd.weight].ne1"):
        path.write_bytes(apply_gguf(layout, [("field", label, 2**60)]))
        assert check(path).kind == "error"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB


# Minimal inputs of the bugs the fuzzer (F) or the review of what it exercised (R) found; each once escaped
# as another exception, hung, allocated what the file claimed, or (the last) passed unchecked. phrase None:
# the file must open.
GGUF_REGRESSIONS = [
    ("F", [("set_kv", "qwen3moe.rope.freq_base", (9, (4, [])))], "'rope.freq_base' must be a number"),
    ("F", [("set_kv", "qwen3moe.attention.layer_norm_rms_epsilon", (9, (12, [])))], "must be a number"),
    ("R", [("set_kv", "qwen3moe.attention.head_count", (4, 0))], "'attention.head_count' must be in 1.."),
    ("R", [("set_kv", "qwen3moe.block_count", (4, 60000))], "missing tensor 'blk.2.attn_norm.weight'"),
]
HF_REGRESSIONS = [
    ("F", [("rename", "model.layers.1.block_sparse_moe.experts.4.w3.weight",
            "model.layers.0.mlp.experts.99999999999.gate_proj.weight")], "are missing"),
    ("F", [("config", "rope_parameters", [None])], "'rope_parameters' must be an object"),
    ("F", [("tensor", "model.norm.weight", "dtype", ["F32"])], "has an invalid dtype"),
    ("R", [("config", "num_hidden_layers", 10**12)], "'num_hidden_layers' must be in 1..65536"),
    ("R", [("config", "head_dim", DELETE), ("config", "num_attention_heads", 0)], "'num_attention_heads' must be"),
    ("R", [("config", "rms_norm_eps", [1])], "'rms_norm_eps' must be a number"),
    ("R", [("config", "rope_parameters", DELETE), ("config", "rope_scaling", "linear")], "'rope_scaling' must be"),
    ("R", [("config", "mlp_only_layers", 5)], "'mlp_only_layers' must be a list"),
    ("R", [("config", "mlp_only_layers", [[1]])], "'mlp_only_layers' must be an integer"),
    ("R", [("config", "decoder_sparse_step", "x")], "'decoder_sparse_step' must be an integer"),
    ("R", [("tensor", "model.layers.9.mlp.experts.gate_up_proj", "entry",
            {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]})], None),
    ("R", [("tensor", "model.layers.0.block_sparse_moe.experts.3.w1.weight", "shape", [32, 128]),
           ("tensor", "model.layers.0.block_sparse_moe.experts.3.w1.weight", "dtype", "F16")],
     "expert 3 is F16 [32, 128], expert 0 is F32 [32, 64]"),
]


@pytest.mark.parametrize("found, ops, phrase", GGUF_REGRESSIONS)
def test_gguf_regressions(found, ops, phrase, gguf_layouts, work):
    path = work / "regression.gguf"
    path.write_bytes(apply_gguf(gguf_layouts["tiny-qwen3moe-F32.gguf"], ops))
    outcome = check(path)
    assert outcome.kind == "error" and phrase in str(outcome.exc), (outcome.label, outcome.exc)


@pytest.mark.parametrize("found, ops, phrase", HF_REGRESSIONS)
def test_safetensors_regressions(found, ops, phrase, hf_bases, work):
    folder = write_hf(work / "regression-hf", *apply_hf(hf_bases["tiny-mixtral-hf"], ops))
    outcome = check(folder)
    if phrase is None:
        assert outcome.kind == "ok", (outcome.label, outcome.exc)
    else:
        assert outcome.kind == "error" and phrase in str(outcome.exc), (outcome.label, outcome.exc)
