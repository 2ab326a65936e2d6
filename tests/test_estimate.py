"""`moerun estimate` and the cost model: arithmetic checked against counts made independently from the GGUF
tensors (gguf's own reader), the hit-rate and miss terms, JSON fields, errors and figure labels. No timing."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner

from moerun.cli import main
from moerun.placement import bandwidth as bw_mod
from moerun.placement import costmodel as cm
from moerun.placement import probes

GB = 1e9


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moerun.tools.make_model import make_model

    return make_model("tiny-qwen3moe", tmp_path_factory.mktemp("est") / "tiny.gguf", ftype="Q8_0", progress=False,
                      threads=1)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("MOERUN_CACHE", str(d))
    return d


@pytest.fixture(scope="module")
def counts(tiny):
    """Bytes per token counted from the file with gguf's reader: dense tensors whole, k/E of the routed
    experts, one embedding row."""
    import gguf

    r = gguf.GGUFReader(str(tiny))
    f = {x.name: x for x in r.fields.values()}

    def val(key):
        fld = f[key]
        return int(fld.parts[fld.data[0]][0])

    E, k = val("qwen3moe.expert_count"), val("qwen3moe.expert_used_count")
    dense = experts = embd_row = 0
    for t in r.tensors:
        if "_exps" in t.name:
            experts += int(t.n_bytes)
        elif t.name == "token_embd.weight":
            embd_row = int(t.n_bytes) // int(t.shape[-1])  # gguf shapes are innermost first: [hidden, vocab]
        else:
            dense += int(t.n_bytes)
    return {"E": E, "k": k, "dense": dense, "experts": experts, "embd_row": embd_row,
            "per_token": dense + experts * k / E + embd_row}


def estimate(*args, probe: bool = False):
    """`moerun estimate`, with --no-measure unless the test asks for probes (--measure, or probe=True: the
    default, which probes what the cache lacks)."""
    args = [*map(str, args)]
    if not probe and "--measure" not in args:
        args.append("--no-measure")
    return CliRunner().invoke(main, ["estimate", *args])


def estimate_json(*args, probe: bool = False) -> dict:
    r = estimate(*args, "--json", probe=probe)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_bytes_per_token_and_bound(tiny, counts):
    d = estimate_json(tiny, "-t", "1", "--ram-bw", "10", "--device", "cpu")
    assert d["home"] == "ram" and d["hit_source"] == "resident" and d["hit_rate"] is None
    assert d["bytes_per_token"] == pytest.approx(counts["per_token"], abs=8)
    by = d["bytes_per_token_by_class"]
    assert by["routed_experts"] == pytest.approx(counts["experts"] * counts["k"] / counts["E"], abs=2)
    assert by["embeddings"] == counts["embd_row"]
    assert d["bytes_per_token_by_tier"] == {"ram": d["bytes_per_token"]}
    # the bound: bandwidth only, every byte at the given 10 GB/s
    assert d["decode"]["bound_tok_s"] == pytest.approx(10 * GB / counts["per_token"], rel=1e-4)
    assert d["decode"]["bound"]["overhead_s"] == 0
    exp = d["decode"]["expected"]
    assert exp["tok_s"] < d["decode"]["bound_tok_s"]
    parts = ("dense_s", "experts_hit_s", "experts_miss_s", "overhead_s", "head_s")
    assert sum(exp[p] for p in parts) == pytest.approx(exp["total_s"])
    # the expectation at default kernel efficiency and overhead, recomputed by hand
    eff = cm.DEFAULT_KERNEL_EFF * 10 * GB
    f32 = sum(b for c, b in by.items() if c in ("norms", "router"))  # float tensors: torch, at raw bandwidth
    hand = (d["bytes_per_token"] - f32) / eff + f32 / (10 * GB) + 2 * cm.DEFAULT_LAYER_OVERHEAD_S
    assert exp["total_s"] == pytest.approx(hand, rel=1e-3)
    assert {"total_params", "active_params", "prefill", "memory", "llama_cpp", "sources", "plan", "rates"} <= set(d)
    assert d["prefill"]["n_tokens"] == 512 and d["prefill"]["tok_s"] > 0 and d["prefill"]["ttft_s"] > 0
    assert d["llama_cpp"].startswith(f"llama-cli -m {tiny} -t 1 -c ") and d["llama_cpp"].endswith("--no-mmap")
    assert d["memory"]["devices"][0]["kv_bytes"] > 0


def test_hit_rate_and_miss_terms(tiny, counts):
    # a cache of 2 experts per layer (the runtime's split: MiB / (one expert x MoE layers))
    one_expert = counts["experts"] / 2 / counts["E"]  # 2 MoE layers
    mib = 2 * one_expert * 2 / (1 << 20)
    d = estimate_json(tiny, "-t", "1", "--ram-bw", "10", "--disk-bw", "1", "--expert-cache-mib", f"{mib + 1e-4:.6f}",
                      "--device", "cpu")
    assert d["home"] == "disk" and d["hit_source"] == "uniform"
    h = 2 / counts["E"]
    assert d["hit_rate"] == pytest.approx(h)
    b = d["decode"]["bound"]
    routed = counts["experts"] * counts["k"] / counts["E"]
    assert b["experts_hit_s"] == pytest.approx(routed * h / (10 * GB), rel=1e-4)
    # a CPU miss is read from the file into a slot (1 GB/s), then computed from RAM (10 GB/s)
    assert b["experts_miss_s"] == pytest.approx(routed * (1 - h) * (1 / GB + 1 / (10 * GB)), rel=1e-4)
    assert d["bytes_per_token_by_tier"]["disk"] == pytest.approx(routed * (1 - h), abs=2)
    assert "--no-mmap" not in d["llama_cpp"]


def experts_0_and_1(path, counts):
    """A decode trace of 10 tokens over the tiny model's 2 layers, always routed to experts 0 and 1."""
    from moerun.experts.trace import TraceHeader, TraceWriter

    with TraceWriter(path, TraceHeader("qwen3moe", 2, counts["E"], counts["k"])) as tw:
        for pos in range(10):
            for layer in range(2):
                tw.write_step(layer=layer, phase="decode", request_ids=[0], positions=[pos], experts=[[0, 1]],
                              weights=[[0.5, 0.5]])
    return path


