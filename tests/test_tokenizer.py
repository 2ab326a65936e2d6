"""moerun.text: tokenizers from GGUF metadata and HF folders, streaming decode, chat templates.

References are built independently: transformers' own GGUF tokenizer loader and its tokenizer.json loader for
the byte-level BPE, a direct port of llama.cpp's SPM loop for the SentencePiece vocabulary, and transformers'
apply_chat_template for the templates.
"""

from __future__ import annotations

import heapq
import json
import logging
import random
import re
from types import SimpleNamespace

import gguf
import pytest
from tokenizers import Tokenizer as HFTokenizer

from moerun.errors import ModelFormatError, MoerunError
from moerun.formats import open_model
from moerun.text import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError, Tokenizer
from moerun.tools.tokenizer import CHAT_TEMPLATE, build_tokenizer, gguf_tokenizer_metadata, write_hf_tokenizer

transformers = pytest.importorskip("transformers")

SAMPLES = [
    "Hello, world! It's 2024; don't panic.", "def f(x):\n    return x ** 2  # square\n",
    "你好，世界。日本語のテキスト", "emoji: 😀👍🏽🇫🇷 and ZWJ 👩‍👩‍👧", "  leading and trailing  ", "a\n\n\tb \r\n c\u00a0d",
    "numbers 1234567 3.14159 -42", "Ünïcödé façade naïve", "<|im_start|>user\nhi<|im_end|>\n", "", " ",
]


def write_gguf(path, meta, arch="qwen2moe"):
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in meta.items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        else:
            w.add_array(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def bpe_hf(tmp_path_factory):
    """moerun/tools/tokenizer.py's byte-level BPE (1024 tokens: many characters are split into byte tokens)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOERUN_CACHE", str(tmp_path_factory.mktemp("cache")))
        return build_tokenizer(1024)


@pytest.fixture(scope="module")
def bpe_meta(bpe_hf):
    return gguf_tokenizer_metadata(bpe_hf)


@pytest.fixture(scope="module")
def bpe_gguf(bpe_meta, tmp_path_factory):
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "tok.gguf", bpe_meta)
    with open_model(path) as mf:
        return Tokenizer.from_model_file(mf), path


# -- byte-level BPE ("gpt2") ---------------------------------------------------------------------------------

@pytest.mark.parametrize("pre,arch", [("qwen2", "qwen2moe"), ("llama-bpe", "llama"), ("gpt-2", "llama")])
def test_gguf_bpe_matches_transformers_gguf_loader(bpe_meta, tmp_path, pre, arch):
    path = write_gguf(tmp_path / "t.gguf", {**bpe_meta, "tokenizer.ggml.pre": pre}, arch)
    ours = Tokenizer.from_model_file(open_model(path))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    for s in SAMPLES:
        assert ours.encode(s, add_special=False) == ref.encode(s, add_special_tokens=False), s


def test_a_vocabulary_larger_than_the_corpus_is_merges_as_a_real_one(tmp_path, monkeypatch):
    """30,000 tokens from a corpus that gives ~18k: the rest are merges too (no padding with control tokens, whose
    matcher a real file does not cost), and the GGUF built from it reads as transformers' GGUF loader reads it."""
    import json

    monkeypatch.setenv("MOERUN_CACHE", str(tmp_path / "cache"))
    hf = build_tokenizer(30000)
    spec = json.loads(hf.to_str())
    assert [a["content"] for a in spec["added_tokens"]] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert len(spec["model"]["vocab"]) == 29997 and len(spec["model"]["merges"]) == 29997 - 256
    path = write_gguf(tmp_path / "t.gguf", gguf_tokenizer_metadata(hf))
    ours = Tokenizer.from_model_file(open_model(path))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    vocab = spec["model"]["vocab"]
    grown = hf.decode([i for t, i in vocab.items() if i >= 20000 and "Ġ" not in t][:200])  # text the new merges make
    for s in [*SAMPLES, grown]:
        assert ours.encode(s, add_special=False) == ref.encode(s, add_special_tokens=False), s
    assert max(ours.encode(grown, add_special=False)) >= 20000  # the grown merges fire


def test_gguf_bpe_matches_tokenizer_json(bpe_hf, bpe_gguf):
    tok, _ = bpe_gguf
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(bpe_hf.to_str()))
    for s in SAMPLES:  # NFC text: tools' tokenizer.json normalizes to NFC, llama.cpp (and moerun) do not
        assert tok.encode(s) == ref.encode(s, add_special_tokens=False), s


