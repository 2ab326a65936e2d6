"""The CPU kernels' tuning settings (moerun.kernels.cpu re-exports them): how far ahead and with which hint the
interleaved kernels prefetch weights, a second prefetch into L1, a block's prefetches beside its loads, what an idle
thread prefetches, which one-token passes run on 512-bit vectors, and the AMX tiles. Each takes None for the CPU's
default (pool.c's table, chosen by measurement per vendor and model); none changes a result bit, only speed."""

from __future__ import annotations

from collections.abc import Iterable

from moerun.kernels import native
from moerun.kernels.env import PREFETCH_HINTS

__all__ = ["WIDE_TYPES", "set_amx", "set_idle_prefetch", "set_prefetch", "set_prefetch_hint", "set_prefetch_near",
           "set_prefetch_spread", "set_wide", "wide_types"]

_cpu, _import_error = native.load(native.mode())  # the module cpu.py loads too (Python imports it once)


def _need() -> None:
    if _cpu is None:
        raise RuntimeError(f"CPU kernels unavailable: {_import_error}")


def set_prefetch(nbytes: int | None = None) -> None:
    """How far ahead (bytes, a multiple of 64 up to 65536; 0: not at all) the interleaved-layout kernels prefetch
    weight rows (into L2 by default: set_prefetch_hint) when they multiply one token (or up to 8 with AVX-512
    VNNI). None: the CPU's default (8192 on Intel family 6 model 207, 2048 on other Intel CPUs, 4096 on AMD Zen 5, 0
    elsewhere; the environment's MOERUN_PREFETCH overrides it at import); while it is not 0 the GGUF-layout kernels' own one-token prefetch goes to L2 as well. Results do not
    depend on it, only speed."""
    _set_bytes("set_prefetch", "prefetch", nbytes, 64, 65536)


def _set_bytes(setter: str, what: str, nbytes: int | None, step: int, top: int) -> None:
    """A byte count setting: None (-1 to C: the CPU's default) or a multiple of step in 0..top."""
    _need()
    if nbytes is not None and (not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0 or nbytes % step
                               or nbytes > top):
        raise ValueError(f"{what} must be None or a multiple of {step} bytes in 0..{top}, got {nbytes!r}")
    getattr(_cpu, setter)(-1 if nbytes is None else nbytes)


def set_prefetch_hint(hint: str | None = None) -> None:
    """Where the interleaved-layout kernels' prefetches (set_prefetch) put the lines: "t0" (every cache level, L1
    too), "t1" (L2), "t2" (L3) or "nta" (non-temporal: near the core, first to go), _mm_prefetch's hints as Intel
    describes them (what a CPU does with each is its own); case does not matter. None: the CPU's default ("t1";
    the environment's MOERUN_PREFETCH_HINT overrides it at import). It matters only while the distance is not 0.
    Results do not depend on it, only speed."""
    _need()
    if hint is not None and (not isinstance(hint, str) or hint.strip().lower() not in PREFETCH_HINTS):
        raise ValueError(f"prefetch hint must be one of {', '.join(PREFETCH_HINTS)}, got {hint!r}")
    _cpu.set_prefetch_hint(-1 if hint is None else PREFETCH_HINTS.index(hint.strip().lower()))


WIDE_TYPES = ("Q4_K", "Q6_K", "MXFP4")  # set_wide's types, in the order of pool.h's QK_WIDE_* bits


def set_wide(on: bool | Iterable[str] | None = None) -> None:
    """Which row types the AVX-512 VNNI kernels take one token through on 512-bit vectors rather than 256-bit ones:
    True all of Q4_K_R8 / Q6_K_R8 / MXFP4_R8, False none, or the names of some (WIDE_TYPES); None: the CPU's default
    (all on AMD Zen 5, Q6_K and MXFP4 on Intel family 6 model 207, where they were measured; none elsewhere). Results
    are the same bit for bit."""
    _need()
    if on is None or isinstance(on, bool):
        _cpu.set_wide(-1 if on is None else 7 * on)
        return
    names = [on] if isinstance(on, str) else list(on) if isinstance(on, (list, tuple, set, frozenset)) else None
    if names is None or any(not isinstance(n, str) or n.upper() not in WIDE_TYPES for n in names):
        raise ValueError(f"wide must be True, False, None or names among {', '.join(WIDE_TYPES)}, got {on!r}")
    _cpu.set_wide(sum(1 << WIDE_TYPES.index(n) for n in {n.upper() for n in names}))


def wide_types(mask: int) -> list[str]:
    """set_wide's mask (features()' and the table's) -> the names of its types."""
    return [t for i, t in enumerate(WIDE_TYPES) if mask >> i & 1]


def set_prefetch_spread(on: bool | None = None) -> None:
    """Where the one-token passes over Q4_K_R8 / Q5_K_R8 rows (and the 512-bit ones over Q6_K_R8, set_wide) prefetch a
    block's lines: each beside the loads of its part of the block (True) or all at the block's start (False); None: the
    CPU's default, on for Intel family 6 model 207, where it was measured. The same lines either way, and the same
    results bit for bit."""
    _need()
    if on is not None and not isinstance(on, bool):
        raise ValueError(f"prefetch spread must be True, False or None, got {on!r}")
    _cpu.set_prefetch_spread(-1 if on is None else int(on))


def set_idle_prefetch(nbytes: int | None = None) -> None:
    """How much of its share of the next pool job (the next matrices of a decode step, known in advance) a thread done
    with its share of the current one prefetches into L2 while it waits: a multiple of 4096 up to 16 MiB, 0 for none;
    None: the CPU's default (pool.c's table). The same results either way."""
    _set_bytes("set_idle_prefetch", "idle prefetch", nbytes, 4096, 16 << 20)


def set_prefetch_near(nbytes: int | None = None) -> None:
    """While the interleaved kernels prefetch (set_prefetch), their one-token passes also prefetch the lines this many
    bytes ahead into L1 (a multiple of 64 up to 65536; 0: not): the first prefetch brings each line to L2 early, this
    one to L1 shortly before its loads. None: the CPU's default (4096 on Intel family 6 model 207, where it was
    measured; 0 elsewhere; the environment's MOERUN_PREFETCH_NEAR overrides it at import). The same results."""
    _set_bytes("set_prefetch_near", "near prefetch", nbytes, 64, 65536)


def set_amx(on: bool | None = None) -> None:
    """Whether batches of Q8_0 / MXFP4 / Q4_K / Q5_K rows (a prompt's matrices, the experts 16 or more of its tokens
    chose) go through AMX tiles on CPUs that have AMX-INT8 (Intel Xeon since Sapphire Rapids): the VNNI kernels'
    integer sums and float steps, the same bits, faster (kernels/csrc/amx.c). None or True: where the CPU has them (the default;
    MOERUN_AMX=0 turns it off), False: the VNNI kernels for every batch."""
    _need()
    if on is not None and not isinstance(on, bool):
        raise ValueError(f"amx must be True, False or None, got {on!r}")
    _cpu.set_amx(-1 if on is None else int(on))