def test_trace_hit_rate(tiny, counts, tmp_path):
    """--trace replaces slots/E by the trace's decode hit rate: a trace that always routes to experts 0 and 1
    misses only on the first step of each layer (2 of 2 x 10 queries)."""
    path = experts_0_and_1(tmp_path / "routing.jsonl", counts)
    one_expert = counts["experts"] / 2 / counts["E"]
    mib = 2 * one_expert * 2 / (1 << 20) + 1e-4
    d = estimate_json(tiny, "-t", "1", "--ram-bw", "10", "--disk-bw", "1", "--expert-cache-mib", f"{mib:.6f}",
                      "--device", "cpu", "--trace", path)
    assert d["hit_source"] == "trace"
    assert d["hit_rate"] == pytest.approx(18 / 20)
    routed = counts["experts"] * counts["k"] / counts["E"]
    assert d["decode"]["bound"]["experts_hit_s"] == pytest.approx(routed * 0.9 / (10 * GB), rel=1e-4)


def test_cache_plan_sizes_each_layer(tiny, counts, tmp_path):
    """--expert-cache-plan: layer 0 with 1 slot hits expert 0 and bypasses 1 (9 of 20 hit), layer 1 with 2
    slots misses only its first step (18 of 20); the estimate's hit rate is their mean."""
    from moerun.experts.allocate import write_plan
    path = experts_0_and_1(tmp_path / "routing.jsonl", counts)
    plan = tmp_path / "plan.json"
    write_plan(plan, {0: 1, 1: 2}, total_slots=3)
    d = estimate_json(tiny, "-t", "1", "--ram-bw", "10", "--disk-bw", "1", "--expert-cache-plan", plan,
                      "--device", "cpu", "--trace", path)
    assert d["hit_source"] == "trace" and d["hit_rate"] == pytest.approx((9 / 20 + 18 / 20) / 2)
    one_expert = counts["experts"] / 2 / counts["E"]
    assert d["memory"]["devices"][0]["cache_bytes"] == pytest.approx(3 * one_expert, abs=2)
    for args, msg in ((["--expert-cache-mib", "1"], "not both"), ([], None)):
        bad = tmp_path / "bad.json"
        bad.write_text("{}")
        res = CliRunner().invoke(main, ["estimate", str(tiny), "--no-measure", "--device", "cpu",
                                        "--expert-cache-plan", str(plan if msg else bad), *args])
        assert res.exit_code != 0 and "Traceback" not in res.output
        assert (msg or "not a cache plan") in res.output


