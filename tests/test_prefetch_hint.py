"""The interleaved kernels' prefetch hint beside its distance and the second, near prefetch into L1 (issue 36): no output
bit depends on any of them, bad values are refused, the table's near defaults, the environment sets both, and bench/prefetch_sweep.py's path runs (on any vendor: it only reads the
settings back).

No timing assertions: the machine is shared and the sweep's numbers are noise at this size.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_interleave import ISAS, QTYPES, q4k, this_cpu

cpu = pytest.importorskip("moerun.kernels.cpu")
pytestmark = pytest.mark.skipif(not cpu.available(), reason="moerun.kernels._cpu not built or disabled")

HINTS = ("t0", "t1", "t2", "nta")
DISTANCES = (64, 1024, 65536)  # a line, a typical distance, past the matrix's end (prefetches never fault)
NEARS = (0, 128, 4096)  # none, two lines, the Xeon's default
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def default_prefetch():
    yield
    cpu.set_prefetch()
    cpu.set_prefetch_hint()
    cpu.set_prefetch_near()


@QTYPES
@pytest.mark.parametrize("T", [1, 2, 5, 8])  # 8-row kernels' one-token loops (one per hint), 16-row ones, AVX2 chunks
def test_every_hint_and_distance_leaves_matmul_bits(qt, T, default_prefetch):
    w = q4k(72, 1024, seed=3, qt=qt)
    il = cpu.interleave(w)
    x = torch.randn(T, 1024, generator=torch.Generator().manual_seed(T))
    for isa in ISAS:
        cpu.set_prefetch(0)
        base, gguf_base = cpu.matmul(x, il, isa=isa), cpu.matmul(x, w, isa=isa)
        for hint in HINTS:
            cpu.set_prefetch_hint(hint)
            for nbytes in DISTANCES:
                cpu.set_prefetch(nbytes)
                assert (cpu.features()["prefetch"], cpu.features()["prefetch_hint"]) == (nbytes, hint)
                for near in NEARS:
                    cpu.set_prefetch_near(near)
                    assert torch.equal(cpu.matmul(x, il, isa=isa), base), (isa, hint, nbytes, near)
                assert torch.equal(cpu.matmul(x, w, isa=isa), gguf_base), (isa, hint, nbytes)


@QTYPES
@pytest.mark.parametrize("T", [1, 3])
def test_every_hint_and_distance_leaves_moe_bits(qt, T, default_prefetch):
    E, H, I, k = 4, 512, 256, 2
    gate, up = cpu.interleave(q4k(I, H, seed=1, lead=(E,), qt=qt)), cpu.interleave(q4k(I, H, seed=2, lead=(E,), qt=qt))
    down = cpu.interleave(q4k(H, I, seed=3, lead=(E,), qt=qt))
    gen = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    wts = torch.softmax(torch.randn(T, k, generator=gen), -1)
    x = torch.randn(T, H, generator=gen)
    for isa in ISAS:
        cpu.set_prefetch(0)
        base = cpu.moe_ffn(x, ids, wts, gate, up, down, isa=isa)
        for hint in HINTS:
            cpu.set_prefetch_hint(hint)
            for nbytes in DISTANCES:
                cpu.set_prefetch(nbytes)
                for near in NEARS:
                    cpu.set_prefetch_near(near)
                    assert torch.equal(cpu.moe_ffn(x, ids, wts, gate, up, down, isa=isa), base), (isa, hint, nbytes, near)


def this_cpus_default() -> tuple[int, str]:
    """(distance, hint) the measurements chose for the CPU running the test (tests/test_interleave.py's table)."""
    from test_interleave import expected_default

    return expected_default(*this_cpu())


def test_bad_values_raise_and_none_is_the_default(default_prefetch):
    for bad in ("t3", "", "l2", 1, True, b"t0"):
        with pytest.raises(ValueError, match="prefetch hint"):
            cpu.set_prefetch_hint(bad)
    for bad in (-64, 100, 65600, 1.5, True):
        with pytest.raises(ValueError, match="multiple of 64"):
            cpu.set_prefetch(bad)
    from moerun.kernels import _cpu

    for bad in (-2, 4):  # the C layer checks too
        with pytest.raises(ValueError, match="prefetch hint"):
            _cpu.set_prefetch_hint(bad)
    cpu.set_prefetch_hint(" NTA ")
    assert cpu.features()["prefetch_hint"] == "nta"
    cpu.set_prefetch_hint()  # the CPU's default, pool.c's table: NTA on AMD Zen 5, T1 on the others so far
    assert cpu.features()["prefetch_hint"] == this_cpus_default()[1]


def test_the_near_prefetchs_table_and_checks(default_prefetch):
    """4096 bytes on Intel family 6 model 207, where it was measured (bench/journal/issue-36.md, "A second prefetch
    into L1"); none elsewhere until measured there, every row whatever CPU runs the test."""
    rows = {("GenuineIntel", 6, 207): 4096, ("GenuineIntel", 6, 143): 0, ("GenuineIntel", 6, 0): 0,
            ("AuthenticAMD", 26, 2): 0, ("AuthenticAMD", 25, 17): 0, ("HygonGenuine", 24, 0): 0}
    for (vendor, family, model), want in rows.items():
        assert cpu._cpu.prefetch_near_default(vendor, family, model) == want, vendor
    for bad in (-64, 100, 65600, 1.5, True, "4k"):
        with pytest.raises(ValueError, match="near prefetch"):
            cpu.set_prefetch_near(bad)
    from moerun.kernels import _cpu

    for bad in (-2, 65, 65536 + 64):  # the C layer checks too
        with pytest.raises(ValueError, match="near prefetch"):
            _cpu.set_prefetch_near(bad)
    cpu.set_prefetch_near(1024)
    assert cpu.features()["prefetch_near"] == 1024
    cpu.set_prefetch_near()
    assert cpu.features()["prefetch_near"] in set(rows.values())


def _settings_in_a_fresh_process(tmp_path, **env) -> tuple[str, str]:
    code = ("from moerun.kernels import cpu; f = cpu.features(); "
            "print(f['prefetch'], f['prefetch_hint'], f['prefetch_near'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True,
                       env={**os.environ, **env})
    return r.stdout.strip(), r.stderr


def test_environment_sets_distance_hint_and_near(tmp_path):
    out, _ = _settings_in_a_fresh_process(tmp_path, MOERUN_PREFETCH="512", MOERUN_PREFETCH_HINT="NTA",
                                          MOERUN_PREFETCH_NEAR="1024")
    assert out == "512 nta 1024"
    near = cpu._cpu.prefetch_near_default(*this_cpu())
    out, err = _settings_in_a_fresh_process(tmp_path, MOERUN_PREFETCH="0", MOERUN_PREFETCH_HINT="t9",
                                            MOERUN_PREFETCH_NEAR="100")
    assert out == f"0 {this_cpus_default()[1]} {near}"  # warnings, the defaults
    assert "MOERUN_PREFETCH_HINT='t9'" in err and "MOERUN_PREFETCH_NEAR='100'" in err


def test_sweep_script_runs_on_a_tiny_model(tmp_path, monkeypatch, capsys):
    """One round of two settings, two tokens each: every run a fresh `moerun bench` process under the environment's
    setting (the script checks that the record echoes it), then the table."""
    from moerun.bench import cpu_info
    from moerun.tools.make_model import make_model

    model = make_model("tiny-qwen3moe", tmp_path / "tiny.gguf", ftype="Q4_K", progress=False)
    monkeypatch.setenv("MOERUN_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("prefetch_sweep", ROOT / "bench" / "prefetch_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    raw = tmp_path / "runs.jsonl"
    assert sweep.main([str(model), "-n", "2", "-t", "1", "--rounds", "1", "--hints", "nta", "--distances", "2048",
                       "--raw", str(raw)]) == 0
    out = capsys.readouterr().out
    assert "tg2, 1 threads, 1 rounds" in out and cpu_info() in out
    assert "| hint | 0 | 2048 |" in out
    row = next(line for line in out.splitlines() if line.startswith("| nta |"))
    assert "(1.000)" in row.split("|")[2]  # the baseline against itself
    assert len(raw.read_text().splitlines()) == 2
    with pytest.raises(SystemExit):
        sweep.main([str(model), "--hints", "l2"])


def test_settings_ab_script_runs_on_a_tiny_model(tmp_path, capsys):
    """bench/settings_ab.py: every setting each round in one process, the baseline's ratio 1, the CPU's defaults
    back afterwards; a malformed setting is a one-line error."""
    from moerun.tools.make_model import make_model

    model = make_model("tiny-qwen3moe", tmp_path / "tiny.gguf", ftype="Q4_K", progress=False)
    spec = importlib.util.spec_from_file_location("settings_ab", ROOT / "bench" / "settings_ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    def now():
        f = cpu.features()
        return f["prefetch"], f["prefetch_hint"], f["wide"], f["idle_prefetch"], f["prefetch_near"]

    before = now()
    ab.main([str(model), "-t", "1", "--steps", "2", "--rounds", "2", "--prompt", "4",
             "--settings", "base=pf:0", "nta=pf:2048,hint:nta,wide:1", "some=wide:q6_k+mxfp4,idle:0,near:1024"])
    out = capsys.readouterr().out
    assert out.count("round ") == 2 and "baseline base" in out
    assert "| base | pf:0 |" in out and "1.000 (2)" in out.split("| base |")[1].splitlines()[0]
    assert "| nta | pf:2048,hint:nta,wide:1 |" in out and "| some | wide:q6_k+mxfp4,idle:0,near:1024 |" in out
    assert now() == before
    for bad in ("base", "x=pf", "x=speed:3", "x=pf:100", "x=wide:q5_k", "x=wide:2", "x=idle:100", "x=idle:1m", "x=near:100"):
        with pytest.raises(SystemExit, match="setting"):
            ab.main([str(model), "--settings", bad])


def test_bigmat_script_runs_on_a_small_matrix(capsys):
    """bench/bigmat.py: one interleaved matrix a type, every setting each round, the first setting's ratio 1, the
    CPU's defaults back afterwards; an unknown type is a one-line error."""
    spec = importlib.util.spec_from_file_location("bigmat", ROOT / "bench" / "bigmat.py")
    bm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bm)
    before = cpu.features()
    bm.main(["--types", "mxfp4", "--gib", "0.001", "-t", "1", "--rounds", "2", "--calls", "1",
             "--settings", "base=pf:0", "t1=pf:8192,hint:t1,near:4096"])
    out = capsys.readouterr().out
    assert out.count("round ") == 2 and "2 rounds of 1 calls" in out
    rows = [line for line in out.splitlines() if line.startswith("| MXFP4 |")]
    assert len(rows) == 2 and all(r.endswith("| 1.000 |") for r in rows if "| base |" in r)
    assert cpu.features() == before
    from moerun.quant.qtypes import QType

    w = bm.big_matrix(QType.Q6_K, 0.03)  # the 4096 seed rows twice
    assert w.shape == (8192, 4096) and w.interleave == 8
    y = cpu.matmul(torch.randn(1, 4096), w)
    assert torch.equal(y[:, :4096], y[:, 4096:]) and y.abs().sum() > 0
    with pytest.raises(SystemExit, match="unknown type"):
        bm.main(["--types", "q9_z"])
    with pytest.raises(SystemExit, match="Q4_0 has no interleaved layout"):
        bm.main(["--types", "q4_0", "--gib", "0.001"])
    with pytest.raises(SystemExit, match="cannot quantize"):
        bm.main(["--types", "q5_k", "--gib", "0.001"])
