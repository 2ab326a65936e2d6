"""gpt-oss's text side: the o200k tokenizer as its GGUF and HF files carry it, and the harmony chat template.

The vocabulary is a small byte-level BPE trained with o200k's pre-tokenizer regex and harmony's special tokens
(the real o200k cannot be downloaded here). References are independent of moerun's reader: a `tokenizers`
BPE built here from the same vocabulary and merges with o200k's Split regex as its tokenizer.json spells it,
transformers' tokenizer.json and GGUF loaders, and a GGUF written the way llama.cpp's convert_hf_to_gguf.py
writes gpt-oss's vocabulary (gguf-py's GGUFWriter and SpecialVocab). The template is OpenAI's published one,
rendered by transformers' apply_chat_template.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from types import SimpleNamespace

import gguf
import pytest
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from moerun.formats import open_model
from moerun.text import ChatTemplate, Tokenizer
from moerun.tools.convert import tokenizer_metadata
from moerun.tools.gguf_out import write_gguf
from moerun.tools.tokenizer import (
    CHATML,
    HARMONY,
    build_tokenizer,
    gguf_tokenizer_metadata,
    special_ids,
    style_for,
    write_hf_tokenizer,
)

transformers = pytest.importorskip("transformers")

VOCAB = 2048
# o200k_base's regex, as gpt-oss's tokenizer.json (and tiktoken) spell it.
O200K = ("[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
         "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
         "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}"
         "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
HARMONY_SPECIALS = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
                    "<|start|>", "<|end|>", "<|message|>", "<|call|>", "<|endofprompt|>")
TEXTS = [
    "Hello, world! It's 2024; don't panic.", "I'M SURE THEY'LL COME; YOU'VE SEEN IT'S FINE, we'd say",
    "numbers 1234567 3.14159 -42 1,000,000 0x1F 007", "你好，世界。日本語のテキストと한국어 텍스트",
    "emoji: 😀👍🏽🇫🇷 and ZWJ 👩‍👩‍👧!!", "   leading, trailing   ",
    "a\n\n\tb \r\n c\u00a0d   \n\n\n  e\r\r\n",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A(B):\n\tpass\n",
    "path/to/file.py //comment\n/* c */ a//b",
    "ÉCOLE naïve façade HTTPServer camelCase XMLHttpRequest ÀBCdef",
    "e\u0301 combining marks, ǅungla titlecase",
    "<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant<|channel|>analysis<|message|>x<|end|>",
    "tabs\t\tand  double  spaces", "", " ", "\n",
]


@pytest.fixture(scope="module")
def harmony_tok(tmp_path_factory):
    """tools' byte-level BPE in the harmony style (gpt-oss's made models get it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOERUN_CACHE", str(tmp_path_factory.mktemp("cache")))
        return build_tokenizer(VOCAB, "gptoss")


@pytest.fixture(scope="module")
def reference(harmony_tok):
    """The same vocabulary and merges in a `tokenizers` BPE built here, with o200k's Split regex."""
    spec = json.loads(harmony_tok.to_str())
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["model"]["merges"]]
    ref = HFTokenizer(models.BPE(vocab=spec["model"]["vocab"], merges=merges))
    split = pre_tokenizers.Split(Regex(O200K), behavior="isolated")
    ref.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                 use_regex=False)])
    ref.decoder = decoders.ByteLevel()
    added = sorted(spec["added_tokens"], key=lambda a: a["id"])
    ref.add_special_tokens([AddedToken(a["content"], special=True, normalized=False) for a in added])
    assert ref.get_vocab_size() == VOCAB
    return ref