def test_miss_choice():
    kw = {"home_gbps": 20, "link_gbps": 10, "compute_gbps": 1000}
    # one token: shipping 2 x hidden floats beats moving a 10 MB expert
    assert cm.miss_choice(10e6, 1, 4096, **kw) == "home"
    # many tokens on the same expert: the activations outweigh the weights
    assert cm.miss_choice(10e6, 100_000, 4096, **kw) == "fetch"
    t = cm.miss_time(10e6, 1, 4096, **kw, launch_s=0)
    assert t["fetch"] == pytest.approx(10e6 / 10e9 + 10e6 / 1000e9)
    assert t["home"] == pytest.approx(10e6 / 20e9 + 2 * 4096 * 4 / 10e9)


def test_prefill_arithmetic():
    p = (cm.Part(0, "attention", "Q4_K", "ram", "cpu", 1000, 1000),
         cm.Part(0, "routed_experts", "Q4_K", "ram", "cpu", 8000, 8000))
    w = cm.Workload(1, 8, 2, 64, 4, 16, p, (1.0,), "resident")
    rates = cm.Rates(cm.Figure(10, "given"), cm.Figure(1, "given"), cm.Figure(0, "default"), cm.Figure(0, "default"),
                     cm.Figure(1e9, "default"), cm.Figure(2e9, "default"))
    m = 16
    pre = cm.prefill_time(w, rates, m, ubatch=512)
    compute = 2 * 1000 * m / 1e9 + 2 * 8000 * m * 2 / 8 / 1e9 + 4 * 4 * 16 * m * (m + 1) / 2 / 2e9
    assert pre.compute == pytest.approx(compute)
    assert pre.seconds == pytest.approx(max(compute, pre.memory))
    assert pre.tok_s == pytest.approx(m / pre.seconds)
    # the default Q8_0 prefill rate is the K-quants' x DEFAULT_QFLOPS_FACTOR
    assert rates.flops("Q8_0") == pytest.approx(1e9 * cm.DEFAULT_QFLOPS_FACTOR["Q8_0"])


def test_bad_file_one_line_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    r = estimate(bad)
    assert r.exit_code == 1
    assert r.output.strip().startswith("error:") and len(r.output.strip().splitlines()) == 1
    r = estimate(tmp_path / "missing.gguf")
    assert r.exit_code == 1 and r.output.startswith("error:") and len(r.output.strip().splitlines()) == 1


def footer(r) -> str | None:
    """The line under the rates that names the default figures, if there is one."""
    lines = [line.strip() for line in r.output.splitlines() if line.strip().startswith("(default figures")]
    assert len(lines) <= 1
    return lines[0] if lines else None


def quiet_machine(monkeypatch) -> None:
    """The load readings replaced by a machine where nothing else runs (the probes' verdicts do not depend on
    what the other processes on this shared machine do)."""
    import time

    from moerun.placement import load

    monkeypatch.setattr(load, "read", lambda: load.Sample(time.monotonic(), 0.0, 0.0, 0.0))


