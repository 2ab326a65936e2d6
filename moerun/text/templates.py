"""The chat templates moerun ships (moerun/data/templates; their sources in the README there), by name, and the
`--chat-template NAME|TEMPLATE` / `--chat-template-file FILE` choice that overrides a model's own template.

    builtin_template("qwen3")                       # Qwen3's published template, as text
    chat_template_override("qwen3", None)           # the same; a value that is no name is the template itself
    chat_template_override(None, "tmpl.jinja")      # the file's text; None when neither is given

An override is compiled when it is chosen, so a template that does not compile is one error before any model
loads.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from types import MappingProxyType

from moerun.errors import MoerunError

__all__ = ["TEMPLATES", "builtin_template", "chat_template_override", "template_names"]

# --chat-template NAME -> the file in moerun/data/templates
TEMPLATES = MappingProxyType({
    "chatml": "chatml.jinja",
    "qwen3": "qwen3.jinja",
    "qwen3.5": "qwen3.5.jinja",
    "glm-4.6": "glm-4.6.jinja",
    "glm4": "glm-4.6.jinja",
    "deepseek-v3.1": "deepseek-v3.1.jinja",
    "mistral": "mistral-nemo.jinja",
    "mistral-nemo": "mistral-nemo.jinja",
    "mistral-small-3.2": "mistral-small-3.2.jinja",
    "gpt-oss": "gpt-oss.jinja",
})


def template_names() -> list[str]:
    return list(TEMPLATES)


def builtin_template(name: str) -> str:
    """The text of the shipped template `name` (see TEMPLATES)."""
    if name not in TEMPLATES:
        raise MoerunError(f"no built-in chat template is named {name!r} (known: {', '.join(TEMPLATES)})")
    return (resources.files("moerun") / "data" / "templates" / TEMPLATES[name]).read_text(encoding="utf-8")


def _looks_like_template(text: str) -> bool:
    return "{{" in text or "{%" in text


def chat_template_override(template: str | None, template_file: str | Path | None) -> str | None:
    """The template `--chat-template` (a built-in name, else the template's own text, as llama-server takes it)
    or `--chat-template-file` chooses, compiled once to check it; None when neither is given."""
    from moerun.text.chat import ChatTemplate, ChatTemplateError

    if template is not None and template_file is not None:
        raise MoerunError("give --chat-template or --chat-template-file, not both")
    if template_file is not None:
        what = f"--chat-template-file {template_file}"
        try:
            source = Path(template_file).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise MoerunError(f"{what}: no such file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise MoerunError(f"{what}: cannot read it: {getattr(e, 'strerror', None) or e}") from None
    elif template is None:
        return None
    elif template in TEMPLATES:
        return builtin_template(template)
    elif _looks_like_template(template):
        what, source = "--chat-template", template
    else:
        hint = ("; --chat-template-file FILE reads a template from a file" if Path(template).is_file()
                or template.endswith(".jinja") else "; or give the template's text, or --chat-template-file FILE")
        raise MoerunError(f"--chat-template {template!r} is not a built-in template name (known: "
                          f"{', '.join(TEMPLATES)}){hint}")
    if not source.strip():
        raise MoerunError(f"{what}: the template is empty")
    try:
        ChatTemplate(source)
    except ChatTemplateError as e:
        raise MoerunError(f"{what}: {e}") from None
    return source
