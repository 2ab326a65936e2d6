"""A deterministic byte-level BPE tokenizer for synthetic models, as HF files and as GGUF metadata.

Trained with the `tokenizers` library on a fixed, sorted selection of the Python standard library's
top-level .py files (offline, ~2 MB, a second or two), to exactly the model's vocabulary size:
256 byte tokens, then merges, then the style's special tokens at the end. Vocabularies below 259
leave out the 13 bytes that never occur in UTF-8 text. A corpus too small for a huge vocabulary (it
gives ~18k tokens) is filled up with merges of its own tokens, pairs drawn with a fixed seed, as a
real vocabulary's long tail: 248,320 tokens carry ~248k merges, as Qwen3.5's do, so that loading the
made file costs what loading the real one does (control tokens in their place cost moerun's
tokenizer a matcher over 230k added tokens, and llama.cpp no merges at all; its converter pads a
real vocabulary with a few hundred `[PAD]` tokens only).

Two styles, after the real models' tokenizers (a family's made models get its style, see `style_for`):

- CHATML (every family but gpt-oss): `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` as in Qwen's
  vocabularies, NFC, Qwen2's pre-tokenizer regex (`tokenizer.ggml.pre` = "qwen2"), a ChatML template.
- HARMONY (gpt-oss): o200k's pre-tokenizer regex (`tokenizer.ggml.pre` = "gpt-4o"), no normalizer,
  harmony's special tokens (`<|start|>`, `<|channel|>`, `<|message|>`, `<|end|>`, `<|return|>`, ...)
  and OpenAI's published gpt-oss chat template (moerun/data/templates/gpt-oss.jinja).

A family's made models carry its published, tool-capable chat template (FAMILY_TEMPLATES, names of
moerun.text.templates) rather than their style's; the other markers those templates write (`<tool_call>`,
`<think>`, `[TOOL_CALLS]`, ...) are plain text to these tokenizers, which moerun's parsers read as text.

The GGUF fields describe the same tokenizer llama.cpp would build. The trained tokenizer.json is cached
under $MOERUN_CACHE/tokenizers (default ~/.cache/moerun/tokenizers), keyed by style, vocabulary size and
a hash of the corpus, so repeated calls are instant.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sysconfig
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

__all__ = [
    "CHATML",
    "CHAT_TEMPLATE",
    "FAMILY_TEMPLATES",
    "HARMONY",
    "O200K_PATTERN",
    "PRE_PATTERNS",
    "SPECIAL_TOKENS",
    "TextStyle",
    "build_tokenizer",
    "cache_dir",
    "chat_template_for",
    "gguf_tokenizer_metadata",
    "hf_tokenizer_to_gguf",
    "special_ids",
    "style_for",
    "style_of",
    "write_hf_tokenizer",
]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
N_BYTES = 256
# Bytes that never occur in UTF-8 text: C0, C1, F5..FF. Vocabularies too small for all 256 bytes plus
# the special tokens (tiny test models with vocab 256) leave them out.
NON_UTF8_BYTES = frozenset({0xC0, 0xC1, *range(0xF5, 0x100)})
MIN_VOCAB = N_BYTES - len(NON_UTF8_BYTES) + len(SPECIAL_TOKENS)
CORPUS_BYTES = 2_000_000
FORMAT_VERSION = 2  # bump when the recipe changes, so old cache entries are not reused

# Qwen2's pre-tokenizer regex (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2 uses the same).
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# o200k's (GPT-4o's, gpt-oss's) regex as its tokenizer.json has it (llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT4O).
O200K_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                 r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.json's Split regex -> tokenizer.ggml.pre
PRE_PATTERNS = MappingProxyType({QWEN2_PATTERN: "qwen2", O200K_PATTERN: "gpt-4o"})

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TextStyle:
    """What a synthetic tokenizer takes after a real model's: its special tokens (control tokens at the end of
    the vocabulary, in this order), which of them are BOS / EOS / padding, the pre-tokenizer and the chat
    template (`template_file`: a file in moerun/data/templates, else `template`)."""

    name: str
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str
    pattern: str
    nfc: bool
    template: str = ""
    template_file: str | None = None

    @property
    def pre(self) -> str:
        return PRE_PATTERNS[self.pattern]

    @property
    def chat_template(self) -> str:
        if self.template_file is None:
            return self.template
        path = resources.files("moerun") / "data" / "templates" / self.template_file
        return path.read_text(encoding="utf-8")

    @property
    def min_vocab(self) -> int:
        return N_BYTES - len(NON_UTF8_BYTES) + len(self.specials)


CHATML = TextStyle("chatml", SPECIAL_TOKENS, None, "<|im_end|>", "<|endoftext|>", QWEN2_PATTERN,
                   nfc=True, template=CHAT_TEMPLATE)
# gpt-oss's special tokens (o200k_harmony), in their order there; BOS, EOS and padding as its
# tokenizer_config.json has them.
HARMONY = TextStyle("harmony", ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>",
                                "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>",
                                "<|endofprompt|>"),
                    "<|startoftext|>", "<|return|>", "<|endoftext|>", O200K_PATTERN, nfc=False,
                    template_file="gpt-oss.jinja")
_FAMILY_STYLES = MappingProxyType({"gptoss": HARMONY})  # families whose models' text side is not ChatML

# family -> the built-in chat template (moerun.text.templates) its made models carry: the family's published one
# that renders tool calls; Qwen3's for the families with none of their own that does (Qwen2-MoE's and OLMoE's
# published chat templates render no tools; Qwen3-Next's is not among the shipped ones).
FAMILY_TEMPLATES = MappingProxyType({
    "qwen3moe": "qwen3", "qwen2moe": "qwen3", "olmoe": "qwen3", "qwen3next": "qwen3", "qwen35moe": "qwen3.5",
    "mixtral": "mistral", "glm4moe": "glm-4.6", "deepseek2": "deepseek-v3.1", "gptoss": "gpt-oss",
})


def style_for(family: str | None) -> TextStyle:
    """The text style of `family`'s made models."""
    return _FAMILY_STYLES.get(family or "", CHATML)