def test_round_trip(bpe_gguf):
    tok, _ = bpe_gguf
    for s in SAMPLES[:-3]:
        assert tok.decode(tok.encode(s)) == s
    assert tok.decode(tok.encode("", add_special=False)) == ""


def test_special_tokens_atomic(bpe_gguf):
    tok, _ = bpe_gguf
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == start and ids[-1] == end and ids.count(start) == 1
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.is_special(end) and not tok.is_special(ids[1])
    assert tok.eos_ids == {end, tok.token_to_id("<|endoftext|>")}
    assert tok.vocab_size == 1024 and tok.bos_id == tok.token_to_id("<|endoftext|>") and not tok.add_bos


def test_stream_decoding_splits_characters_over_byte_tokens(bpe_gguf):
    tok, _ = bpe_gguf
    text = "héllo 你好 😀👍🏽! ok"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # characters really are split over several byte tokens
    stream = tok.incremental_decoder()
    chunks = [stream.step(i) for i in ids]
    assert "".join(chunks) + stream.flush() == text
    assert all("\ufffd" not in c for c in chunks)
    emoji = tok.encode("😀")
    assert len(emoji) == 4 and [tok.incremental_decoder().step(i) for i in emoji[:1]] == [""]
    s = tok.incremental_decoder()
    assert [s.step(i) for i in emoji] == ["", "", "", "😀"]
    assert tok.token_to_bytes(emoji[0]) == "😀".encode()[:1] and tok.token_to_piece(emoji[0]) == "\ufffd"


def test_stream_decoding_skips_control_tokens_and_flushes_bad_bytes(bpe_gguf):
    tok, _ = bpe_gguf
    ids = [tok.token_to_id("<|im_start|>"), *tok.encode("a你"), tok.token_to_id("<|im_end|>")]
    s = tok.incremental_decoder()
    assert "".join(s.step(i) for i in ids) + s.flush() == "a你"
    s = tok.incremental_decoder(skip_special=False)
    assert s.step_many(ids) + s.flush() == "<|im_start|>a你<|im_end|>"
    s = tok.incremental_decoder()
    assert s.step_many(tok.encode("你")[:2]) == "" and s.flush() == "\ufffd"


