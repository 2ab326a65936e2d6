"""The model's tokenizer: text <-> token ids, from GGUF metadata or a Hugging Face folder.

    tok = Tokenizer.from_model_file(open_model(path))
    ids = tok.encode("Hello")                 # BOS first when the model asks for it
    text = tok.decode(ids)                    # control tokens skipped
    stream = tok.incremental_decoder()        # text chunks as tokens arrive, whole characters only
    for i in generated: print(stream.step(i), end="")
    print(stream.flush())

Everything is built on the `tokenizers` library: a GGUF vocabulary is rebuilt as a `tokenizers.Tokenizer`
(see gguf_vocab.py); a Hugging Face folder's tokenizer.json is loaded as is.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from moerun.errors import ModelFormatError
from moerun.text.gguf_vocab import CONTROL, build_from_metadata

__all__ = ["EOT_TOKENS", "HARMONY_MARKERS", "IncrementalDecoder", "Tokenizer", "hf_chat_templates"]

# Tokens that end a turn when the vocabulary marks them control/special (llama.cpp's end-of-generation list).
EOT_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "<｜end▁of▁sentence｜>", "<|return|>", "<|call|>")
# gpt-oss's harmony format: the markers of a message's header, which llama.cpp always writes out in the text
# (it makes them user-defined tokens) so that a reader can tell the channels apart; "<|end|>" too, where it
# only ends a message (HARMONY_ENDS are in the vocabulary).
HARMONY_MARKERS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
HARMONY_ENDS = ("<|return|>", "<|call|>")
_STREAM_HOLD = 8  # tokens an unfinished UTF-8 sequence may wait before it is emitted as U+FFFD anyway


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte -> printable character table, inverted (character -> byte)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


class Tokenizer:
    """Text <-> ids for one model. Build with `from_model_file`, `from_gguf` or `from_hf_dir`."""

    def __init__(self, backend: HFTokenizer, *, kind: str, vocab_size: int, bos_id: int | None,
                 eos_id: int | None, eos_ids: Iterable[int] = (), add_bos: bool = False, add_eos: bool = False,
                 special_tokens: dict[str, str] | None = None, chat_templates: dict[str, str] | None = None,
                 added: dict[int, tuple[str, bool]] | None = None):
        self._tok = backend
        self.kind = kind  # "byte_level", "sentencepiece" or "other": how a token maps to bytes
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eos_ids = frozenset(i for i in (eos_id, *eos_ids) if i is not None)
        self.add_bos = add_bos and bos_id is not None
        self.add_eos = add_eos and eos_id is not None
        self.special_tokens = dict(special_tokens or {})  # bos_token, eos_token, ... as text (for chat templates)
        self.chat_templates = dict(chat_templates or {})  # "default" and named ones ("tool_use", ...)
        self._added = added if added is not None else {  # id -> (text, special); given: the backend's, known
            i: (t.content, t.special) for i, t in backend.get_added_tokens_decoder().items()}
        self._rendered = frozenset(i for i in _harmony_markers(backend) if self._added.get(i, ("", False))[1])
        self._byte_of = _gpt2_byte_decoder() if kind == "byte_level" else {}

    # -- construction -------------------------------------------------------------------------------------

    @classmethod
    def from_model_file(cls, mf: Any) -> Tokenizer:
        """The tokenizer of an opened model (moerun.formats.ModelFile)."""
        if mf.format == "gguf":
            return cls.from_gguf(mf.metadata, path=mf.path)
        return cls.from_hf_dir(mf.metadata.get("dir") or mf.path)

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], path: str | Path | None = None) -> Tokenizer:
        """From GGUF key/values: llama.cpp's "gpt2" (byte-level BPE) and "llama" (SentencePiece) vocabularies."""
        model = metadata.get("tokenizer.ggml.model")
        if model is None or model in ("none", "no_vocab"):
            why = "no tokenizer.ggml.model key" if model is None else f"tokenizer.ggml.model is '{model}'"
            raise ModelFormatError(path, f"the model has no tokenizer ({why})")
        if model not in ("gpt2", "llama"):
            raise ModelFormatError(path, f"unsupported tokenizer model '{model}' (moerun reads 'gpt2' and 'llama')")
        try:
            v = build_from_metadata(metadata, model)
        except Exception as e:  # noqa: BLE001 - ValueError from us, or whatever `tokenizers` raises
            raise ModelFormatError(path, f"cannot build the tokenizer: {e}") from None
        tokens = metadata["tokenizer.ggml.tokens"]
        eot = _end_of_turn_ids(v.tokenizer, lambda i: v.types[i] == CONTROL)
        named = {"bos": v.bos_id, "eos": v.eos_id, "unk": metadata.get("tokenizer.ggml.unknown_token_id"),
                 "pad": metadata.get("tokenizer.ggml.padding_token_id")}
        specials = {f"{name}_token": tokens[int(i)] for name, i in named.items()
                    if i is not None and 0 <= int(i) < len(tokens)}
        templates = {k.removeprefix("tokenizer.chat_template."): t for k, t in metadata.items()
                     if k.startswith("tokenizer.chat_template.") and isinstance(t, str)}
        if isinstance(metadata.get("tokenizer.chat_template"), str):
            templates["default"] = metadata["tokenizer.chat_template"]
        return cls(v.tokenizer, kind=v.kind, vocab_size=v.n_tokens, bos_id=v.bos_id, eos_id=v.eos_id,
                   eos_ids=(*v.extra_eos, *eot), add_bos=v.add_bos, add_eos=v.add_eos, special_tokens=specials,
                   chat_templates=templates, added=v.added)

    @classmethod
    def from_hf_dir(cls, folder: str | Path) -> Tokenizer:
        """From a Hugging Face folder: tokenizer.json, tokenizer_config.json, generation_config.json."""
        folder = Path(folder)
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            extra = (" (only a SentencePiece tokenizer.model, which moerun does not read: save the tokenizer "
                     "with transformers to get a tokenizer.json)") if (folder / "tokenizer.model").is_file() else ""
            raise ModelFormatError(folder, f"the model has no tokenizer: no tokenizer.json in the folder{extra}")
        try:
            backend = HFTokenizer.from_file(str(tj))
        except Exception as e:  # noqa: BLE001 - `tokenizers` raises plain Exception
            raise ModelFormatError(tj, f"cannot read the tokenizer: {e}") from None
        cfg = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")
        model_cfg = _read_json(folder / "config.json")
        specials = {k: s for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                    if (s := _token_text(cfg.get(k))) is not None}

        def tid(name: str) -> int | None:
            return backend.token_to_id(specials[name]) if name in specials else None

        pre, post = _post_processor_extras(backend)
        bos_id = tid("bos_token")
        if bos_id is None:
            bos_id = pre[0] if len(pre) == 1 else model_cfg.get("bos_token_id")
        eos_id = tid("eos_token")
        if eos_id is None:
            eos_id = post[0] if len(post) == 1 else _first(model_cfg.get("eos_token_id"))
        add_bos = cfg.get("add_bos_token", bool(pre))
        add_eos = cfg.get("add_eos_token", bool(post))
        ends = gen.get("eos_token_id") if gen else model_cfg.get("eos_token_id")
        added = backend.get_added_tokens_decoder()
        eot = _end_of_turn_ids(backend, lambda i: i in added and added[i].special)
        specials.update({f"{n}_token": backend.id_to_token(i) for n, i in (("bos", bos_id), ("eos", eos_id))
                         if i is not None and f"{n}_token" not in specials})
        return cls(backend, kind=_decoder_kind(backend), vocab_size=backend.get_vocab_size(with_added_tokens=True),
                   bos_id=bos_id, eos_id=eos_id, eos_ids=(*_as_list(ends), *eot), add_bos=bool(add_bos),
                   add_eos=bool(add_eos), special_tokens=specials,
                   chat_templates=hf_chat_templates(folder, cfg))

    # -- text <-> ids ---------------------------------------------------------------------------------------

    @property
    def backend(self) -> HFTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    @property
    def chat_template(self) -> str | None:
        """The default chat template (Jinja source), or None when the model has none."""
        return self.chat_templates.get("default")

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids for `text`. Special tokens written in the text (e.g. "<|im_start|>") encode as one token;
        with add_special, BOS (and EOS) are added when the model says so."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos:
            ids.insert(0, self.bos_id)
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text for `ids`; with skip_special, control tokens (BOS, <|im_end|>, ...) are left out, except the
        harmony markers (HARMONY_MARKERS), which are always written, as llama.cpp does."""
        ids = [int(i) for i in ids]
        if not skip_special or not self._rendered or self._rendered.isdisjoint(ids):
            return self._tok.decode(ids, skip_special_tokens=skip_special)
        parts, run = [], []
        for i in ids:
            if i in self._rendered:
                parts += [self._tok.decode(run, skip_special_tokens=True), self._added[i][0]]
                run = []
            else:
                run.append(i)
        return "".join(parts) + self._tok.decode(run, skip_special_tokens=True)

    def incremental_decoder(self, skip_special: bool = True, prefix_ids: Sequence[int] = ()) -> IncrementalDecoder:
        """An IncrementalDecoder; `prefix_ids` (e.g. the prompt's last few tokens) give the first token context,
        so a leading space that belongs between prompt and answer is kept."""
        return IncrementalDecoder(self, skip_special, prefix_ids)

    decode_stream = incremental_decoder

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry as stored (ByteLevel or ▁ spelling), or None for an unknown id."""
        return self._tok.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        """True for control tokens (those decode(skip_special=True) leaves out)."""
        return int(token_id) not in self._rendered and self._added.get(int(token_id), ("", False))[1]

    def renders(self, text: str) -> bool:
        """Whether `text` survives encode then decode: False for a control token that decoding leaves out."""
        i = self._tok.token_to_id(text)
        return i is None or not self.is_special(i)

    def token_to_bytes(self, token_id: int) -> bytes:
        """The bytes this token stands for (a byte-level token may be part of a UTF-8 character)."""
        token_id = int(token_id)
        if token_id in self._added:
            return self._added[token_id][0].encode()
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self.kind == "byte_level" and all(c in self._byte_of for c in piece):
            return bytes(self._byte_of[c] for c in piece)
        if self.kind == "sentencepiece":
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            return piece.replace("\u2581", " ").encode()
        if self.kind == "other":
            return self._tok.decode([token_id], skip_special_tokens=False).encode()
        return piece.encode()

    def token_to_piece(self, token_id: int) -> str:
        """This token's text on its own (llama.cpp's token_to_piece): U+FFFD for an incomplete character."""
        return self.token_to_bytes(token_id).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return (f"Tokenizer({self.kind}, vocab={self.vocab_size}, bos={self.bos_id}, eos={sorted(self.eos_ids)}, "
                f"add_bos={self.add_bos})")


class IncrementalDecoder:
    """Turns a stream of token ids into text chunks, emitting only whole characters.

    Each `step(id)` decodes a short window of recent tokens and returns the text the new token completed
    ("" while a multi-byte character is still split across tokens); `flush()` returns what is left at the end.
    Decoding a window rather than single tokens keeps decoder rules (SentencePiece's leading space) right.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True, prefix_ids: Sequence[int] = ()):
        self._tok = tokenizer
        self._skip = skip_special
        self._ids = [int(i) for i in prefix_ids]
        self._prefix = 0              # window start: tokens before it are done with
        self._read = len(self._ids)   # tokens before this have been emitted

    def step(self, token_id: int) -> str:
        """The text `token_id` completes ("" while a character is still unfinished)."""
        self._ids.append(int(token_id))
        return self._emit(force=len(self._ids) - self._read >= _STREAM_HOLD)

    def step_many(self, ids: Iterable[int]) -> str:
        return "".join(self.step(i) for i in ids)

    def flush(self) -> str:
        """Whatever is pending (an unfinished character comes out as U+FFFD)."""
        return self._emit(force=True)

    def _emit(self, force: bool) -> str:
        done = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        if len(text) > len(done) and (force or not text.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(done):]
        if force:  # nothing visible (skipped control tokens): move on
            self._prefix, self._read = self._read, len(self._ids)
        return ""


def _is_harmony(backend: HFTokenizer) -> bool:
    return all(backend.token_to_id(t) is not None for t in HARMONY_ENDS)


def _end_of_turn_ids(backend: HFTokenizer, is_control: Any) -> list[int]:
    """The EOT_TOKENS the vocabulary has as control tokens. As llama.cpp: when "<|return|>" and "<|call|>"
    exist (gpt-oss's harmony format), "<|end|>" only ends a message, not the answer."""
    ids = {t: i for t in EOT_TOKENS if (i := backend.token_to_id(t)) is not None and is_control(i)}
    if _is_harmony(backend):
        ids.pop("<|end|>", None)
    return list(ids.values())


def _harmony_markers(backend: HFTokenizer) -> list[int]:
    """The ids of the harmony markers decoding always writes (llama.cpp's rule, by the tokens' text)."""
    names = HARMONY_MARKERS + (("<|end|>",) if _is_harmony(backend) else ())
    return [i for t in names if (i := backend.token_to_id(t)) is not None]


# -- Hugging Face folder helpers ------------------------------------------------------------------------------

def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(path, f"cannot read JSON: {e}") from None
    return data if isinstance(data, dict) else {}


def _token_text(v: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ..., ...}."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _as_list(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]


def _first(v: Any) -> int | None:
    ids = _as_list(v)
    return ids[0] if ids else None


def _post_processor_extras(backend: HFTokenizer) -> tuple[list[int], list[int]]:
    """The ids tokenizer.json's post-processor puts before and after a text (e.g. Llama 3's BOS)."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    for k in range(len(full) - len(plain) + 1):
        if full[k:k + len(plain)] == plain:
            return full[:k], full[k + len(plain):]
    return [], []


def _decoder_kind(backend: HFTokenizer) -> str:
    if backend.decoder is None:
        return "other"
    spec = json.dumps(json.loads(backend.decoder.__getstate__()))
    if '"ByteLevel"' in spec:
        return "byte_level"
    if '"ByteFallback"' in spec or '"Metaspace"' in spec:
        return "sentencepiece"
    return "other"


def hf_chat_templates(folder: Path, cfg: dict[str, Any]) -> dict[str, str]:
    """Chat templates as transformers finds them: chat_template.jinja (+ additional_chat_templates/*.jinja),
    else tokenizer_config.json's chat_template, a string or a list of {"name", "template"}."""
    templates: dict[str, str] = {}
    ct = cfg.get("chat_template")
    if isinstance(ct, str):
        templates["default"] = ct
    elif isinstance(ct, list):
        templates.update({t["name"]: t["template"] for t in ct if isinstance(t, dict) and "name" in t})
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        templates["default"] = jinja.read_text(encoding="utf-8")
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        templates.update({p.stem: p.read_text(encoding="utf-8") for p in sorted(extra.glob("*.jinja"))})
    return templates

