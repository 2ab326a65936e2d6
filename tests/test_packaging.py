"""pyproject.toml ships every package of the tree and the files they read at run time (a non-editable install
has only what it lists)."""

from fnmatch import fnmatch
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_is_listed():
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "moerun").rglob("__init__.py")}
    assert set(_config()["packages"]) == found


def test_the_data_files_are_shipped():
    data = _config()["package-data"]
    for package, folder, kinds in (("moerun", "data", (".gguf", ".jinja", ".md")),
                                   ("moerun.server", "webui", (".html", ".css", ".js"))):
        base = ROOT / Path(*package.split("."))
        files = [p for p in (base / folder).rglob("*") if p.is_file() and p.suffix in kinds]
        assert files, folder
        for f in files:
            rel = f.relative_to(base).as_posix()
            assert any(fnmatch(rel, pattern) for pattern in data[package]), rel
