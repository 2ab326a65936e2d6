"""The AArch64 NEON kernel set (moerun/kernels/csrc/dot_neon.c) against the portable one, on machines without an Arm
CPU: tests/neon_harness.c is cross-compiled with every kernel source and run under qemu-aarch64, once on a CPU
with the dot-product extension (every NEON dot and a threaded matmul per type must match the portable set)
and once on a Cortex-A72 (no dot product: the set must say it is unavailable, never crash).

Built with GCC (`aarch64-linux-gnu-gcc`) and, where it is installed, clang (`--target=aarch64-linux-gnu`, which
takes another path for SDOT: clang's arm_neon.h up to 14 has no vdotq_s32 without a file-wide +dotprod).
Needs `aarch64-linux-gnu-gcc` and `qemu-aarch64` (Debian: gcc-aarch64-linux-gnu, qemu-user); skipped without.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CC, QEMU, CLANG = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64"), shutil.which("clang")
pytestmark = pytest.mark.skipif(not (CC and QEMU), reason="needs aarch64-linux-gnu-gcc and qemu-aarch64")
GCC_LIB = sorted(Path("/usr/lib/gcc-cross/aarch64-linux-gnu").glob("*"))  # crt files and libgcc for clang's link


def compilers() -> list[list[str]]:
    out = [[str(CC), "-std=gnu11"]]
    if CLANG and GCC_LIB:
        out.append([CLANG, "--target=aarch64-linux-gnu", "--sysroot=/usr/aarch64-linux-gnu", "-std=c11",
                    "-B", str(GCC_LIB[-1]), "-L", str(GCC_LIB[-1])])
    return out


@pytest.fixture(scope="module", params=range(2), ids=["gcc", "clang"])
def harness(request, tmp_path_factory) -> Path:
    if request.param >= len(compilers()):
        pytest.skip("clang is not installed")
    out = tmp_path_factory.mktemp("neon") / "neon_harness"
    sources = sorted(str(p) for p in (ROOT / "moerun" / "kernels" / "csrc").glob("*.c") if p.name != "module.c")
    r = subprocess.run([*compilers()[request.param], "-O2", "-Wall", "-Werror", "-static", "-I",
                        str(ROOT / "moerun" / "kernels" / "csrc"), str(ROOT / "tests" / "neon_harness.c"), *sources, "-lm",
                        "-lpthread", "-o", str(out)], check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return out


def test_neon_kernels_match_the_portable_set(harness):
    r = subprocess.run([QEMU, "-cpu", "max", str(harness)], check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "checks ok" in r.stdout


def test_cores_without_dot_product_fall_back(harness):
    r = subprocess.run([QEMU, "-cpu", "cortex-a72", str(harness)], check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "not available (best set: scalar)" in r.stdout