def stub_probes(monkeypatch) -> dict[str, int]:
    """The probes replaced by fixed figures (no timing in tests); -> how often each ran."""
    from moerun.placement import layer_probe

    calls = {"ram": 0, "kernels": 0, "float": 0, "file": 0, "layers": 0}

    def count(name, value):
        def probe(*a, **kw):
            calls[name] += 1
            return value(*a) if callable(value) else value
        return probe

    monkeypatch.setattr(bw_mod, "measure_host_read_bandwidth", count("ram", {"gbps": 33.0, "measured_at": "now"}))
    monkeypatch.setattr(probes, "measure_kernels", count("kernels", lambda threads, qtypes: {
        q: {"decode_gbps": 25.0, "prefill_flops": 2e11} for q in qtypes if q not in cm.F32_NAMES}))
    monkeypatch.setattr(probes, "measure_float_flops", count("float", {"flops": 1e11, "spread": 0.01}))
    quiet_machine(monkeypatch)
    monkeypatch.setattr(probes, "measure_file_read", count("file", 3.0))
    monkeypatch.setattr(layer_probe, "measure_layers", count("layers", {
        "layer_s": 4e-4, "token_s": 1e-4, "prefill_layer_token_s": 1e-4}))
    return calls


def test_labels_default_cached_given_measured(tiny, cache, monkeypatch, tmp_path):
    d = estimate_json(tiny, "-t", "1", "--device", "cpu")
    assert set(d["sources"].values()) == {"default"}
    assert d["rates"]["ram_gbps"] == bw_mod.DEFAULT_HOST_READ_GBPS
    r = estimate(tiny, "-t", "1", "--device", "cpu")
    assert footer(r) == "(default figures for host RAM read, kernel Q8_0, torch float32, overhead: run `moerun " \
                        "estimate` without --no-measure, or with --measure, to measure this machine)"
    r = estimate(tiny, "-t", "1", "--device", "cpu", "--expert-cache-mib", "0.1")  # misses read the file
    assert "default figures for host RAM read, disk (file), kernel Q8_0," in footer(r)
    d = estimate_json(tiny, "-t", "1", "--ram-bw", "12.5", "--device", "cpu")
    assert d["sources"]["ram_gbps"] == "given" and d["rates"]["ram_gbps"] == 12.5

    # --measure: the probes (stubbed here: no timing in tests) run, are stored, and are labelled measured
    calls = stub_probes(monkeypatch)
    d = estimate_json(tiny, "-t", "1", "--measure", "--device", "cpu")
    assert set(d["sources"].values()) == {"measured"}, d["sources"]
    assert d["rates"]["disk_gbps"] == 3.0
    assert d["rates"]["ram_gbps"] == 33.0 and d["rates"]["kernel_gbps"]["Q8_0"] == 25.0
    assert d["rates"]["layer_overhead_s"] == 4e-4
    assert (cache / "hardware.json").is_file()
    d = estimate_json(tiny, "-t", "1", "--device", "cpu")
    assert d["sources"]["ram_gbps"] == "cached" and d["sources"]["layer_overhead_s"] == "cached"
    assert (d["sources"]["disk_gbps"], d["rates"]["disk_gbps"]) == ("cached", 3.0)  # for this file
    assert d["decode"]["expected"]["overhead_s"] == pytest.approx(2 * 4e-4 + 1e-4)
    for args in ((), ("--expert-cache-mib", "0.1")):  # nothing is a default any more: no footer
        r = estimate(tiny, "-t", "1", "--device", "cpu", *args)
        assert r.exit_code == 0 and footer(r) is None and "default" not in r.output, r.output
    other = tmp_path / "other.gguf"  # another file, maybe on another disk: its read rate is not known
    shutil.copy(tiny, other)
    d = estimate_json(other, "-t", "1", "--device", "cpu", "--expert-cache-mib", "0.1")
    assert d["sources"]["disk_gbps"] == "default" and d["sources"]["ram_gbps"] == "cached"
    assert footer(estimate(other, "-t", "1", "--device", "cpu", "--expert-cache-mib", "0.1")) == \
        "(default figures for disk (file): run `moerun estimate` without --no-measure, or with --measure, to " \
        "measure this machine)"
    # another thread count has nothing cached
    d = estimate_json(tiny, "-t", "3", "--device", "cpu")
    assert d["sources"]["layer_overhead_s"] == "default"
    assert calls == {"ram": 1, "kernels": 1, "float": 1, "file": 1, "layers": 1}


