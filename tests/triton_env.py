"""The Triton kernels' tests without a GPU: triton's interpreter for the duration (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch


@contextmanager
def interpreter():
    """TRITON_INTERPRET=1 where there is no CUDA (restored after); skips when triton cannot run kernels here."""
    from moerun.kernels import triton_q

    old = os.environ.get("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        if not triton_q.available():
            pytest.skip("triton cannot run kernels here")
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
