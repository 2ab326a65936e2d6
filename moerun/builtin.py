"""The built-in model (moerun/data/default-qwen3moe.gguf): where it is, and the names that stand for it.

`default`, or the file's own name, means the built-in model wherever a model is named (`inspect`, `estimate`,
`bench`, `-m`), unless a file or folder of that name exists in the working directory: a real file wins.
A leaf module (no torch), so the metadata-only commands can use it.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from moerun.errors import MoerunError

DEFAULT_MODEL = "default-qwen3moe.gguf"
ROUTING_MODEL = "routing-qwen3moe.gguf"  # the routing bench model (64 experts, top-8: expert-cache studies)
NAMES = ("default", DEFAULT_MODEL)
BUILTINS = {"default": DEFAULT_MODEL, DEFAULT_MODEL: DEFAULT_MODEL, "routing": ROUTING_MODEL,
            ROUTING_MODEL: ROUTING_MODEL}


def _builtin(name: str) -> Path:
    path = Path(str(resources.files("moerun") / "data" / BUILTINS[name]))
    if not path.is_file():
        raise MoerunError(f"the built-in model {name!r} is missing ({path}); pass a model with -m")
    return path


def default_model_path() -> Path:
    return _builtin(DEFAULT_MODEL)


def model_path(model: str | Path | None) -> Path:
    """The path of the model named `model`: None, `default` or the built-in file's name -> the built-in model,
    `routing` -> the routing bench model (unless a file of that name exists here); anything else as given."""
    if model is None:
        return default_model_path()
    if str(model) in BUILTINS and not Path(model).exists():
        return _builtin(str(model))
    return Path(model)
