"""The AArch64 NEON kernel set (kernels/csrc/dot_neon.c) against the portable one, on machines without an Arm
CPU: tests/neon_harness.c is cross-compiled with every kernel source and run under qemu-aarch64, once on a CPU
with the dot-product extension (every NEON dot and a threaded matmul per type must match the portable set)
and once on a Cortex-A72 (no dot product: the set must say it is unavailable, never crash).

Needs `aarch64-linux-gnu-gcc` and `qemu-aarch64` (Debian: gcc-aarch64-linux-gnu, qemu-user); skipped without.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CC, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
pytestmark = pytest.mark.skipif(not (CC and QEMU), reason="needs aarch64-linux-gnu-gcc and qemu-aarch64")


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("neon") / "neon_harness"
    sources = sorted(str(p) for p in (ROOT / "kernels" / "csrc").glob("*.c") if p.name != "module.c")
    subprocess.run([CC, "-O2", "-std=gnu11", "-Wall", "-Werror", "-static", "-I", str(ROOT / "kernels" / "csrc"),
                    str(ROOT / "tests" / "neon_harness.c"), *sources, "-lm", "-lpthread", "-o", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    return out


def test_neon_kernels_match_the_portable_set(harness):
    r = subprocess.run([QEMU, "-cpu", "max", str(harness)], check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "checks ok" in r.stdout


def test_cores_without_dot_product_fall_back(harness):
    r = subprocess.run([QEMU, "-cpu", "cortex-a72", str(harness)], check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "not available (best set: scalar)" in r.stdout
