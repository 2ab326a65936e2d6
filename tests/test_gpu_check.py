"""bench/gpu_check.sh on a machine without CUDA: the same steps on the CPU stand-in, as JSON (a generous timeout
only catches hangs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# the GPU check's whole script on the stand-in (~70 s): `python -m pytest -m slow`, and CI
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_runs_on_the_standin(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "MOERUN_BENCH_CACHE": str(tmp_path / "cache"),
           "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--standin", "-t", "1"], check=False, cwd=ROOT,
                       env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["device"] == "standin:0" and report["failed"] == [], (tmp_path / "out" / "tests.log").read_text()
    tests = report["steps"]["tests"]
    assert tests["rc"] == 0 and tests["tests"] >= 20 and tests["failures"] == tests["errors"] == 0, tests
    rows = report["rows"]
    by = {}
    for row in rows:
        by.setdefault(row["placement"][0], []).append(row)
    assert [len(by[k]) for k in "abc"] == [2, 6, 2]  # pp and tg; three cache sizes
    for row in rows:
        assert row["t_s"] > 0 and row["estimate_ts"] > 0 and row["test"] in ("pp64", "tg16")
    decode = [row for row in by["b"] if row["test"] == "tg16"]
    assert [row["cache_mib"] > 0 for row in decode] == [False, True, True]
    hits = [row["hit_rate"] for row in decode]
    assert hits[0] == 0.0 and hits[0] < hits[1] <= hits[2]  # a larger cache hits more
    assert all(row["home_share"] is not None for row in by["b"])
    assert "| b: experts in RAM" in (tmp_path / "out" / "gpu_check.md").read_text()
    counts = {(c["model"], c["placement"]): c for c in report["counts"]}
    vram = counts["a3b-L12 Q4_K_M", "all in VRAM"]
    assert vram["syncs_step"] == 1 and vram["kernels_layer"] <= 16 and vram["graph"] and vram["h200_ts"] >= 1000
    assert "predicted H200 tok/s" in (tmp_path / "out" / "gpu_check.md").read_text()
