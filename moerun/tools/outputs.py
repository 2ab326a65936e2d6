"""Writing outputs safely: a temporary file (or folder) next to the target, renamed into place at the end.

Outputs get the modes a plain open() would give them (0666 / 0777 less the umask), not the temporaries' 0600 /
0700. A user's existing file is never destroyed unless `overwrite=True`; an interrupted write leaves only
a hidden temporary, which is removed on the way out. A folder is replaced only when it looks like a
model folder (it holds a config.json) or is empty, so that `overwrite=True` cannot wipe, say, $HOME.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

__all__ = ["OutputExistsError", "atomic_dir", "atomic_file", "check_target", "error_line", "progress_bar", "umask"]


class OutputExistsError(FileExistsError):
    """The output exists and overwrite was not asked for. The message names the Python keyword; a command
    line prints `error_line(e)`, which names its flag."""

    def __init__(self, path: Path):
        super().__init__(f"{path} already exists (pass overwrite=True to replace it)")
        self.path = path


def error_line(e: Exception) -> str:
    """The one line a tool's command line prints for e."""
    if isinstance(e, OutputExistsError):
        return f"error: {e.path} already exists (pass --overwrite to replace it)"
    return f"error: {e}"


def umask() -> int:
    """The process's umask (read without changing it where /proc says it)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def check_target(path: Path, overwrite: bool) -> None:
    """Raise FileExistsError when `path` exists and may not be replaced (OutputExistsError when overwrite
    would allow it)."""
    if not (path.exists() or path.is_symlink()):
        return
    if not overwrite:
        raise OutputExistsError(path)
    if path.is_dir() and not path.is_symlink() and any(path.iterdir()) and not (path / "config.json").is_file():
        raise FileExistsError(f"{path} is a folder that does not look like a model folder; not replacing it")


@contextlib.contextmanager
def atomic_file(path: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary path in `path`'s folder; on success it becomes `path` (without clobbering)."""
    path = Path(path)
    check_target(path, overwrite)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder; give a file name for the output")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    tmp.chmod(0o666 & ~umask())  # mkstemp's 0600 would outlive the rename
    try:
        yield tmp
        _publish_file(tmp, path, overwrite)
    finally:
        tmp.unlink(missing_ok=True)


def _publish_file(tmp: Path, path: Path, overwrite: bool) -> None:
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # fails if `path` appeared meanwhile: never clobbers
    except FileExistsError:
        raise FileExistsError(f"{path} appeared while writing; not replacing it") from None
    except OSError:  # no hard links on this file system
        check_target(path, overwrite=False)
        os.replace(tmp, path)


@contextlib.contextmanager
def atomic_dir(path: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder next to `path`; on success it becomes `path`.

    With overwrite=True an existing model folder is moved aside, the new one moved in, then the old
    one deleted.
    """
    path = Path(path)
    check_target(path, overwrite)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} is a file; a Hugging Face model is written as a folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    tmp.chmod(0o777 & ~umask())  # mkdtemp's 0700 would outlive the rename
    try:
        yield tmp
        if path.exists():
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old"))
            os.replace(path, old / "x")
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.rename(tmp, path)  # an empty folder created meanwhile would be replaced; a full one not
            except OSError:
                raise FileExistsError(f"{path} appeared while writing; not replacing it") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def progress_bar(total: int, desc: str, enabled: bool = True) -> tqdm:
    """A tqdm bar counting bytes; disabled when not asked for or when stderr is not a terminal."""
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not enabled or not sys.stderr.isatty(), leave=False)