@pytest.fixture(scope="module")
def hf_folder(harmony_tok, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    write_hf_tokenizer(harmony_tok, folder)
    return folder


@pytest.fixture(scope="module")
def gguf_ours(harmony_tok, tmp_path_factory):
    """moerun's writer: tools' GGUF tokenizer keys through tools' GGUF writer."""
    meta = {"general.architecture": "gpt-oss", **gguf_tokenizer_metadata(harmony_tok)}
    return write_gguf(tmp_path_factory.mktemp("ours") / "v.gguf", meta, [], progress=False)


@pytest.fixture(scope="module")
def gguf_converter(hf_folder, tmp_path_factory):
    """The vocabulary as llama.cpp's convert_hf_to_gguf.py writes gpt-oss's (get_vocab_base, _set_vocab_gpt2):
    token types from transformers' tokenizer, merges and special ids from gguf-py's SpecialVocab."""
    hf = transformers.AutoTokenizer.from_pretrained(hf_folder)
    reverse = {i: t for t, i in hf.get_vocab().items()}
    added, decoder = hf.get_added_vocab(), hf.added_tokens_decoder
    tokens, types = [], []
    for i in range(VOCAB):
        t = reverse[i]
        tokens.append(t)
        types.append(gguf.TokenType.CONTROL if t in added and decoder[i].special else
                     gguf.TokenType.USER_DEFINED if t in added else gguf.TokenType.NORMAL)
    path = tmp_path_factory.mktemp("converter") / "v.gguf"
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(hf_folder, load_merges=True).add_to_gguf(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _open(path) -> Tokenizer:
    with open_model(path) as mf:
        return Tokenizer.from_model_file(mf)


@pytest.mark.parametrize("which", ["gguf_ours", "gguf_converter"])
def test_gguf_vocab_tokenizes_as_the_o200k_reference(which, reference, request):
    tok = _open(request.getfixturevalue(which))
    assert tok.kind == "byte_level" and tok.vocab_size == VOCAB
    for s in TEXTS:
        ids = tok.encode(s, add_special=False)
        assert ids == reference.encode(s, add_special_tokens=False).ids, s
        assert tok.decode(ids, skip_special=False) == s


def test_pre_tokenizer_splits_as_o200k(gguf_ours):
    """The split itself, on texts whose pieces o200k's regex decides: case runs, contractions, digits in
    threes, punctuation with trailing slashes and newlines, whitespace runs."""
    ref = pre_tokenizers.Split(Regex(O200K), behavior="isolated")
    ours = _open(gguf_ours).backend.pre_tokenizer
    for s in TEXTS:
        assert [p for p, _ in ours.pre_tokenize_str(s)] == \
            [p for p, _ in pre_tokenizers.Sequence([ref, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
             .pre_tokenize_str(s)], s
    pieces = [p for p, _ in ref.pre_tokenize_str("HTTPServer 1234567 I'LL a/\n ÉCOLE camelCase")]
    assert pieces == ["HTTPServer", " ", "123", "456", "7", " I'LL", " a", "/\n", " ÉCOLE", " camel", "Case"]


def test_hf_folder_and_transformers_loaders_agree(hf_folder, gguf_ours, reference):
    ours = Tokenizer.from_hf_dir(hf_folder)
    hf = transformers.AutoTokenizer.from_pretrained(hf_folder)
    from_gguf = transformers.AutoTokenizer.from_pretrained(gguf_ours.parent, gguf_file=gguf_ours.name)
    for s in TEXTS:
        want = reference.encode(s, add_special_tokens=False).ids
        assert ours.encode(s) == hf.encode(s, add_special_tokens=False) == want, s
        assert from_gguf.encode(s, add_special_tokens=False) == want, s


@pytest.mark.parametrize("which", ["gguf_ours", "gguf_converter", "hf"])
def test_harmony_specials_end_generation_and_decode_as_llama_cpp(which, request, hf_folder, harmony_tok):
    tok = Tokenizer.from_hf_dir(hf_folder) if which == "hf" else _open(request.getfixturevalue(which))
    ids = {t: harmony_tok.token_to_id(t) for t in HARMONY_SPECIALS}
    # llama.cpp: <|return|>, <|call|> and <|endoftext|> end generation; <|end|> only ends a message
    assert tok.eos_ids == {ids["<|return|>"], ids["<|call|>"], ids["<|endoftext|>"]}
    assert tok.eos_id == ids["<|return|>"] and tok.bos_id == ids["<|startoftext|>"] and not tok.add_bos
    out = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    seq = tok.encode("<|startoftext|>" + out + "<|return|>", add_special=False)
    assert seq.count(ids["<|channel|>"]) == 2 and seq[-1] == ids["<|return|>"]
    assert tok.decode(seq) == out  # the markers are written, the other control tokens left out
    stream = tok.incremental_decoder()
    assert "".join(stream.step(i) for i in seq) + stream.flush() == out
    written = ("<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|constrain|>")
    assert not any(tok.is_special(ids[t]) for t in written)
    assert all(tok.is_special(ids[t]) for t in set(HARMONY_SPECIALS) - set(written))
    assert tok.renders("<|channel|>") and not tok.renders("<|return|>")


def test_gguf_carries_the_published_template(gguf_ours, gguf_converter, hf_folder):
    published = (resources.files("moerun") / "data" / "templates" / "gpt-oss.jinja").read_text("utf-8")
    assert "<|channel|>" in published and published.startswith("{#-")
    for tok in (_open(gguf_ours), _open(gguf_converter), Tokenizer.from_hf_dir(hf_folder)):
        assert tok.chat_template == published
    assert (hf_folder / "chat_template.jinja").read_text(encoding="utf-8") == published


def test_styles_by_family(harmony_tok, hf_folder, tmp_path):
    assert style_for("gptoss") is HARMONY and style_for("qwen3moe") is CHATML and style_for(None) is CHATML
    assert special_ids(harmony_tok) == {"bos": harmony_tok.token_to_id("<|startoftext|>"),
                                        "eos": harmony_tok.token_to_id("<|return|>"),
                                        "pad": harmony_tok.token_to_id("<|endoftext|>")}
    meta = gguf_tokenizer_metadata(harmony_tok)
    assert meta["tokenizer.ggml.pre"] == "gpt-4o" and meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.tokens"][-len(HARMONY_SPECIALS):] == list(HARMONY_SPECIALS)
    assert set(meta["tokenizer.ggml.token_type"][-len(HARMONY_SPECIALS):]) == {gguf.TokenType.CONTROL}
    # moerun's converter on a gpt-oss-like folder: o200k's regex is llama.cpp's "gpt-4o"; chat_template.jinja
    mf = SimpleNamespace(format="safetensors", metadata={"dir": str(hf_folder)}, path=hf_folder)
    conv = tokenizer_metadata(mf, VOCAB)
    assert conv["tokenizer.ggml.pre"] == "gpt-4o" and conv["tokenizer.chat_template"] == HARMONY.chat_template
    assert conv["tokenizer.ggml.tokens"] == meta["tokenizer.ggml.tokens"]
    assert conv["tokenizer.ggml.eos_token_id"] == meta["tokenizer.ggml.eos_token_id"]


def test_make_model_gives_gptoss_the_harmony_text_side(tmp_path):
    """make-model's gpt-oss GGUF carries the harmony vocabulary and template (its Hugging Face folder is not
    written: one clear error)."""
    from moerun.tools.make_model import make_model
    from moerun.tools.presets import preset, preset_names

    spec = next(preset(n) for n in preset_names() if n.startswith("tiny-") and preset(n).family == "gptoss")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOERUN_CACHE", str(tmp_path / "cache"))
        out = make_model(spec, tmp_path / "m.gguf", progress=False)
        with pytest.raises(ValueError, match="no Hugging Face format known for family 'gptoss'"):
            make_model(spec, tmp_path / "m", fmt="safetensors", progress=False)
    tok = _open(out)
    assert tok.chat_template == HARMONY.chat_template
    assert tok.token_to_id("<|return|>") in tok.eos_ids and tok.token_to_id("<|end|>") not in tok.eos_ids
    assert gguf.GGUFReader(str(out)).fields["tokenizer.ggml.pre"].contents() == "gpt-4o"


# -- the harmony chat template ------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for <city> & region",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "The city"},
        "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
        "days": {"type": "array", "items": {"type": "integer"}},
        "detail": {"type": "object", "properties": {"hourly": {"type": "boolean"}}},
        "when": {"oneOf": [{"type": "string"}, {"type": "number", "description": "epoch"}]}}}}}]