def test_the_default_probes_what_the_cache_lacks_once(tiny, cache, monkeypatch):
    """Issue 15, item 6: a user's first estimate measures this machine (quickly) without being asked, later
    ones read the cache, --no-measure never probes; the file's read rate only when the plan reads the file."""
    calls = stub_probes(monkeypatch)
    d = estimate_json(tiny, "-t", "1", "--device", "cpu", probe=True)
    assert calls == {"ram": 1, "kernels": 1, "float": 1, "file": 0, "layers": 1}
    assert d["sources"]["ram_gbps"] == d["sources"]["layer_overhead_s"] == "measured"
    assert d["sources"]["kernel_gbps.Q8_0"] == "measured" and d["rates"]["layer_overhead_s"] == 4e-4
    r = estimate(tiny, "-t", "1", "--device", "cpu", probe=True)
    assert r.exit_code == 0 and footer(r) is None
    d = estimate_json(tiny, "-t", "1", "--device", "cpu", probe=True)
    assert calls["layers"] == 1 and calls["ram"] == 1 and d["sources"]["layer_overhead_s"] == "cached"
    estimate_json(tiny, "-t", "1", "--device", "cpu", "--expert-cache-mib", "0.1", probe=True)
    assert calls["file"] == 1  # its experts now come from the file
    estimate_json(tiny, "-t", "2", "--device", "cpu")  # --no-measure: another thread count, still nothing run
    assert calls == {"ram": 1, "kernels": 1, "float": 1, "file": 1, "layers": 1}


def test_the_layer_probe_builds_the_models_own_layers(tiny):
    """The probe's layout: the model's spec, its qtypes per tensor kind, experts capped near
    PROBE_EXPERT_BYTES (never fewer than k), a prompt with the model's tokens per expert at 512; the weights
    it builds are what load_model would hold (the kernels' interleaved layout where they take it)."""
    from moerun.arch import resolve
    from moerun.arch.tensors import expected_shapes
    from moerun.formats import open_model
    from moerun.placement import layer_probe as lp

    with open_model(tiny) as mf:
        arch = resolve(mf)
    lay = lp.probe_layout(arch)
    assert lay["qtypes"]["ffn_gate_exps.weight"] == "Q8_0" and lay["qtypes"]["attn_norm.weight"] == "F32"
    assert lay["experts"] == arch.spec.n_experts  # tiny: every expert fits the byte cap
    assert lay["prompt"] == lp.PROBE_PROMPT and lay["prefill_k"] == 2  # 128 tokens per expert at 512: k caps it
    assert lp.layout_key(lay) == lp.layout_key(lp.probe_layout(arch)) and lp.layout_key(lay).startswith("qwen3moe-")
    spec = lp.probe_spec(lay, 3)
    assert (spec.n_layers, spec.moe_layers, spec.vocab) == (3, (True,) * 3, lp.PROBE_VOCAB)
    assert spec.hidden == arch.spec.hidden and spec.expert_ffn == arch.spec.expert_ffn
    w = lp.build_weights(lay, spec)
    assert {cn: t.shape for cn, t in w.items()} == expected_shapes(spec)
    cpu = pytest.importorskip("moerun.kernels.cpu")
    if cpu.available():
        from moerun.quant.qtypes import QTensor

        exps = w[lp.CName("ffn_gate_exps.weight", 1)]
        assert exps.interleave == 8
        # tiling interleaved groups of 8 rows is interleaving the tiled rows
        plain = cpu.deinterleave(exps)
        again = cpu.interleave(QTensor(plain.data.clone(), plain.qtype, plain.shape))
        assert torch.equal(again.data, exps.data)