def test_add_bos_and_eos(bpe_meta, tmp_path):
    meta = {**bpe_meta, "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}
    tok = Tokenizer.from_gguf(meta)
    body = tok.encode("hi", add_special=False)
    assert tok.encode("hi") == [tok.bos_id, *body, tok.eos_id]
    assert tok.decode(tok.encode("hi")) == "hi"
    no_flag = {k: v for k, v in bpe_meta.items() if k != "tokenizer.ggml.add_bos_token"}
    assert Tokenizer.from_gguf({**no_flag, "tokenizer.ggml.pre": "llama-bpe"}).add_bos  # llama.cpp's default
    assert not Tokenizer.from_gguf(no_flag).add_bos


def test_pre_tokenizer_regexes(bpe_meta, caplog):
    def split(pre):
        tok = Tokenizer.from_gguf({**bpe_meta, "tokenizer.ggml.pre": pre})
        return [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("x 12345 I'M")]

    assert split("qwen2") == ["x", "Ġ", "1", "2", "3", "4", "5", "ĠI", "'M"]
    assert split("llama-bpe") == ["x", "Ġ", "123", "45", "ĠI", "'M"]
    assert split("gpt-2") == split("olmo") == ["x", "Ġ12345", "ĠI", "'", "M"]
    assert split("default") == ["x", "Ġ", "123", "45", "ĠI", "'", "M"]
    with caplog.at_level(logging.WARNING, logger="moerun.text"):
        assert split("no-such-pre") == split("gpt-2")
    assert "no-such-pre" in caplog.text


def test_end_of_turn_tokens_and_named_templates(bpe_meta):
    def with_tokens(extra, types, **more):
        return Tokenizer.from_gguf({**bpe_meta, **more,
                                    "tokenizer.ggml.tokens": [*bpe_meta["tokenizer.ggml.tokens"], *extra],
                                    "tokenizer.ggml.token_type": [*bpe_meta["tokenizer.ggml.token_type"], *types]})

    base = {bpe_meta["tokenizer.ggml.eos_token_id"], bpe_meta["tokenizer.ggml.bos_token_id"]}  # <|endoftext|>
    tok = with_tokens(["<|end|>", "<|eot_id|>", "<|eom_id|>", "<x>"], [3, 3, 4, 3], **{
        "tokenizer.ggml.eot_token_id": 1027, "tokenizer.chat_template.tool_use": "T"})
    assert tok.eos_ids == base | {1024, 1025, 1027}  # <|eom_id|> is not control here; <x> is the eot key
    assert tok.chat_templates.keys() == {"default", "tool_use"}
    harmony = with_tokens(["<|end|>", "<|return|>", "<|call|>"], [3, 3, 3])  # gpt-oss: <|end|> ends a message
    assert harmony.eos_ids == base | {1025, 1026}


def test_user_defined_tokens_are_kept_in_decode(bpe_meta):
    types = list(bpe_meta["tokenizer.ggml.token_type"])
    start = bpe_meta["tokenizer.ggml.tokens"].index("<|im_start|>")
    types[start] = 4  # USER_DEFINED
    tok = Tokenizer.from_gguf({**bpe_meta, "tokenizer.ggml.token_type": types})
    ids = tok.encode("<|im_start|>hi")
    assert ids[0] == start and tok.decode(ids) == "<|im_start|>hi" and not tok.is_special(start)


def test_repeated_tokens_and_bad_merges_are_dropped_with_a_warning(bpe_meta, caplog):
    good = Tokenizer.from_gguf(bpe_meta)
    tokens, merges = list(bpe_meta["tokenizer.ggml.tokens"]), list(bpe_meta["tokenizer.ggml.merges"])
    a, b = merges[-1].split(" ", 1)
    bad = merges + ["nospace", f"{a} \u0100never", f"{b} {a}" if b + a not in tokens else "x y"]
    with caplog.at_level(logging.WARNING, logger="moerun"):
        tok = Tokenizer.from_gguf({**bpe_meta, "tokenizer.ggml.merges": bad})
    assert "3 merges name tokens that are not in the vocabulary" in caplog.text
    assert all(tok.encode(t) == good.encode(t) for t in SAMPLES)  # the good merges, in their order
    caplog.clear()
    twice = tokens[:-1] + [tokens[300]]  # the last token's text repeats token 300's
    with caplog.at_level(logging.WARNING, logger="moerun"):
        tok = Tokenizer.from_gguf({**bpe_meta, "tokenizer.ggml.tokens": twice})
    assert f"token {len(tokens) - 1} {tokens[300]!r} repeats token 300" in caplog.text
    assert tok.encode(tokens[300].replace("\u0120", " ")) == good.encode(tokens[300].replace("\u0120", " "))


def test_unsupported_and_missing_tokenizers(bpe_meta, tmp_path):
    with pytest.raises(ModelFormatError, match="unsupported tokenizer model 'bert'") as e:
        Tokenizer.from_gguf({**bpe_meta, "tokenizer.ggml.model": "bert"}, path="x.gguf")
    assert e.value.path == "x.gguf"
    with pytest.raises(ModelFormatError, match="has no tokenizer"):
        Tokenizer.from_gguf({"general.architecture": "llama"})
    with pytest.raises(ModelFormatError, match="merges"):
        Tokenizer.from_gguf({k: v for k, v in bpe_meta.items() if k != "tokenizer.ggml.merges"})
    with pytest.raises(ModelFormatError, match="has no tokenizer.*tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# -- SentencePiece ("llama") -----------------------------------------------------------------------------------

def spm_vocab():
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "a", "b", "n", "▁h", "he", "el", "ll", "lo", "▁w", "wo",
              "or", "rl", "ld", "▁a", "ab", "ba", "an", "na", "▁▁", "hel", "hell", "hello", "▁hello", "▁wor",
              "world", "▁world", "ana", "▁ban", "banana", "▁banana", "▁▁▁", "ll▁", "o▁w"]
    scores = [float(-i) for i in range(len(pieces))]
    random.Random(7).shuffle(scores)
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces, "<tool>"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces), 4]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * 259 + scores + [0.0], "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}


