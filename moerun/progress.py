"""Progress bars on a terminal (tqdm, on stderr): loading a model, making one, the first hardware probe.

A bar shows only when it is wanted (`shown`: stderr is a terminal and --no-progress was not given); otherwise
`bar` gives a counter that draws nothing, so the code that reports progress is the same either way.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol


class Counter(Protocol):
    def __call__(self, n: int) -> None: ...


def shown(no_progress: bool = False) -> bool:
    """Whether progress is drawn: not with --no-progress, and only on a terminal (never into a pipe or a log)."""
    return not no_progress and sys.stderr.isatty()


def _nothing(n: int) -> None:
    pass


@contextmanager
def bar(enabled: bool, desc: str, total: int, unit: str = "B") -> Iterator[Counter]:
    """A bar of `total` units (bytes: scaled, B/kB/MB...) while the block runs; the counter it gives takes the
    units done since the last call. Disabled: a counter that does nothing."""
    if not enabled or total <= 0:
        yield _nothing
        return
    from tqdm import tqdm

    scaled = unit == "B"
    with tqdm(total=total, desc=desc, unit=unit, unit_scale=scaled, unit_divisor=1024 if scaled else 1000,
              file=sys.stderr, leave=False, dynamic_ncols=True, mininterval=0.1) as t:
        yield t.update
