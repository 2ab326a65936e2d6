"""moerun.tools: presets, tokenizer, GGUF / safetensors writers, make_model and convert.

Files are read back with moerun's own readers and, for GGUF, with gguf.GGUFReader (independent).
"""

from __future__ import annotations

import json
import math

import gguf
import numpy as np
import pytest
import torch

from moerun.arch import expected_shapes, resolve
from moerun.formats import open_model
from moerun.formats.names import CName
from moerun.quant.qtypes import QTensor, QType
from moerun.quant.quantize import quantize
from moerun.text import ChatTemplate, Tokenizer
from moerun.text.templates import builtin_template
from moerun.tools import hf_out
from moerun.tools.convert import convert_hf_to_gguf
from moerun.tools.gguf_out import qtype_for, use_more_bits
from moerun.tools.make_model import generate_tensor, main, make_model
from moerun.tools.presets import preset
from moerun.tools.tokenizer import FAMILY_TEMPLATES, SPECIAL_TOKENS, build_tokenizer, gguf_tokenizer_metadata
from moerun.weights.loader import load_weights

FAMILIES = ("qwen3moe", "qwen2moe", "mixtral", "olmoe")
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")


@pytest.fixture(scope="module", autouse=True)
def _tokenizer_cache(tmp_path_factory):
    """Trained tokenizers go to a private cache, shared by this module's tests."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOERUN_CACHE", str(tmp_path_factory.mktemp("moerun-cache")))
        yield


def _read(path):
    mf = open_model(path)
    arch = resolve(mf)
    return mf, arch, load_weights(mf, arch)


def _dequant(w, cn, shape):
    return w[cn].dequantize().reshape(shape)


def _reader_field(r: gguf.GGUFReader, key: str):
    f = r.fields[key]
    return f.contents()


# --------------------------------------------------------------------------------------- presets


def test_presets():
    a3b = preset("a3b-L4")
    assert (a3b.family, a3b.n_layers, a3b.hidden, a3b.n_heads, a3b.n_kv_heads, a3b.head_dim) == \
        ("qwen3moe", 4, 2048, 32, 4, 128)
    assert (a3b.n_experts, a3b.n_experts_used, a3b.expert_ffn, a3b.vocab, a3b.rms_eps, a3b.rope_theta) == \
        (128, 8, 768, 1024, 1e-6, 1e6)
    assert preset("a3b-L12").n_layers == 12
    for fam in FAMILIES:
        s = preset(f"tiny-{fam}")
        assert (s.family, s.hidden, s.n_layers, s.n_experts, s.n_experts_used, s.vocab) == (fam, 64, 2, 8, 2, 512)
    assert preset("tiny-qwen2moe").shared_ffn == 64 and preset("tiny-qwen2moe").qkv_bias
    s = preset("tiny-mixtral", layers=3, hidden=128, experts=4, vocab=300)
    assert (s.n_layers, s.moe_layers, s.hidden, s.n_experts, s.vocab) == (3, (True,) * 3, 128, 4, 300)
    assert preset("tiny-qwen3moe", family="olmoe").qk_norm == "full"
    with pytest.raises(ValueError, match="unknown model field"):
        preset("tiny-olmoe", bogus=1)
    with pytest.raises(ValueError, match="unknown preset"):
        preset("nope")


# ------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_deterministic_and_complete(tmp_path, monkeypatch):
    tok = build_tokenizer(512)
    assert tok.get_vocab_size() == 512
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [509, 510, 511]
    text = "def f(x):\n    return 'héllo' + x  # ✓"
    assert tok.decode(tok.encode(text).ids) == text
    monkeypatch.setenv("MOERUN_CACHE", str(tmp_path))  # a fresh cache: trained again, same result
    assert build_tokenizer(512).to_str() == tok.to_str()
    assert build_tokenizer(256).get_vocab_size() == 256  # tiny vocabularies drop non-UTF-8 bytes
    meta = gguf_tokenizer_metadata(tok)
    assert set(TOKENIZER_KEYS) <= set(meta)
    vocab = tok.get_vocab(with_added_tokens=True)
    assert meta["tokenizer.ggml.tokens"] == sorted(vocab, key=vocab.get)
    assert meta["tokenizer.ggml.token_type"] == [1] * 509 + [3] * 3
    merges = meta["tokenizer.ggml.merges"]
    assert len(merges) == 512 - 256 - 3 and all(len(m.split(" ")) == 2 for m in merges)
    assert all("".join(m.split(" ")) in vocab for m in merges)
    assert meta["tokenizer.ggml.eos_token_id"] == tok.token_to_id("<|im_end|>")
    assert meta["tokenizer.ggml.bos_token_id"] == meta["tokenizer.ggml.padding_token_id"] == 509


# ------------------------------------------------------------------------------------ quant mix


def test_use_more_bits_and_qtype_for():
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(4) if use_more_bits(i, 4)] == [2, 3]
    cn = CName
    assert qtype_for(cn("attn_norm.weight", 0), (256,), "Q8_0") == QType.F32
    assert qtype_for(cn("ffn_gate_inp.weight", 0), (8, 256), "Q4_K_M") == QType.F32
    assert qtype_for(cn("ffn_gate_inp_shexp.weight", 0), (1, 256), "Q8_0") == QType.F32
    assert qtype_for(cn("attn_q.weight", 0), (256, 256), "F16") == QType.F16
    assert qtype_for(cn("attn_q.weight", 0), (256, 64), "Q4_K") == QType.Q8_0  # row not a multiple of 256
    assert qtype_for(cn("output.weight"), (512, 256), "Q4_K_M") == QType.Q6_K
    assert qtype_for(cn("output.weight"), (512, 96), "Q4_K_M") == QType.Q8_0
    assert qtype_for(cn("ffn_down_exps.weight", 3), (8, 256, 256), "Q4_K_M", n_layers=4) == QType.Q6_K
    assert qtype_for(cn("ffn_down_exps.weight", 1), (8, 256, 256), "Q4_K_M", n_layers=4) == QType.Q4_K


# -------------------------------------------------------------------------------------------- GGUF


@pytest.mark.parametrize("ftype", ["F32", "Q8_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_round_trip(tmp_path, family, ftype):
    spec = preset(f"tiny-{family}")
    path = make_model(f"tiny-{family}", tmp_path / "m.gguf", ftype=ftype, seed=3, progress=False)
    mf, arch, w = _read(path)
    assert arch.spec == spec
    for cn, shape in expected_shapes(spec).items():
        want = generate_tensor(cn, shape, seed=3)
        qtype = qtype_for(cn, shape, ftype, n_layers=spec.n_layers)
        assert w[cn].qtype == qtype, cn
        if qtype != QType.F32:
            want = QTensor.from_bytes(quantize(want, qtype), qtype, shape).dequantize()
        torch.testing.assert_close(_dequant(w, cn, shape), want, rtol=0, atol=0, msg=cn.gguf)
    mf.close()

    r = gguf.GGUFReader(path)  # an independent reader
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types == {cn.gguf: qtype_for(cn, s, ftype, n_layers=spec.n_layers) for cn, s in expected_shapes(spec).items()}
    assert set(TOKENIZER_KEYS) <= set(r.fields)
    assert _reader_field(r, "general.architecture") == arch.family.gguf_arch
    assert _reader_field(r, "general.file_type") == {"F32": 0, "Q8_0": 7}[ftype]
    assert _reader_field(r, "general.quantization_version") == 2
    assert len(_reader_field(r, "tokenizer.ggml.tokens")) == spec.vocab
    emb = next(t for t in r.tensors if t.name == "token_embd.weight")
    assert list(emb.shape) == [spec.hidden, spec.vocab]  # ggml order


def test_gguf_q4_k_m_mix(tmp_path):
    spec = preset("tiny-qwen3moe", layers=4, hidden=256, expert_ffn=256)
    path = make_model(spec, tmp_path / "m.gguf", ftype="Q4_K_M", progress=False)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["output.weight"] == QType.Q6_K and types["token_embd.weight"] == QType.Q4_K
    for i in range(4):  # use_more_bits(i, 4): layers 2 and 3
        more = QType.Q6_K if i >= 2 else QType.Q4_K
        assert types[f"blk.{i}.attn_v.weight"] == more and types[f"blk.{i}.ffn_down_exps.weight"] == more
        assert types[f"blk.{i}.ffn_gate_exps.weight"] == types[f"blk.{i}.attn_q.weight"] == QType.Q4_K
        assert types[f"blk.{i}.attn_output.weight"] == QType.Q8_0  # rows of q_dim 64: K-quant fallback
        assert types[f"blk.{i}.ffn_gate_inp.weight"] == types[f"blk.{i}.attn_q_norm.weight"] == QType.F32
    mf, _, w = _read(path)
    cn = CName("ffn_down_exps.weight", 3)
    shape = expected_shapes(spec)[cn]
    err = (_dequant(w, cn, shape) - generate_tensor(cn, shape)).abs().max()
    assert err < 0.1 * generate_tensor(cn, shape).abs().max()
    mf.close()


# ------------------------------------------------------------------------------------ safetensors


@pytest.mark.parametrize("family", FAMILIES)
def test_safetensors_round_trip(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    spec = preset(f"tiny-{family}")
    folder = make_model(spec, tmp_path / "hf", fmt="safetensors", seed=5, progress=False)
    mf, arch, w = _read(folder)
    assert arch.spec == spec
    for cn, shape in expected_shapes(spec).items():
        torch.testing.assert_close(_dequant(w, cn, shape), generate_tensor(cn, shape, seed=5), rtol=0, atol=0)
    mf.close()

    cfg = transformers.AutoConfig.from_pretrained(folder)
    assert cfg.model_type == hf_out.HF_ARCHITECTURES[family][0]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert type(model).__name__ == hf_out.HF_ARCHITECTURES[family][1]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all() and 0.1 < float(logits.std()) < 10
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert len(tok) == spec.vocab and tok.eos_token == "<|im_end|>"
    assert tok.chat_template == builtin_template(FAMILY_TEMPLATES[family])  # the family's published template
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    ours = ChatTemplate(Tokenizer.from_hf_dir(folder).chat_template, {"eos_token": tok.eos_token})  # no BOS, as tok
    assert chat == ours.render([{"role": "user", "content": "hi"}], add_generation_prompt=True) and "hi" in chat


def test_safetensors_shards(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_out, "SHARD_BYTES", 100_000)
    spec = preset("tiny-qwen2moe")
    folder = make_model(spec, tmp_path / "hf", fmt="safetensors", ftype="BF16", progress=False)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    mf, arch, w = _read(folder)
    assert arch.spec == spec
    cn = CName("ffn_up_exps.weight", 1)
    shape = expected_shapes(spec)[cn]
    assert w[cn].qtype == QType.BF16
    torch.testing.assert_close(_dequant(w, cn, shape), generate_tensor(cn, shape).bfloat16().float())
    mf.close()


# ---------------------------------------------------------------------------------- never clobber


def test_refuses_to_overwrite(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"user data")
    with pytest.raises(FileExistsError):
        make_model("tiny-olmoe", path, progress=False)
    assert path.read_bytes() == b"user data"
    assert main(["tiny-olmoe", str(path), "--no-progress"]) == 1
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):  # not a model folder: not replaced even with overwrite
        make_model("tiny-olmoe", folder, fmt="safetensors", overwrite=True, progress=False)
    assert (folder / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "notes"]  # no temporaries left

    make_model("tiny-olmoe", path, overwrite=True, progress=False)
    assert path.read_bytes()[:4] == b"GGUF"
    hf = make_model("tiny-olmoe", tmp_path / "hf", fmt="safetensors", progress=False)
    make_model("tiny-olmoe", hf, fmt="safetensors", ftype="F16", overwrite=True, progress=False)
    assert json.loads((hf / "config.json").read_text())["dtype"] == "float16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m.gguf", "notes"]


def test_the_overwrite_refusal_names_the_flag_on_the_command_line_and_the_keyword_in_python(tmp_path, capsys):
    from moerun.builtin import default_model_path
    from moerun.tools.convert import main as convert_main

    path = tmp_path / "m.gguf"
    path.write_bytes(b"user data")
    with pytest.raises(FileExistsError, match=r"already exists \(pass overwrite=True to replace it\)$"):
        make_model("tiny-olmoe", path, progress=False)
    for tool_main, args in ((main, ["tiny-olmoe", str(path), "--no-progress"]),
                            (convert_main, [str(default_model_path()), str(path), "--no-progress"])):
        assert tool_main(args) == 1
        err = capsys.readouterr().err
        assert err == f"error: {path} already exists (pass --overwrite to replace it)\n"
    assert path.read_bytes() == b"user data"


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_outputs_get_the_mode_the_umask_gives(tmp_path, mask):
    import os
    import stat

    old = os.umask(mask)
    try:
        gguf_path = make_model("tiny-olmoe", tmp_path / "m.gguf", progress=False)
        folder = make_model("tiny-olmoe", tmp_path / "hf", fmt="safetensors", progress=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE(gguf_path.stat().st_mode) == 0o666 & ~mask
    assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~mask
    assert {stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == {0o666 & ~mask}


def test_cli_main(tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert main(["tiny-mixtral", str(out), "--ftype", "Q8_0", "--layers", "3", "--set", "rope_theta=5e5",
                 "--no-progress"]) == 0
    mf = open_model(out)
    spec = resolve(mf).spec
    assert (spec.n_layers, spec.rope_theta) == (3, 5e5)
    mf.close()
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "preset" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------- convert


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (rotate-half -> interleaved rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_transformers_model(tmp_path, hf_model, family):
    model, folder = hf_model(family)
    out = convert_hf_to_gguf(folder, tmp_path / "c.gguf", progress=False)
    r = gguf.GGUFReader(out)
    got = {t.name: torch.from_numpy(np.array(t.data)) for t in r.tensors}
    assert all(t.tensor_type == QType.F32 for t in r.tensors)
    cfg = model.config
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    mixtral = family == "mixtral"
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        q, k = sd[pre + "self_attn.q_proj.weight"], sd[pre + "self_attn.k_proj.weight"]
        if mixtral:
            q, k = _llama_cpp_permute(q, cfg.num_attention_heads), _llama_cpp_permute(k, cfg.num_key_value_heads)
        assert torch.equal(got[f"blk.{i}.attn_q.weight"], q) and torch.equal(got[f"blk.{i}.attn_k.weight"], k)
        assert torch.equal(got[f"blk.{i}.attn_output.weight"], sd[pre + "self_attn.o_proj.weight"])
        # transformers 5 holds every family's experts fused in memory: gate_up_proj [E, 2I, H], down_proj [E, H, I]
        assert torch.equal(got[f"blk.{i}.ffn_gate_inp.weight"], sd[pre + "mlp.gate.weight"])
        gate, up = sd[pre + "mlp.experts.gate_up_proj"].chunk(2, dim=-2)
        assert torch.equal(got[f"blk.{i}.ffn_gate_exps.weight"], gate)
        assert torch.equal(got[f"blk.{i}.ffn_up_exps.weight"], up)
        assert torch.equal(got[f"blk.{i}.ffn_down_exps.weight"], sd[pre + "mlp.experts.down_proj"])
        assert torch.equal(got[f"blk.{i}.ffn_norm.weight"], sd[pre + "post_attention_layernorm.weight"])
    assert torch.equal(got["token_embd.weight"], sd["model.embed_tokens.weight"])
    assert torch.equal(got["output.weight"], sd["lm_head.weight"])
    assert len(_reader_field(r, "tokenizer.ggml.tokens")) == cfg.vocab_size

    mf_hf, mf_gg = open_model(folder), open_model(out)
    want = resolve(mf_hf).spec
    assert resolve(mf_gg).spec == want
    mf_hf.close()
    mf_gg.close()


def test_convert_own_hf_folder_matches_direct_gguf(tmp_path):
    spec = preset("tiny-mixtral", layers=3)
    hf = make_model(spec, tmp_path / "hf", fmt="safetensors", seed=7, progress=False)
    a = gguf.GGUFReader(convert_hf_to_gguf(hf, tmp_path / "c.gguf", name="x", progress=False))
    b = gguf.GGUFReader(make_model(spec, tmp_path / "d.gguf", seed=7, name="x", progress=False))
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert np.array_equal(np.asarray(ta.data), np.asarray(tb.data)), ta.name
    assert set(a.fields) == set(b.fields)
    for key in a.fields:
        if not key.startswith("GGUF."):
            assert _reader_field(a, key) == _reader_field(b, key), key


def test_unrepresentable_hf_spec_is_refused(tmp_path):
    with pytest.raises(ValueError, match="clip_qkv"):
        make_model(preset("tiny-qwen3moe", clip_qkv=8.0), tmp_path / "hf", fmt="safetensors", progress=False)
    assert not any(tmp_path.iterdir())


def test_convert_requantizes(tmp_path):
    src = make_model("tiny-qwen3moe", tmp_path / "f32.gguf", progress=False)
    out = convert_hf_to_gguf(src, tmp_path / "q8.gguf", ftype="Q8_0", progress=False)
    ref = make_model("tiny-qwen3moe", tmp_path / "ref.gguf", ftype="Q8_0", progress=False)
    a, b = gguf.GGUFReader(out), gguf.GGUFReader(ref)
    for ta, tb in zip(a.tensors, b.tensors):
        assert ta.name == tb.name and ta.tensor_type == tb.tensor_type
        assert np.array_equal(np.asarray(ta.data), np.asarray(tb.data)), ta.name
    assert math.isclose(_reader_field(a, "qwen3moe.rope.freq_base"), 1e6)


def test_convert_keeps_the_folders_tokenizer_and_special_ids(hf_model, tmp_path):
    """The GGUF gets the HF folder's own tokenizer: same ids for text, and the EOS tokenizer_config.json names."""
    import json
    import shutil

    from moerun.text import Tokenizer

    _, src = hf_model("qwen3moe")
    folder = tmp_path / "hf"
    shutil.copytree(src, folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["eos_token"] = "<|endoftext|>"  # not the generated tokenizer's default EOS (<|im_end|>)
    cfg_path.write_text(json.dumps(cfg))
    hf_tok = Tokenizer.from_hf_dir(folder)
    path = convert_hf_to_gguf(folder, tmp_path / "m.gguf", ftype="F32", progress=False)
    with open_model(path) as mf:
        gg_tok = Tokenizer.from_model_file(mf)
    text = "def f(x):\n    return x + 1  # héllo 你好"
    assert gg_tok.encode(text, add_special=False) == hf_tok.encode(text, add_special=False)
    assert gg_tok.id_to_token(gg_tok.eos_id) == "<|endoftext|>" == hf_tok.id_to_token(hf_tok.eos_id)