def spm_merge(sym, ids, scores):
    """llama.cpp's llm_tokenizer_spm_session::tokenize, ported line for line: repeatedly merge the adjacent
    pair whose concatenation is the best-scoring token (leftmost on ties); unmatched characters -> bytes."""
    nxt, prv, heap = [*range(1, len(sym)), -1], list(range(-1, len(sym) - 1)), []

    def bigram(left, right):
        if left >= 0 and right >= 0 and sym[left] + sym[right] in ids:
            t = sym[left] + sym[right]
            heapq.heappush(heap, (-scores[ids[t]], left, right, len(t)))

    for i in range(len(sym) - 1):
        bigram(i, i + 1)
    while heap:
        _, left, right, n = heapq.heappop(heap)
        if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != n:
            continue
        sym[left], sym[right], nxt[left] = sym[left] + sym[right], "", nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        bigram(prv[left], left)
        bigram(left, nxt[left])
    out = []
    for p in filter(None, sym):
        out += [ids[p]] if p in ids else [ids[f"<0x{b:02X}>"] for b in p.encode()]
    return out


def llama_cpp_spm(meta, text):
    """llama.cpp's SPM tokenize: special tokens split out; a space before the text and after each special."""
    ids = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    out, prev_special = [], True
    for part in re.split("(</s>|<s>|<tool>)", text):
        if part in ("</s>", "<s>", "<tool>"):
            out.append(ids[part])
            prev_special = True
        elif part:
            sym = list(((" " if prev_special else "") + part).replace(" ", "▁"))
            out += spm_merge(sym, ids, meta["tokenizer.ggml.scores"])
            prev_special = False
    return out


def test_spm_matches_llama_cpp_algorithm():
    meta = spm_vocab()
    tok = Tokenizer.from_gguf(meta)
    assert tok.kind == "sentencepiece" and tok.add_bos and tok.bos_id == 1 and tok.eos_ids == {2}
    rng = random.Random(0)
    alphabet = ["h", "e", "l", "o", "w", "r", "d", "a", "b", "n", " ", "  ", "ñ", "你", "😀", "\n", "</s>", "<s>",
                "<tool>", "hello", "world", "banana", "hello world"]
    texts = ["hello world", " hello", "  banana  ", "ñ", "", *("".join(rng.choices(alphabet, k=rng.randint(1, 12)))
                                                               for _ in range(300))]
    for s in texts:
        assert tok.encode(s, add_special=False) == llama_cpp_spm(meta, s), s
    assert tok.encode("hello") == [1, *llama_cpp_spm(meta, "hello")]


def test_spm_decode_and_stream():
    tok = Tokenizer.from_gguf(spm_vocab())
    for s in ["hello world", "  banana  ", "ñ你😀 hello", "a\nb"]:
        ids = tok.encode(s)
        assert tok.decode(ids) == s
        stream = tok.incremental_decoder()
        chunks = [stream.step(i) for i in ids]
        assert "".join(chunks) + stream.flush() == s and all("\ufffd" not in c for c in chunks)
    assert tok.decode(tok.encode("hello<tool>")) == "hello<tool>"  # user-defined: kept
    assert tok.decode(tok.encode("hello</s>")) == "hello"          # control: skipped
    world = tok.token_to_id("▁world")  # its space separates it from the prompt
    assert tok.incremental_decoder().step(world) == "world"  # as decode([world]): the first space is stripped
    s = tok.incremental_decoder(prefix_ids=tok.encode("hello", add_special=False))
    assert s.step(world) == " world"
    assert tok.token_to_piece(tok.token_to_id("▁world")) == " world"
    assert tok.token_to_bytes(tok.token_to_id("<0xC3>")) == b"\xc3"


# -- Hugging Face folder ------------------------------------------------------------------------------------

def test_hf_folder(bpe_hf, tmp_path):
    write_hf_tokenizer(bpe_hf, tmp_path)
    ids = {t: bpe_hf.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids["<|im_end|>"], 5]}))
    mf = SimpleNamespace(format="safetensors", metadata={"config": {}, "dir": tmp_path}, path=tmp_path)
    tok = Tokenizer.from_model_file(mf)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for s in SAMPLES:
        assert tok.encode(s) == ref(s)["input_ids"], s
        assert tok.decode(tok.encode(s)) == ref.decode(ref(s)["input_ids"], skip_special_tokens=True)
    assert tok.kind == "byte_level" and not tok.add_bos and tok.eos_id == ids["<|im_end|>"]
    assert tok.eos_ids == {ids["<|im_end|>"], ids["<|endoftext|>"], 5}
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.special_tokens["eos_token"] == "<|im_end|>"