def chat_template_for(family: str | None, tok: Tokenizer) -> str:
    """The chat template `family`'s made models carry (FAMILY_TEMPLATES); without a family, the tokenizer's
    style's own."""
    from moerun.text.templates import builtin_template

    name = FAMILY_TEMPLATES.get(family or "")
    return style_of(tok).chat_template if name is None else builtin_template(name)


def style_of(tok: Tokenizer) -> TextStyle:
    """The style a tokenizer made by build_tokenizer was made in (told by its special tokens)."""
    return HARMONY if tok.token_to_id("<|channel|>") is not None else CHATML


def cache_dir() -> Path:
    """$MOERUN_CACHE/tokenizers, or ~/.cache/moerun/tokenizers."""
    root = os.environ.get("MOERUN_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "moerun") / "tokenizers"


def _corpus() -> list[str]:
    """Whole files, in name order, from the standard library's top level, up to CORPUS_BYTES."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        if total >= CORPUS_BYTES:
            break
        try:
            text = path.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            continue
        texts.append(text)
        total += len(text)
    if not texts:
        raise RuntimeError(f"no Python sources found under {stdlib} to train a tokenizer on")
    return texts


def _alphabet(vocab: int, style: TextStyle) -> list[str]:
    """ByteLevel characters of the initial vocabulary: all 256 bytes, or the UTF-8 ones if vocab is tiny."""
    chars = pre_tokenizers.ByteLevel.alphabet()
    if vocab >= N_BYTES + len(style.specials):
        return chars
    dropped = {_BYTE_CHARS[b] for b in NON_UTF8_BYTES}
    return [c for c in chars if c not in dropped]


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what ByteLevel uses)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


_BYTE_CHARS = _byte_chars()


def _train(vocab: int, texts: list[str], style: TextStyle) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if style.nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(style.pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    n_regular = vocab - len(style.specials)
    trainer = trainers.BpeTrainer(vocab_size=n_regular, min_frequency=2, show_progress=False,
                                  initial_alphabet=_alphabet(vocab, style), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    short = n_regular - tok.get_vocab_size()
    if short > 0:  # a small corpus cannot fill a very large vocabulary
        tok = _grow(tok, short)
    tok.add_special_tokens(list(style.specials))
    if tok.get_vocab_size() != vocab:
        raise RuntimeError(f"trained tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab}")
    return tok


def _grow(tok: Tokenizer, n: int, longest: int = 16) -> Tokenizer:
    """`tok` with n more tokens, each the merge of two it has (ranked after its own merges): one of any rank and,
    half of the time, a byte, else another of any rank; at most `longest` characters. Seeded by the sizes."""
    spec = json.loads(tok.to_str())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    toks = sorted(vocab, key=vocab.get)
    as_text = bool(merges) and isinstance(merges[0], str)  # "a b" (older tokenizers) or ["a", "b"]
    rnd = random.Random(f"moerun-grow-{len(toks)}-{n}")
    n_bytes = min(N_BYTES, len(toks))
    while n:
        a = toks[rnd.randrange(len(toks))]
        b = toks[rnd.randrange(n_bytes)] if rnd.random() < 0.5 else toks[rnd.randrange(len(toks))]
        t = a + b
        if len(t) > longest or t in vocab:
            continue
        vocab[t] = len(toks)
        toks.append(t)
        merges.append(f"{a} {b}" if as_text else [a, b])
        n -= 1
    return Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))


def _load_cached(path: Path) -> Tokenizer | None:
    """The cached tokenizer, or None when absent or damaged (then it is retrained and rewritten)."""
    if not path.is_file():
        return None
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception on a corrupt file
        return None
    return tok


def build_tokenizer(vocab: int, family: str | None = None) -> Tokenizer:
    """The byte-level BPE tokenizer with exactly `vocab` tokens, in `family`'s style (style_for), cached on
    disk after the first call."""
    style = style_for(family)
    if vocab < style.min_vocab:
        raise ValueError(f"vocab {vocab} is too small: a byte-level tokenizer needs at least "
                         f"{style.min_vocab} tokens")
    texts = _corpus()
    h = hashlib.sha256(f"v{FORMAT_VERSION}\0".encode())
    for t in texts:
        h.update(t.encode("utf-8", errors="replace"))
    kind = "bpe" if style is CHATML else style.name
    path = cache_dir() / f"{kind}-{vocab}-{h.hexdigest()[:16]}.json"
    tok = _load_cached(path)
    if tok is not None and tok.get_vocab_size() == vocab:
        return tok
    tok = _train(vocab, texts, style)
    _save_cached(tok, path)
    return tok


def _save_cached(tok: Tokenizer, path: Path) -> None:
    """Write the cache entry atomically; a read-only cache only costs retraining next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    except OSError:
        return
    os.close(fd)
    try:
        tok.save(tmp)
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception when it cannot write
        Path(tmp).unlink(missing_ok=True)


def special_ids(tok: Tokenizer) -> dict[str, int]:
    """bos / eos / pad token ids. ChatML (Qwen's convention): bos = pad = <|endoftext|>, eos = <|im_end|>;
    harmony (gpt-oss's): bos <|startoftext|>, eos <|return|>, pad <|endoftext|>."""
    style = style_of(tok)
    return {"bos": tok.token_to_id(style.bos or style.pad), "eos": tok.token_to_id(style.eos),
            "pad": tok.token_to_id(style.pad)}


def write_hf_tokenizer(tok: Tokenizer, folder: str | Path, family: str | None = None) -> None:
    """Write tokenizer.json and tokenizer_config.json into `folder`, and the chat template (chat_template_for):
    in tokenizer_config.json (ChatML), or as chat_template.jinja (harmony, as gpt-oss's repositories have it)."""
    folder = Path(folder)
    style = style_of(tok)
    tok.save(str(folder / "tokenizer.json"))
    added = {
        str(i): {"content": t.content, "lstrip": False, "normalized": False,
                                               "rstrip": False, "single_word": False, "special": True}
        for i, t in tok.get_added_tokens_decoder().items()
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": style.bos,
        "eos_token": style.eos,
        "pad_token": style.pad,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
    }
    template = chat_template_for(family, tok)
    if style.template_file is None:
        config["chat_template"] = template
    else:
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def hf_tokenizer_to_gguf(tok_json: dict[str, Any], chat_template: str | None = None,
                         specials: dict[str, int] | None = None, pre: str = "qwen2") -> dict[str, Any]:
    """GGUF `tokenizer.*` keys (llama.cpp's "gpt2" BPE) for a byte-level BPE tokenizer.json (parsed).

    `specials` maps "bos"/"eos"/"pad" to ids; missing ones are looked up by the usual token names.
    `pre` is tokenizer.ggml.pre, the name llama.cpp knows the tokenizer.json's pre-tokenizer regex by.
    """
    model = tok_json.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer model '{model.get('type')}' is not supported (byte-level BPE only)")
    vocab: dict[str, int] = dict(model["vocab"])
    added = {a["content"]: a for a in tok_json.get("added_tokens", [])}
    for content, a in added.items():
        vocab[content] = a["id"]
    n = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]  # holes in the id space, as llama.cpp's converter fills them
    types = [5] * n  # UNUSED
    for content, i in vocab.items():
        tokens[i] = content
        a = added.get(content)
        types[i] = 1 if a is None else (3 if a.get("special") else 4)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    ids = dict(specials or {})
    for key, names in (("bos", ("<|endoftext|>", "<s>")), ("eos", ("<|im_end|>", "<|endoftext|>", "</s>")),
                       ("pad", ("<|endoftext|>", "<pad>"))):
        if key not in ids:
            ids[key] = next((vocab[t] for t in names if t in vocab), None)
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_bos_token": False,
    }
    for key, gkey in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        if ids.get(key) is not None:
            meta[f"tokenizer.ggml.{gkey}"] = int(ids[key])
    if chat_template:
        meta["tokenizer.chat_template"] = chat_template
    return meta


def gguf_tokenizer_metadata(tok: Tokenizer, family: str | None = None) -> dict[str, Any]:
    """GGUF `tokenizer.*` keys for a tokenizer made by build_tokenizer, with `family`'s chat template
    (chat_template_for)."""
    return hf_tokenizer_to_gguf(json.loads(tok.to_str()), chat_template_for(family, tok), special_ids(tok),
                                style_of(tok).pre)
