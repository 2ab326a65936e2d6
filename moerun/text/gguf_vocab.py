"""Rebuild a GGUF file's vocabulary as a `tokenizers.Tokenizer` that encodes the way llama.cpp does.

Two vocabulary kinds (`tokenizer.ggml.model`):

- "gpt2": byte-level BPE. Tokens are stored in the ByteLevel alphabet (space = "Ġ"), merges as "a b";
  `tokenizer.ggml.pre` names the pre-tokenizer, i.e. the regexes llama.cpp splits text with before BPE
  (`llm_tokenizer_bpe` in llama.cpp's src/llama-vocab.cpp). Several regexes are applied one after the other,
  each splitting the pieces the previous one produced: a Sequence of `Split(..., "isolated")`.
- "llama": SentencePiece BPE. Tokens use "▁" for space, carry scores, and byte tokens "<0x0A>" stand in for
  bytes no token covers. llama.cpp merges the adjacent pair whose concatenation is the highest-scoring token,
  so the equivalent BPE ranks the merge (a, b) by the score of a+b. A space is prepended to the text and after
  every special token (llama.cpp's add_space_prefix), which is a per-segment normalizer here.

Control tokens (type 3) become special added tokens (matched whole in text, skipped when decoding with
skip_special); user-defined tokens (type 4) become plain added tokens (matched whole, always decoded).
"""

from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Any, NamedTuple

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

log = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Contractions spelled out case by case (llama.cpp's rewrite of "(?i:'s|'t|...)"): Oniguruma's (?i) would also
# fold "ſ" to "s", which llama.cpp does not.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_BAILING = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
# GPT-4o / gpt-oss: the tokenizer.json original (llama.cpp rewrites the Unicode classes for std::regex).
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK3 = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
              (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
               r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"))


class PreTokenizer(NamedTuple):
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is itself a token is kept whole (llama3, tekken)
    add_bos: bool = False        # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


def _table() -> MappingProxyType:
    llama3 = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
    gpt2, qwen2 = PreTokenizer((_GPT2,)), PreTokenizer((_QWEN2,))
    groups = {
        llama3: ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        PreTokenizer((_LLAMA3,)): ("dbrx", "smaug-bpe", "glm4", "chatglm-bpe"),
        qwen2: ("qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan", "grok-2"),
        gpt2: ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
               "mellum", "exaone4", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais",
               "trillion", "granite-docling"),
        PreTokenizer((r"\p{N}", _GPT2)): ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                                          "minerva-7b"),
        PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")): ("falcon",),
        PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")): ("default",),
        PreTokenizer(_DEEPSEEK3): ("deepseek-v3", "hunyuan-dense"),
        PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")): ("deepseek-coder",),
        PreTokenizer((_GPT4O,)): ("gpt-4o", "llama4", "minimax-m2"),
        PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True): ("tekken",),
        PreTokenizer((_BAILING,)): ("bailingmoe", "bailingmoe2", "llada-moe"),
    }
    return MappingProxyType({name: pre for pre, names in groups.items() for name in names})


PRE_TOKENIZERS = _table()


def pre_tokenizer_for(name: str | None) -> PreTokenizer:
    """llama.cpp's pre-tokenizer for `tokenizer.ggml.pre`; GPT-2's regex (with a warning) when unknown."""
    pre = PRE_TOKENIZERS.get(name or "")
    if pre is None:
        log.warning("unknown pre-tokenizer %r (tokenizer.ggml.pre); splitting text with GPT-2's regex, "
                    "so some texts may tokenize differently from llama.cpp", name)
        pre = PreTokenizer((_GPT2,))
    return pre


def _unique_vocab(tokens: list[str]) -> dict[str, int]:
    vocab = dict(zip(tokens, range(len(tokens))))
    if len(vocab) == len(tokens):  # no text twice (every real vocabulary): built in C, 5x faster for 250k tokens
        return vocab
    vocab = {}
    for i, t in enumerate(tokens):
        if vocab.setdefault(t, i) != i:
            log.warning("token %d %r repeats token %d; text maps to the first", i, t, vocab[t])
    return vocab


def _add_tokens(tok: HFTokenizer, tokens: list[str], types: list[int], vocab: dict[str, int]
                ) -> dict[int, tuple[str, bool]] | None:
    """Control (and unknown) tokens as special added tokens, user-defined ones as plain added tokens -> the added
    tokens by id, (text, special) as tok.get_added_tokens_decoder() has them (None: ask it, when a text repeats).
    One call (each rebuilds the matcher over every added token); all special: as strings, which add_special_tokens
    makes the same AddedToken(t, special=True, normalized=False) without a Python object each (files with 10^5)."""
    added = [(t, ty != USER_DEFINED) for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN, USER_DEFINED) and t]
    if all(special for _, special in added):
        tok.add_special_tokens([t for t, _ in added])
    else:
        tok.add_tokens([AddedToken(t, special=special, normalized=False) for t, special in added])
    by_id = {vocab[t]: (t, special) for t, special in added}
    return by_id if len(by_id) == len(added) else None


