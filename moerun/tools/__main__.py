"""`python -m moerun.tools make-model ...` / `python -m moerun.tools convert ...`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = ("make-model", "convert")
    if not argv or argv[0] not in commands:
        print(f"usage: python -m moerun.tools {{{','.join(commands)}}} [--help] ...", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "make-model":
        from moerun.tools.make_model import main as run
    else:
        from moerun.tools.convert import main as run
    return run(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
