"""Byte sizes as people write them ('6GiB', '512MiB', '8G', '1.5GB') and as moerun prints them.

At the base of the package: moerun.device reads MOERUN_STANDIN_VRAM with it, placement and the CLI read
budgets with it (moerun.placement.devices re-exports both functions).
"""

from __future__ import annotations

import re

__all__ = ["format_size", "parse_size"]

_UNITS = {"": 1, "b": 1,
          "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,  # one letter: binary, as ls -h / docker
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """'6GiB', '512MiB', '8G' (binary), '1.5GB' (decimal), '4096' (bytes) -> bytes.

    KiB/MiB/GiB/TiB and the one-letter K/M/G/T are powers of 1024; KB/MB/GB/TB powers of 1000.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size must not be negative, got {text}")
        return text
    if not isinstance(text, str):
        raise TypeError(f"size must be a string such as '6GiB', got {text!r}")
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"cannot read size {text!r}: expected a number and a unit, e.g. 6GiB, 512MiB, 8G, 1.5GB")
    unit = m[2].lower()
    if unit not in _UNITS:
        raise ValueError(f"unknown unit {m[2]!r} in size {text!r} (use B, KiB, MiB, GiB, TiB, K, M, G, T, KB, MB, "
                         "GB or TB)")
    return round(float(m[1]) * _UNITS[unit])


def format_size(n: int) -> str:
    """Bytes as a short binary figure: '3.20 GiB', '512.0 MiB', '17 B'."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