def _bpe_model(vocab: dict[str, int], merges: list[str], ignore_merges: bool) -> models.BPE:
    """HF's BPE over merges "a b" split as llama.cpp does (at the first space after the first character); a merge that
    is not two tokens of the vocabulary whose concatenation is one too is dropped, with a warning."""
    pairs = [(m[:i], m[i + 1:]) for m in merges for i in (m.find(" ", 1),) if i > 0]
    if len(pairs) == len(merges):
        try:  # a well-formed file (HF checks each pair as it builds): no pass over 250k merges in Python
            return models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges)
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a merge out of the vocabulary
            log.debug("%s: checking each merge", e)
    kept = [p for p in pairs if p[0] in vocab and p[1] in vocab and p[0] + p[1] in vocab]
    log.warning("%d merges name tokens that are not in the vocabulary; they are ignored", len(merges) - len(kept))
    return models.BPE(vocab=vocab, merges=kept, ignore_merges=ignore_merges)


def build_bpe(tokens: list[str], types: list[int], merges: list[str], pre: PreTokenizer
              ) -> tuple[HFTokenizer, dict[int, tuple[str, bool]] | None]:
    """Byte-level BPE ("gpt2") from tokens in ByteLevel form and merges "a b" (and its added tokens, _add_tokens)."""
    vocab = _unique_vocab(tokens)
    tok = HFTokenizer(_bpe_model(vocab, merges, pre.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                    use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, _add_tokens(tok, tokens, types, vocab)


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Merges equivalent to llama.cpp's SPM loop: (a, b) for every split of a token t = a + b into two
    tokens, ranked by t's score (highest first); for one t, longer left pieces first (as transformers does)."""
    vocab = _unique_vocab(tokens)
    ranked = []
    for t, i in vocab.items():
        if types[i] == BYTE or len(t) < 2:
            continue
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in vocab and b in vocab:
                ranked.append((-scores[i], -len(a), i, a, b))
    ranked.sort()
    return [(a, b) for *_, a, b in ranked]


def build_spm(tokens: list[str], scores: list[float], types: list[int], unk_id: int | None,
              add_space_prefix: bool) -> tuple[HFTokenizer, dict[int, tuple[str, bool]] | None]:
    """SentencePiece-style BPE ("llama"): ▁ for space, byte fallback to <0xXX> tokens (and its added tokens)."""
    vocab = _unique_vocab(tokens)
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    model = models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, types), unk_token=unk, fuse_unk=True,
                       byte_fallback=True)
    tok = HFTokenizer(model)
    replace = normalizers.Replace(" ", "\u2581")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if add_space_prefix else replace
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if add_space_prefix else steps)
    return tok, _add_tokens(tok, tokens, types, vocab)


def _int_or_none(meta: dict[str, Any], key: str, n: int) -> int | None:
    v = meta.get(key)
    if v is None:
        return None
    v = int(v)
    if not 0 <= v < n:
        log.warning("%s = %d is outside the vocabulary (%d tokens); ignored", key, v, n)
        return None
    return v


class GGUFVocab(NamedTuple):
    """What from_gguf needs beyond the tokenizers object."""

    tokenizer: HFTokenizer
    kind: str                    # "byte_level" or "sentencepiece"
    n_tokens: int
    types: list[int]
    bos_id: int | None
    eos_id: int | None
    extra_eos: tuple[int, ...]   # tokenizer.ggml.eot_token_id / eom_token_id
    add_bos: bool
    add_eos: bool
    added: dict[int, tuple[str, bool]] | None = None  # the added tokens by id (_add_tokens)


def build_from_metadata(meta: dict[str, Any], model: str) -> GGUFVocab:
    """`model` is tokenizer.ggml.model, already checked to be "gpt2" or "llama"; raises ValueError when
    required keys are missing (the caller words it as a ModelFormatError)."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("tokenizer.ggml.tokens is missing or empty")
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # as llama.cpp
    n = len(tokens)
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * n)
    if len(types) != n:
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
    ids = {k: _int_or_none(meta, f"tokenizer.ggml.{k}_token_id", n) for k in ("bos", "eos", "eot", "eom")}
    if model == "gpt2":
        merges = meta.get("tokenizer.ggml.merges")
        if merges is None:
            raise ValueError("tokenizer.ggml.merges is missing (a gpt2 vocabulary needs its merges)")
        pre = pre_tokenizer_for(meta.get("tokenizer.ggml.pre"))
        (tok, added), kind, add_bos_default = build_bpe(tokens, types, merges, pre), "byte_level", pre.add_bos
    else:
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * n
        if len(scores) != n:
            raise ValueError(f"tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
        unk = _int_or_none(meta, "tokenizer.ggml.unknown_token_id", n)
        space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        (tok, added), kind, add_bos_default = build_spm(tokens, scores, types, 0 if unk is None else unk, space), \
            "sentencepiece", True
        for key, default in (("bos", 1), ("eos", 2)):  # llama.cpp's defaults for SPM vocabularies
            if ids[key] is None and default < n:
                ids[key] = default
    extra = tuple(i for i in (ids["eot"], ids["eom"]) if i is not None)
    return GGUFVocab(tok, kind, n, types, ids["bos"], ids["eos"], extra,
                     bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
                     bool(meta.get("tokenizer.ggml.add_eos_token", False)), added)
