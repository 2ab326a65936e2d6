"""Build of the C extension moerun.kernels._cpu; everything else about the package is in pyproject.toml.

The extension uses the plain CPython C API (no torch headers, so building it does not need torch).
Its AVX2 code is compiled through per-function target attributes and chosen at run time, so default
compiler flags suffice and the module runs on any x86-64 CPU (and builds portable code elsewhere).
"""

from pathlib import Path

from setuptools import Extension, setup

SOURCES = sorted(str(p) for p in Path("moerun/kernels/csrc").glob("*.c"))

# POSIX toolchains (gcc, clang). -ffp-contract=off: no implicit fused multiply-adds, so float results do not
# depend on how the compiler schedules a kernel (the explicit FMA intrinsics stay).
COMPILE_ARGS = ["-O3", "-std=c11", "-ffp-contract=off", "-pthread", "-Wall", "-Wextra",
                "-Wno-unused-parameter"]

setup(
    ext_modules=[
        Extension(
            "moerun.kernels._cpu",
            sources=SOURCES,
            depends=sorted(str(p) for p in Path("moerun/kernels/csrc").glob("*.[hi]*")),  # headers, *.inc
            extra_compile_args=COMPILE_ARGS,
            extra_link_args=["-pthread"],
            libraries=["m"],
        )
    ],
)