def test_estimate_and_inspect_read_metadata_without_importing_torch(tiny, tmp_path):
    """Issue 7: under 2 s on a 15 GB file. Importing torch alone takes 1-2 s here, so the metadata-only
    commands must not import it (measured on a3b-L12 F16, 15 GB: 0.5 s; bench/RESULTS.md): `--no-measure`,
    and the default once the cache holds this machine's figures for the model's layers."""
    import subprocess
    import sys

    from moerun.arch import resolve
    from moerun.formats import open_model
    from moerun.placement import layer_probe

    with open_model(tiny) as mf:
        key = layer_probe.layout_key(layer_probe.probe_layout(resolve(mf)))
    figures = {"host_read_bandwidth": {"1": {"gbps": 30.0}}, "kernel_decode_gbps": {"1": {"Q8_0": {
        "gbps": 30.0, "flops": 2e11}}}, "float_flops": {"1": {"flops": 1e11}},
        "forward_overhead": {"1": {key: {"layer_s": 1e-4, "token_s": 1e-4, "prefill_layer_token_s": 1e-5}}}}
    (tmp_path / "hardware.json").write_text(json.dumps(figures))
    code = ("import json, sys\nfrom moerun.cli import main\n"
            "for args in (['estimate', sys.argv[1], '--json', '-t', '1'] + sys.argv[2:], ['inspect', sys.argv[1]]):\n"
            "    try:\n        main(args)\n    except SystemExit as e:\n        assert not e.code, e.code\n"
            "print('torch' in sys.modules)\n")
    env = {**os.environ, "MOERUN_CACHE": str(tmp_path)}
    for extra in ([], ["--no-measure"]):
        r = subprocess.run([sys.executable, "-c", code, str(tiny), *extra], check=False, capture_output=True,
                           text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().splitlines()[-1] == "False", extra
        assert '"layer_overhead_s": "cached"' in r.stdout


def test_gpu_bandwidth_flags_and_vram_budget(tiny, cache):
    """--h2d-bw / --vram-bw override the NVML-derived defaults for a GPU; --vram-budget without a GPU warns."""
    from types import SimpleNamespace

    gpu = SimpleNamespace(pcie_gbps=32.0, mem_bandwidth_gbps=1000.0)
    given = probes.gather_rates(probes.RateOptions(gpu=gpu, h2d_gbps=25.0, vram_gbps=900.0), cache=cache / "hw.json")
    assert (given.h2d_gbps.value, given.h2d_gbps.source) == (25.0, "given")
    assert (given.device_gbps.value, given.device_gbps.source) == (900.0, "given")
    derived = probes.gather_rates(probes.RateOptions(gpu=gpu), cache=cache / "hw.json")
    assert derived.h2d_gbps.source == derived.device_gbps.source == "default"
    assert derived.h2d_gbps.value == pytest.approx(32.0 * probes.LINK_EFF)
    r = CliRunner().invoke(main, ["estimate", str(tiny), "--device", "cpu", "--vram-budget", "6GiB", "--json"])
    assert r.exit_code == 0 and "--vram-budget has no effect" in r.stderr
    assert json.loads(r.stdout)["devices"] == ["cpu"]
    bad = CliRunner().invoke(main, ["estimate", str(tiny), "--vram-budget", "6GiB,x"])
    assert bad.exit_code == 1 and "cannot read size 'x'" in bad.output


def test_batch_reads_the_union_of_the_tokens_experts(tiny, counts):
    """-b B: one step reads the dense tensors once, B embedding rows and 1 - (1 - k/E)^B of each layer's experts."""
    one = estimate_json(tiny, "-t", "1", "--ram-bw", "10", "--device", "cpu")
    b8 = estimate_json(tiny, "-t", "1", "--ram-bw", "10", "--device", "cpu", "-b", "8")
    E, k = counts["E"], counts["k"]
    share = 1 - (1 - k / E) ** 8
    step = counts["dense"] + counts["experts"] * share + 8 * counts["embd_row"]
    assert b8["batch"] == 8 and b8["decode"]["bound"]["batch"] == 8
    assert b8["bytes_per_token_by_class"]["routed_experts"] == pytest.approx(counts["experts"] * share, abs=2)
    assert b8["bytes_per_token"] * 8 == pytest.approx(step, abs=16)
    assert b8["decode"]["bound_tok_s"] == pytest.approx(8 * 10 * GB / step, rel=1e-4)
    assert b8["decode"]["expected_tok_s"] > one["decode"]["expected_tok_s"]  # a step serves 8 tokens
    assert one["decode"]["bound"]["batch"] == 1


def test_gpus_without_a_gpu_is_one_line(tiny):
    r = estimate(tiny, "--gpus", "0,1")
    assert r.exit_code == 1 and "no CUDA device" in r.output and "--device cpu" in r.output
    assert "--assume-gpus" in r.output and len(r.output.strip().splitlines()) == 1
    assert "Traceback" not in r.output


def test_a_cache_too_small_for_one_slot_says_so(tiny):
    r = estimate(tiny, "--device", "cpu", "--expert-cache-mib", "0.001")
    assert r.exit_code == 0, r.output
    assert "warning: --expert-cache-mib 0.001 gives no expert cache (0 slots): one slot in each of the" in r.stderr


@pytest.mark.parametrize("name", [n for n in __import__("moerun.tools.presets", fromlist=["x"]).preset_names()
                                  if n.startswith("tiny-")])
def test_the_layer_probe_runs_every_family(name, tmp_path):
    """Every family's layers build and run in the probe (attention kinds, MLA, leading dense layers, shared
    experts, biases): its figures are finite and not negative. No timing is asserted."""
    import math

    from moerun.arch import resolve
    from moerun.formats import open_model
    from moerun.placement import layer_probe as lp
    from moerun.tools.make_model import make_model

    path = make_model(name, tmp_path / f"{name}.gguf", ftype="Q8_0", progress=False, threads=1)
    with open_model(path) as mf:
        arch = resolve(mf)
    lay = lp.probe_layout(arch)
    assert lay["spec"]["family"] == arch.spec.family
    rates = probes.gather_rates(probes.RateOptions(threads=1, qtypes=["Q8_0"]), cache=tmp_path / "hw.json")
    r = lp.measure_layers(1, lay, rates, rounds=2, n_gen=2)
    assert all(math.isfinite(r[k]) and r[k] >= 0 for k in ("layer_s", "token_s", "prefill_layer_token_s")), r


def test_cache_trace_shares_the_slots_like_the_runtime(tiny, counts, tmp_path):
    """--expert-cache-trace: 4 slots a layer, where layer 0 needs 2 (experts 0 and 1) and layer 1 cycles through
    6, become 2 + 6; then layer 1 misses only its first three steps, where 4 slots missed every one."""
    from moerun.experts.trace import TraceHeader, TraceWriter

    assert counts["E"] >= 6 and counts["k"] == 2
    path = tmp_path / "cycle.jsonl"
    with TraceWriter(path, TraceHeader("qwen3moe", 2, counts["E"], counts["k"])) as tw:
        for pos in range(10):
            tw.write_step(layer=0, phase="decode", request_ids=[0], positions=[pos], experts=[[0, 1]],
                          weights=[[0.5, 0.5]])
            tw.write_step(layer=1, phase="decode", request_ids=[0], positions=[pos],
                          experts=[[2 * (pos % 3), 2 * (pos % 3) + 1]], weights=[[0.5, 0.5]])
    one_expert = counts["experts"] / 2 / counts["E"]
    mib = f"{2 * 4 * one_expert / (1 << 20) + 1e-4:.6f}"
    args = (tiny, "-t", "1", "--ram-bw", "10", "--disk-bw", "1", "--expert-cache-mib", mib, "--device", "cpu",
            "--cache-policy", "lru")
    even = estimate_json(*args, "--trace", path)
    shared = estimate_json(*args, "--expert-cache-trace", path)
    assert even["hit_rate"] == pytest.approx((18 / 20 + 0) / 2)
    assert shared["hit_source"] == "trace" and shared["hit_rate"] == pytest.approx((18 / 20 + 14 / 20) / 2)
    assert shared["memory"]["devices"][0]["cache_bytes"] == pytest.approx(8 * one_expert, abs=2)
    r = estimate(tiny, "--device", "cpu", "--expert-cache-trace", path)
    assert r.exit_code != 0 and "give it" in r.output and "Traceback" not in r.output