def test_hf_folder_add_bos_and_named_templates(bpe_hf, tmp_path):
    write_hf_tokenizer(bpe_hf, tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.update(add_bos_token=True, bos_token={"content": "<|endoftext|>", "special": True},
               chat_template=[{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.encode("hi")[0] == tok.bos_id == bpe_hf.token_to_id("<|endoftext|>")
    assert tok.chat_templates == {"default": "D", "tool_use": "T"}
    assert ChatTemplate.for_tokenizer(tok).render([]) == "D"
    assert ChatTemplate.for_tokenizer(tok, tools=[{"name": "f"}]).render([]) == "T"
    with pytest.raises(ChatTemplateError, match="no chat template named 'rag'"):
        ChatTemplate.for_tokenizer(tok, name="rag")


# -- chat templates ------------------------------------------------------------------------------------------

QWEN = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are helpful.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""

LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

MISTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported!') }}
    {%- endif %}
{%- endfor %}"""

CHATS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>there</b> ñ 你好"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "  2+2?  "}],
    [{"role": "user", "content": "one"}],
]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich <CH>"}}}]},
    {"role": "tool", "content": '{"temp": 21}'},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter für <city> & Umgebung",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def hf_ref(bpe_hf):
    return transformers.PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(bpe_hf.to_str()),
                                                bos_token="<|endoftext|>", eos_token="<|im_end|>")


SPECIALS = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}


@pytest.mark.parametrize("source", [QWEN, LLAMA3, MISTRAL, CHATML_TEMPLATE], ids=["qwen", "llama3", "mistral", "chatml"])
@pytest.mark.parametrize("gen", [False, True])
def test_chat_template_matches_transformers(hf_ref, source, gen):
    ours = ChatTemplate(source, SPECIALS)
    for chat in CHATS:
        ref = hf_ref.apply_chat_template(chat, chat_template=source, tokenize=False, add_generation_prompt=gen)
        assert ours.render(chat, add_generation_prompt=gen) == ref


def test_chat_template_tools_and_tojson_match_transformers(hf_ref):
    ours = ChatTemplate(QWEN, SPECIALS)
    ref = hf_ref.apply_chat_template(TOOL_CHAT, tools=TOOLS, chat_template=QWEN, tokenize=False,
                                     add_generation_prompt=True)
    text = ours.render(TOOL_CHAT, tools=TOOLS, add_generation_prompt=True)
    assert text == ref and "Wetter für <city> & Umgebung" in text and '"Zürich <CH>"' in text


def test_chat_template_continue_final_message_matches_transformers(hf_ref):
    chat = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    ref = hf_ref.apply_chat_template(chat, chat_template=QWEN, tokenize=False, continue_final_message=True)
    assert ChatTemplate(QWEN, SPECIALS).render(chat, continue_final_message=True) == ref
    assert ref.endswith("1, 2,")


def test_chat_template_raise_exception(hf_ref):
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="must alternate"):
        hf_ref.apply_chat_template(bad, chat_template=MISTRAL, tokenize=False)
    with pytest.raises(ChatTemplateError, match="rejected the messages: .*must alternate"):
        ChatTemplate(MISTRAL, SPECIALS).render(bad)


@pytest.mark.parametrize("source", ["{{ ''.__class__.__mro__ }}", "{{ ''.__class__ }}",
                                    "{{ cycler.__init__.__globals__.os }}", "{{ messages.append(1) }}",
                                    "{% set ns = namespace(_x=1) %}",
                                    "{{ (messages|first)['__class__'].__subclasses__() }}"])
def test_chat_template_sandbox(source):
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate(source).render([{"role": "user", "content": "x"}])
    assert isinstance(e.value, MoerunError) and "sandbox" in str(e.value)


def test_chat_template_errors_and_fallback(bpe_gguf):
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")
    tok, _ = bpe_gguf
    t = ChatTemplate.for_tokenizer(tok)  # the GGUF carries tools' ChatML template
    assert not t.is_fallback and t.render([{"role": "user", "content": "x"}], add_generation_prompt=True) == \
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    fallback = ChatTemplate.for_tokenizer(SimpleNamespace(chat_templates={}, special_tokens={}))
    assert fallback.is_fallback and fallback.render([{"role": "user", "content": "x"}]) == \
        "<|im_start|>user\nx<|im_end|>\n"
    gen = ChatTemplate("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}")
    assert gen.render([{"role": "assistant", "content": "ok"}]) == "ok"
