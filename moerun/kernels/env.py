"""The CPU kernels' settings from the environment and the machine, read once when moerun.kernels.cpu is imported:
MOERUN_PREFETCH, MOERUN_PREFETCH_NEAR, MOERUN_PREFETCH_HINT, MOERUN_AMX, and the pool's default thread count."""

from __future__ import annotations

import os
import warnings


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (logical CPUs when unknown)."""
    try:
        logical = len(os.sched_getaffinity(0))
    except AttributeError:
        logical = os.cpu_count() or 1
    try:
        import psutil

        physical = psutil.cpu_count(logical=False) or logical
        total = psutil.cpu_count(logical=True) or logical
        # an affinity mask of fewer CPUs than the machine has: scale by threads per core
        return max(1, min(logical, physical, logical * physical // max(total, 1)))
    except ImportError:
        return max(1, logical)


def env_prefetch(name: str = "MOERUN_PREFETCH") -> int:
    """MOERUN_PREFETCH: the kernels' prefetch distance in bytes (set_prefetch), or MOERUN_PREFETCH_NEAR: their second
    prefetch's, into L1 (set_prefetch_near); unset or "auto": the CPU's default."""
    v = os.environ.get(name, "auto").strip().lower()
    if v in ("", "auto"):
        return -1
    if not v.isdigit() or int(v) % 64 or int(v) > 65536:
        warnings.warn(f"{name}={v!r} is not auto or a multiple of 64 bytes in 0..65536: using the CPU's "
                      "default", stacklevel=2)
        return -1
    return int(v)


PREFETCH_HINTS = ("t0", "t1", "t2", "nta")  # pool.h's QK_PF_* in order


def env_amx() -> int:
    """MOERUN_AMX: 0 keeps batches off the AMX tiles (unset, "auto" or 1: on where the CPU has them, set_amx)."""
    v = os.environ.get("MOERUN_AMX", "auto").strip().lower()
    if v not in ("", "auto", "0", "1"):
        warnings.warn(f"MOERUN_AMX={v!r} is not auto, 0 or 1: the tiles stay on where the CPU has them", stacklevel=2)
    return 0 if v == "0" else -1


def env_prefetch_hint() -> int:
    """MOERUN_PREFETCH_HINT: t0 / t1 / t2 / nta (unset or "auto": the CPU's default, see set_prefetch_hint)."""
    v = os.environ.get("MOERUN_PREFETCH_HINT", "auto").strip().lower()
    if v in ("", "auto"):
        return -1
    if v not in PREFETCH_HINTS:
        warnings.warn(f"MOERUN_PREFETCH_HINT={v!r} is not auto or one of {', '.join(PREFETCH_HINTS)}: using the CPU's "
                      "default", stacklevel=2)
        return -1
    return PREFETCH_HINTS.index(v)