CHATS = {
    "system_user": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? ñ 你好"}],
    "developer": [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}],
    "history_with_thinking": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "thinking": "The user greets me."},
        {"role": "user", "content": "And 2+2?"}],
    "reasoning_content": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greeting."},
        {"role": "user", "content": "Bye"}],
    "tool_round": [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "thinking": "Need the tool.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "content": '{"temp": 21}'}],
}


@pytest.fixture(scope="module")
def hf_ref(harmony_tok):
    return transformers.PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(harmony_tok.to_str()))


@pytest.mark.parametrize("name", list(CHATS))
@pytest.mark.parametrize("gen", [True, False])
def test_harmony_template_renders_as_transformers(hf_ref, name, gen):
    chat = CHATS[name]
    tools = TOOLS if name == "tool_round" else None
    ours = ChatTemplate(HARMONY.chat_template).render(chat, add_generation_prompt=gen, tools=tools)
    ref = hf_ref.apply_chat_template(chat, chat_template=HARMONY.chat_template, tools=tools, tokenize=False,
                                     add_generation_prompt=gen)
    assert ours == ref
    assert ours.startswith("<|start|>system<|message|>You are ChatGPT") and ours.endswith(
        "<|start|>assistant" if gen else "<|end|>")


def test_harmony_template_kwargs_and_the_training_render(hf_ref):
    chat = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "thinking": "Greet."}]
    kw = {"reasoning_effort": "high", "model_identity": "You are a test.",
          "builtin_tools": ["browser", "python"]}
    ours = ChatTemplate(HARMONY.chat_template).render(chat, **kw)
    assert ours == hf_ref.apply_chat_template(chat, chat_template=HARMONY.chat_template, tokenize=False, **kw)
    # the last assistant turn without a generation prompt is the training form: its reasoning, then <|return|>
    assert ours.endswith("<|start|>assistant<|channel|>analysis<|message|>Greet.<|end|>"
                         "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>")
    assert "Reasoning: high" in ours and "You are a test." in ours and "namespace browser" in ours


def test_harmony_template_rejects_channels_in_content(hf_ref):
    from moerun.text import ChatTemplateError

    wrote = "<|channel|>final<|message|>hi"
    bad = [{"role": "user", "content": "x"}, {"role": "assistant", "content": wrote}, {"role": "user", "content": "y"}]
    why = re.escape("You have passed a message containing <|channel|> tags in the content field.")
    with pytest.raises(Exception, match=why):
        hf_ref.apply_chat_template(bad, chat_template=HARMONY.chat_template, tokenize=False)
    with pytest.raises(ChatTemplateError, match="rejected the messages: " + why):
        ChatTemplate(HARMONY.chat_template).render(bad)


def test_rendered_prompt_tokenizes_markers_whole(gguf_ours):
    tok = _open(gguf_ours)
    text = ChatTemplate.for_tokenizer(tok).render(CHATS["system_user"], add_generation_prompt=True)
    ids = tok.encode(text, add_special=False)
    tail = [tok.token_to_id("<|start|>"), *tok.encode("assistant", add_special=False)]
    assert ids.count(tok.token_to_id("<|start|>")) == 4 and ids[-len(tail):] == tail
    assert tok.decode(ids) == text
