"""Resource limits for chat templates from model files: the sandbox stops Python internals, these stop
templates that would run forever or allocate without bound.

  * steps: a trace function on the template's own frames counts executed lines and checks a deadline, so
    nested loops, huge ranges and runaway macros stop (macro recursion ends in RecursionError, caught by
    the caller);
  * sizes: `*`, `**` and `+` are intercepted, as are `~` joins, output buffers, `%` formatting, the str
    methods that pad, join or replace, and every filter's numeric arguments, so no single value grows
    past `max_chars` (or an int past `max_int_bits`) before it is allocated.

Exceeding a limit raises LimitError, a jinja2 SecurityError.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import wraps
from typing import Any

from jinja2.exceptions import SecurityError

__all__ = ["LimitError", "Limits", "guard_filters", "guarded_render", "size_checked_binop", "size_checked_call"]

TEMPLATE_FILENAME = "<template>"  # what jinja2 compiles from_string() templates under


class LimitError(SecurityError):
    """A chat template went past a step, time or size limit."""


@dataclass(frozen=True)
class Limits:
    max_steps: int = 5_000_000  # template lines executed per render
    max_seconds: float = 5.0
    max_chars: int = 1 << 24  # any one string or list built by the template, and the output
    max_int_bits: int = 4096


def _size(x: Any) -> int:
    return len(x) if isinstance(x, (str, list, tuple)) else 0


def _check_chars(n: int, limits: Limits, what: str) -> None:
    if n > limits.max_chars:
        raise LimitError(f"{what} would make {n} items, more than the limit of {limits.max_chars}")


def _big_int(x: Any, limits: Limits) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x.bit_length() > limits.max_int_bits


def size_checked_binop(op: str, left: Any, right: Any, limits: Limits) -> None:
    """Refuse `left op right` when the result would be too large (checked before it is computed)."""
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                _check_chars(len(seq) * max(n, 0), limits, "repeating a sequence")
        if isinstance(left, int) and isinstance(right, int) and \
                left.bit_length() + right.bit_length() > limits.max_int_bits:
            raise LimitError(f"an integer product of more than {limits.max_int_bits} bits")
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
                right * max(left.bit_length(), 1) > limits.max_int_bits:
            raise LimitError(f"an integer power of more than {limits.max_int_bits} bits")
    elif op == "+":
        _check_chars(_size(left) + _size(right), limits, "concatenating")
    elif op == "%" and isinstance(left, str):
        _check_format_string(left, right, limits)


_WIDTHS = re.compile(r"\d+")


def _check_format_string(fmt: str, args: Any, limits: Limits) -> None:
    """`%`-style and str.format widths: any number in the format, or a `*` argument, above max_chars."""
    if any(len(d) > 9 or int(d) > limits.max_chars for d in _WIDTHS.findall(fmt)):
        raise LimitError(f"a format width above the limit of {limits.max_chars}")
    values = args if isinstance(args, tuple) else (args,)
    if "*" in fmt and any(isinstance(v, int) and abs(v) > limits.max_chars for v in values):
        raise LimitError(f"a format width above the limit of {limits.max_chars}")


_PADDING = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs"})


def size_checked_call(obj: Any, args: tuple, kwargs: dict, limits: Limits) -> tuple:
    """Refuse str methods whose result would be too large: padding to a huge width, huge joins or replaces,
    format strings with huge widths. Returns the arguments to call with (a joined iterable, materialised)."""
    obj = getattr(obj, "__wrapped__", obj)  # the sandbox hands out str.format wrapped
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return args
    numbers = [a for a in (*args, *kwargs.values()) if isinstance(a, int)]
    if name in _PADDING and any(n > limits.max_chars for n in numbers):
        raise LimitError(f"str.{name} to a width above the limit of {limits.max_chars}")
    if name in ("format", "format_map"):
        _check_format_string(owner, (), limits)
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = owner.count(args[0]) if args[0] else len(owner) + 1
        _check_chars(len(owner) + count * (len(args[1]) - len(args[0])), limits, "str.replace")
    elif name == "join" and len(args) == 1:
        items = _joinable(args[0], len(owner), limits)
        return (items,)
    return args


def _joinable(iterable: Any, sep: int, limits: Limits) -> list:
    """The items of a join or sum, materialised, once their total size is known to be within the limit."""
    items = list(iterable)
    _check_chars(len(items), limits, "joining")
    _check_chars(sum(map(_size, items)) + sep * len(items), limits, "joining")
    return items


def checked_join(parts: Iterable[Any], limits: Limits) -> str:
    strs = [p if isinstance(p, str) else str(p) for p in parts]
    _check_chars(sum(map(len, strs)), limits, "joining strings")
    return "".join(strs)


def guard_filters(filters: dict[str, Callable], limits: Limits) -> dict[str, Callable]:
    """Every filter wrapped so that numeric arguments (widths, counts, indents) above max_chars are refused
    and `join`, `replace` and `format` results are size-checked first."""
    return {name: _guard_filter(name, f, limits) for name, f in filters.items()}


def _guard_filter(name: str, f: Callable, limits: Limits) -> Callable:
    skip = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1  # env/context, then the value

    @wraps(f)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        for a in (*args[skip:], *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > limits.max_chars:
                raise LimitError(f"filter {name!r} given {a}, above the limit of {limits.max_chars}")
        if name == "format" and len(args) >= skip and isinstance(args[skip - 1], str):
            _check_format_string(args[skip - 1], tuple(args[skip:]), limits)
        if name in ("join", "sum") and len(args) >= skip:
            sep = args[skip] if name == "join" and len(args) > skip else kwargs.get("d", "")
            items = _joinable(args[skip - 1], _size(sep), limits)
            args = (*args[:skip - 1], items, *args[skip:])
        out = f(*args, **kwargs)
        if isinstance(out, (str, list)):
            _check_chars(len(out), limits, f"filter {name!r}")
        return out

    return guarded


class _Meter:
    """Counts lines executed in template frames; raises LimitError past the step or time budget."""

    def __init__(self, limits: Limits):
        self.limits, self.steps = limits, 0
        self.deadline = time.monotonic() + limits.max_seconds

    def on_call(self, frame: Any, event: str, arg: Any) -> Callable | None:
        return self.on_line if frame.f_code.co_filename == TEMPLATE_FILENAME else None

    def on_line(self, frame: Any, event: str, arg: Any) -> Callable:
        self.steps += 1
        if self.steps > self.limits.max_steps:
            raise LimitError(f"the template ran more than {self.limits.max_steps} steps")
        if self.steps % 1024 == 0 and time.monotonic() > self.deadline:
            raise LimitError(f"the template ran longer than {self.limits.max_seconds} s")
        return self.on_line


def guarded_render(render: Callable[[], str], limits: Limits) -> str:
    """render() with the step meter on this thread (any tracer already there, e.g. coverage, is restored)."""
    previous = sys.gettrace()
    sys.settrace(_Meter(limits).on_call)
    try:
        return render()
    finally:
        sys.settrace(previous)
