"""moerun: run Mixture-of-Experts language models larger than your GPU."""

import os

# torch's OpenMP workers spin ~300k rounds (milliseconds) after each parallel region, on the cores the kernel pool
# runs on next: 8% of a pp512's samples on 2 cores; a short spin keeps back-to-back torch ops warm (bench/RESULTS.md,
# issue 21). Read when torch loads libgomp, so only where moerun is imported first; a user's setting stands.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
# numpy's OpenBLAS threads spin about 0.1 s of a core after numpy's import (no BLAS call of moerun's needs them warm):
# 2.3 % of a V2-Lite load's CPU samples on 2 cores, beside the load's reading threads. 2^4 cycles instead; read when
# numpy loads OpenBLAS, so only where moerun is imported first; a user's setting stands.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from moerun.errors import ModelFormatError, MoerunError

__version__ = "0.1.0"
__all__ = ["ModelFormatError", "MoerunError", "__version__"]
