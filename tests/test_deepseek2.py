"""DeepSeek-V2 and -V3 (deepseek2), issue 16 item 2. Two tiny random transformers models are the reference:
`DeepseekV2ForCausalLM` as V2-Lite is built (q straight from x, softmax routing, greedy, not renormalised,
YaRN with mscale = mscale_all_dim = 0.707) and `DeepseekV3ForCausalLM` (the q latent, sigmoid routing with a
non-zero correction bias within the best 2 of 4 groups, renormalised, YaRN with mscale 1, a NextN/MTP layer
stored past the model's), both with a leading dense layer, two shared experts and a routed scale. Logits and
greedy generation from the HF folder and from our GGUF conversion (prefill in chunks, decode through MLA's
absorbed form), the KV cache holding the latent, llama.cpp's GGUF keys and names (gguf-py's tables) and
llama.cpp itself running our file, quantized conversions through the C kernels, inspect's counts, the expert
cache, CPU stages, the CPU stand-in device, the server and the estimator."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from click.testing import CliRunner
from family_checks import (
    add_mtp_layer,
    check_estimate,
    check_expert_cache,
    check_gpu_logits,
    check_inspect_counts,
    check_kv_types,
    check_server_completion,
    check_speculative,
    check_standin_hf_logits,
    check_standin_miss_paths,
    check_triton_standin,
    check_two_cpu_stages,
    dequantized_reference,
    gguf_fields,
    kernel_path_errors,
    names_outside_llama_cpp,
    rewrite_gguf,
)
from hf_models import build, reference_logits, save

from moerun.cli import main
from moerun.config import SamplingParams
from moerun.engine.engine import Engine
from moerun.engine.kv_cache import KVPool, SeqKV
from moerun.formats import open_model
from moerun.loading import load_model
from moerun.model import layers
from moerun.quant.qtypes import QType
from moerun.text import Tokenizer
from moerun.tools.convert import convert_hf_to_gguf

H, V, ORIGINAL = 64, 512, 16  # YaRN's original context: the 32-token prompt runs past it


def ds_config(v3: bool, hidden: int = H, nope: int = 16, rope: int = 8, dv: int = 16, rank: int = 32,
              q_rank: int = 24, moe_ffn: int = 32, dense_ffn: int = 96, shared: int = 2, **kw):
    import transformers as tf

    m = 1.0 if v3 else 0.707
    common = {"vocab_size": V, "hidden_size": hidden, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 4, "intermediate_size": dense_ffn, "moe_intermediate_size": moe_ffn,
              "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": shared,
              "first_k_dense_replace": 1, "kv_lora_rank": rank, "qk_nope_head_dim": nope,
              "qk_rope_head_dim": rope, "v_head_dim": dv, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "max_position_embeddings": 40 * ORIGINAL,
              "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                  "original_max_position_embeddings": ORIGINAL, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "mscale": m, "mscale_all_dim": m}}
    if v3:
        return tf.DeepseekV3Config(**(common | {"q_lora_rank": q_rank, "n_group": 4, "topk_group": 2,
                                                "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                                                "num_nextn_predict_layers": 1} | kw))
    return tf.DeepseekV2Config(**(common | {"q_lora_rank": None, "topk_method": "greedy",
                                            "routed_scaling_factor": 1.5, "norm_topk_prob": False} | kw))


def build_ds(config, seed: int = 0):
    """hf_models.build (every parameter perturbed), and V3's correction bias large enough to change
    choices."""
    model = build("deepseek2", seed=seed, config=config)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return model


@pytest.fixture(scope="module", params=["v2", "v3"])
def ds(request, tmp_path_factory):
    """(version, transformers model, its save_pretrained folder (V3: with an MTP layer), our F32 GGUF)."""
    v3 = request.param == "v3"
    config = ds_config(v3)
    model = build_ds(config)
    folder = save(model, tmp_path_factory.mktemp(f"ds-{request.param}-hf"))
    if v3:
        add_mtp_layer(folder, config)
    path = convert_hf_to_gguf(folder, tmp_path_factory.mktemp("ds-gguf") / f"{request.param}.gguf",
                              progress=False)
    return request.param, model, folder, path


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(1234))


# ------------------------------------------------------------------------------------------------ parity


def test_every_feature_changes_the_reference(ds, tokens):
    """The tiny models are not degenerate: without YaRN's frequencies, its mscale on the softmax scale, the
    routed scale (and V3's correction bias, groups, renormalisation) transformers' own logits move."""
    version, model, _, _ = ds
    ref = reference_logits(model, tokens)
    changes = ["yarn", "mscale", "scale"] + (["bias", "groups", "norm"] if version == "v3" else [])
    moved = {}
    for change in changes:
        m = copy.deepcopy(model)
        if change == "yarn":
            rope = m.config.qk_rope_head_dim
            m.model.rotary_emb.inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rope, 2).float() / rope)
        for layer in m.model.layers:
            if change == "mscale":
                layer.self_attn.scaling = m.config.qk_head_dim**-0.5
            gate = getattr(layer.mlp, "gate", None)
            if gate is None or change in ("yarn", "mscale"):
                continue
            if change == "bias":
                gate.e_score_correction_bias.zero_()
            elif change == "groups":
                gate.num_group = gate.topk_group = 1
            elif change == "norm":
                gate.norm_topk_prob = False
            else:
                gate.routed_scaling_factor = 1.0
        moved[change] = (reference_logits(m, tokens) - ref).abs().max().item()
    assert all(d > 1e-2 for d in moved.values()), moved


def test_hf_folder_logits_match_transformers(ds, tokens, tmp_path):
    """From the save_pretrained folder (V3's with its MTP layer); a Kimi K2 config.json (model_type kimi_k2,
    V3's keys, which transformers does not map) reads as V3's spec."""
    version, model, folder, _ = ds
    loaded = load_model(folder)
    s = loaded.arch.spec
    assert (s.attention, s.n_layers, s.moe_layers, s.shared_ffn, s.kv_lora_rank) == \
        ("mla", 3, (False, True, True), 64, 32)
    want = (24, "sigmoid", 4) if version == "v3" else (0, "softmax", 1)
    assert (s.q_lora_rank, s.router, s.n_groups) == want
    assert not any(cn.layer == 3 for cn in loaded.arch.sources)  # V3's MTP layer is not part of the model
    err = (loaded.model.forward(tokens) - reference_logits(model, tokens)).abs().max().item()
    assert err < 1e-4, f"max abs error {err:.2e}"
    if version == "v3":
        cfg = json.loads((folder / "config.json").read_text()) | {"model_type": "kimi_k2"}
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
        assert load_model(tmp_path).arch.spec == s


def test_gguf_logits_match_transformers(ds, tokens):
    _, model, _, path = ds
    err = (load_model(path).model.forward(tokens) - reference_logits(model, tokens)).abs().max().item()
    assert err < 1e-4, f"max abs error {err:.2e}"


@pytest.mark.parametrize("variant", ["v2-group-limited", "v3-rope-halves", "v3-fused-experts"])
def test_variants_match_transformers(variant, tokens, tmp_path):
    """V2's group_limited_greedy (groups scored by their best expert), V3 with rope_interleave=false (RoPE on
    rotated halves: runs from the HF folder; cannot be written for llama.cpp, one line), and experts saved as
    transformers 5 holds them (gate_up_proj)."""
    if variant == "v2-group-limited":
        config = ds_config(False, topk_method="group_limited_greedy", n_group=4, topk_group=2)
    else:
        config = ds_config(True, rope_interleave=variant != "v3-rope-halves")
    model = build_ds(config, seed=2)
    folder = save(model, tmp_path / "hf", fused=variant == "v3-fused-experts")
    loaded = load_model(folder)
    err = (loaded.model.forward(tokens) - reference_logits(model, tokens)).abs().max().item()
    assert err < 1e-4, f"max abs error {err:.2e}"
    if variant == "v2-group-limited":
        assert (loaded.arch.spec.n_groups, loaded.arch.spec.group_score) == (4, "max")
    if variant == "v3-rope-halves":
        assert loaded.arch.spec.rope_style == "neox"
        r = CliRunner().invoke(main, ["convert", str(folder), str(tmp_path / "x.gguf")])
        assert r.exit_code == 1 and r.output.count("\n") == 1 and "rope_interleave" in r.output, r.output


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_equals_transformers_generate(ds, tokens, source, monkeypatch):
    """Greedy generation of 32 tokens after a 32-token prompt prefilled in chunks of 20 and 12: the first
    chunk in MLA's expanded form, the second and every decode step in the absorbed form (queries through W_UK
    into the latent space, over the cached latents), in the fused C layers and in the torch loop."""
    _, model, folder, path = ds
    prompt = tokens.tolist()
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32, min_new_tokens=32,
                             pad_token_id=0)[0, len(prompt):].tolist()
    forms = {"absorbed": [], "expanded": []}
    for name, seen in forms.items():
        real = getattr(layers, f"mla_{name}")

        def spy(q_nope, *a, real=real, seen=seen, **kw):
            seen.append(q_nope.shape[0])
            return real(q_nope, *a, **kw)

        monkeypatch.setattr(layers, f"mla_{name}", spy)
    from moerun.kernels import (
        rows,  # the loop's absorbed form on the CPU: the C layers' (moerun.kernels.rows)
    )

    def spy_rows(q_nope, *a, real=rows.mla, **kw):
        forms["absorbed"].append(q_nope.shape[0])
        return real(q_nope, *a, **kw)

    monkeypatch.setattr(rows, "mla", spy_rows)
    loaded = load_model(folder if source == "hf" else path)
    assert loaded.model.fused is not None
    for fused in (loaded.model.fused, None):  # the C layers (mla.c), then the torch layer loop
        loaded.model.fused = fused
        for seen in forms.values():
            seen.clear()
        eng = Engine(loaded.model, Tokenizer.from_model_file(loaded.file), ctx_size=256, ubatch=20)
        gen = eng.generate(prompt, SamplingParams.greedy(max_tokens=32, ignore_eos=True)).run()
        assert gen.tokens == ref
        assert forms["expanded"] == [20] * 3  # the first chunk, in each layer
        # the second chunk, then every decode step: absorbed in the C layers, or through the loop
        assert forms["absorbed"] == ([] if fused else [12] * 3 + [1] * 31 * 3)


# ------------------------------------------------------------------------------------------- KV cache


def test_kv_cache_holds_the_latent(ds, tokens):
    """The pool keeps one latent per position and layer: the normed kv_lora_rank compression and the rotated
    shared key, exactly what transformers' cache holds for MLA (V3's rotated key there in its de-interleaved
    order). Bytes per token of context, float32: 3 layers x (32 + 8) x 4 = 480 here against 3 x 4 heads x
    (24 + 16) x 4 = 1920 for full keys and values (4x); DeepSeek-V2-Lite's shape (27 layers, 16 heads, rank
    512, rope 64, heads of 192 / 128) 62,208 against 552,960 (8.9x); V3's (61 layers, 128 heads) 140,544
    against 9,994,240 (71x). (The planner counts the same: test_estimate_bytes_per_token.)"""
    from moerun.tools.presets import preset

    version, model, _, path = ds
    loaded = load_model(path)
    s = loaded.arch.spec
    kv = SeqKV(KVPool(s, 64), 64)
    loaded.model.forward(tokens, kv)
    T, rank = len(tokens), s.kv_lora_rank
    with torch.no_grad():
        cache = model(tokens[None], use_cache=True).past_key_values
    for i in range(s.n_layers):
        latent = kv.read(i, T)[0]  # [T, rank + rope]
        assert latent.shape == (T, rank + s.qk_rope_dim)
        k_pe = latent[:, rank:]
        if version == "v3":  # transformers' interleaved RoPE returns the rotated pairs as (evens, odds)
            k_pe = torch.cat((k_pe[:, 0::2], k_pe[:, 1::2]), dim=-1)
        assert torch.allclose(latent[:, :rank], cache.layers[i].keys[0, 0], atol=1e-5)
        assert torch.allclose(k_pe, cache.layers[i].values[0, 0], atol=1e-5)

    def per_token(spec) -> tuple[int, int]:
        pool = KVPool(spec, 32)
        full = spec.n_layers * spec.n_heads * (spec.head_dim + spec.v_head_dim) * 4
        return pool.nbytes // pool.n_slots, full

    assert per_token(s) == (480, 1920)
    v2lite = preset("v2lite-L4", layers=27)
    assert per_token(v2lite) == (62208, 552960)
    v3 = preset("tiny-deepseek3", layers=61, hidden=7168, heads=128, kv_lora_rank=512, qk_nope_dim=128,
                qk_rope_dim=64, v_head_dim=128, q_lora_rank=1536, head_dim=192)
    assert per_token(v3) == (140544, 9994240)


def test_batched_decode_equals_one_sequence_at_a_time(ds, tokens):
    """Two sequences of different lengths decoded together (each row attends over its own cached latents, in
    scattered blocks of one pool) give each one's logits alone."""
    _, _, _, path = ds
    model = load_model(path).model
    pool = KVPool(model.spec, 256, block_size=4)
    a, b, alone = SeqKV(pool, 128), SeqKV(pool, 128), SeqKV(KVPool(model.spec, 128), 128)
    model.forward(tokens[5:15], a)
    model.forward(tokens[:5], b)  # between a's: a's blocks are scattered (read by gathering)
    model.forward(tokens[15:], a)
    assert a.blocks != list(range(a.blocks[0], a.blocks[0] + len(a.blocks)))
    model.forward(tokens[5:], alone)
    for t in tokens[:6]:
        both = model.decode(torch.stack((t, tokens[0])), [a, b])
        assert (both[0] - model.decode(t.view(1), [alone])[0]).abs().max().item() < 1e-5
        b.truncate(b.length - 1)  # keep b's context as it was
    assert a.length == alone.length == 27 + 6


# ---------------------------------------------------------------------------------- GGUF: keys, names


def test_gguf_keys_and_names_are_llama_cpp_s(ds):
    import gguf

    version, _, _, path = ds
    kv = gguf_fields(path, "deepseek2")
    assert (kv["block_count"], kv["leading_dense_block_count"], kv["attention.head_count_kv"]) == (3, 1, 1)
    assert (kv["attention.kv_lora_rank"], kv["attention.key_length"], kv["attention.value_length"]) == \
        (32, 40, 32)
    assert (kv["attention.key_length_mla"], kv["attention.value_length_mla"], kv["rope.dimension_count"]) == \
        (24, 16, 8)
    assert kv["attention.q_lora_rank"] == (24 if version == "v3" else 0)
    assert kv["expert_shared_count"] == 2 and kv["expert_feed_forward_length"] == 32
    assert kv["feed_forward_length"] == 96 and kv["expert_count"] == 8 and kv["expert_used_count"] == 2
    assert kv["rope.scaling.type"] == "yarn" and kv["rope.scaling.factor"] == 40.0
    assert kv["rope.scaling.original_context_length"] == ORIGINAL
    m = 1.0 if version == "v3" else 0.707
    assert kv["rope.scaling.yarn_log_multiplier"] == pytest.approx(0.1 * m)  # llama.cpp: 0.1 * mscale_all_dim
    if version == "v3":
        assert kv["expert_gating_func"] == int(gguf.ExpertGatingFuncType.SIGMOID)
        assert kv["expert_weights_scale"] == pytest.approx(2.5) and kv["expert_weights_norm"] is True
        assert kv["expert_group_count"] == 4 and kv["expert_group_used_count"] == 2
    else:
        assert kv["expert_gating_func"] == int(gguf.ExpertGatingFuncType.SOFTMAX)
        assert kv["expert_weights_scale"] == pytest.approx(1.5) and kv["expert_weights_norm"] is False
        assert "expert_group_count" not in kv
    assert gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DEEPSEEK2] == "deepseek2"
    assert names_outside_llama_cpp(path, gguf.MODEL_ARCH.DEEPSEEK2) == []
    tensors = {t.name: [int(d) for d in t.shape] for t in gguf.GGUFReader(str(path)).tensors}
    # llama.cpp's shapes (ne): attn_k_b {nope, rank, heads}, attn_v_b {rank, v, heads}, attn_kv_a_mqa
    # {H, rank + rope}
    assert tensors["blk.1.attn_k_b.weight"] == [16, 32, 4] and tensors["blk.1.attn_v_b.weight"] == [32, 16, 4]
    assert tensors["blk.1.attn_kv_a_mqa.weight"] == [64, 40] and "blk.1.attn_kv_b.weight" not in tensors
    want = {"blk.1.attn_q_a.weight", "blk.1.attn_q_a_norm.weight", "blk.1.attn_q_b.weight",
            "blk.1.exp_probs_b.bias"} if version == "v3" else {"blk.1.attn_q.weight"}
    assert want | {"blk.0.ffn_down.weight", "blk.2.ffn_up_shexp.weight"} <= set(tensors)


def write_older_gguf(src, out, heads: int) -> None:
    """`src` as llama.cpp's converters wrote DeepSeek before the absorbed form: attn_kv_b whole
    ([heads * (nope + v), rank], each head's key rows then its value rows), key/value_length the heads' and
    head_count_kv the heads', no *_mla keys."""
    import numpy as np

    with open_model(src) as mf:
        meta = mf.metadata
    a = "deepseek2.attention"
    keys = {f"{a}.key_length": meta[f"{a}.key_length_mla"], f"{a}.key_length_mla": None,
            f"{a}.value_length": meta[f"{a}.value_length_mla"], f"{a}.value_length_mla": None,
            f"{a}.head_count_kv": heads}
    k_bs = {}

    def tensor(name, data):
        if "attn_k_b" in name:  # attn_v_b follows: kv_b from both
            k_bs[name] = data
            return []
        if "attn_v_b" not in name:
            return [(name, data)]
        k_b = k_bs.pop(name.replace("attn_v_b", "attn_k_b"))  # [heads, rank, nope]; data: [heads, v, rank]
        kv_b = np.concatenate((k_b.transpose(0, 2, 1), data), axis=1)  # [heads, nope + v, rank]
        return [(name.replace("attn_v_b", "attn_kv_b"), kv_b.reshape(-1, kv_b.shape[-1]))]

    rewrite_gguf(src, out, key=lambda k, v: keys.get(k, v), tensor=tensor)


def test_older_gguf_with_kv_b_whole_gives_the_same_logits(ds, tokens, tmp_path):
    _, model, _, path = ds
    older = tmp_path / "older.gguf"
    write_older_gguf(path, older, heads=4)
    with open_model(older) as mf:
        assert "blk.1.attn_kv_b.weight" in mf.records and "blk.1.attn_k_b.weight" not in mf.records
        assert "deepseek2.attention.key_length_mla" not in mf.metadata
    got = load_model(older)
    assert got.arch.spec == load_model(path).arch.spec
    assert (got.model.forward(tokens) - reference_logits(model, tokens)).abs().max().item() < 1e-4


def test_llama_cpp_runs_our_gguf(ds, tokens):
    """llama.cpp (llama-cpp-python, when installed) loads our conversion and evaluates it: its logits within
    1e-2 of ours (its MLA path keeps an f16 K cache; measured max difference 6e-3 on logits of size ~4) and
    the
    same greedy tokens for 16 steps."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import numpy as np

    _, _, _, path = ds
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=1, logits_all=True, verbose=False,
                          n_batch=64)
    prompt = tokens[:16].tolist()
    llm.eval(prompt)
    theirs = torch.from_numpy(np.array(llm.scores[:len(prompt)]))
    model = load_model(path).model
    ours = model.forward(torch.tensor(prompt))
    assert (ours - theirs).abs().max().item() < 1e-2
    their_tokens = []
    for _ in range(16):
        their_tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([their_tokens[-1]])
    eng = Engine(model, Tokenizer.from_model_file(load_model(path).file), ctx_size=128)
    ours = eng.generate(prompt, SamplingParams.greedy(max_tokens=16, ignore_eos=True)).run().tokens
    assert ours == their_tokens


def test_bad_input_is_one_line(ds, tmp_path):
    import gguf

    _, _, folder, _ = ds
    bad = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(bad), "deepseek2")
    w.add_block_count(1)
    w.add_embedding_length(H)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(8)
    w.add_key_length_mla(24)
    w.add_value_length_mla(16)
    w.add_tensor("token_embd.weight", torch.zeros(V, H).numpy())
    w.add_tensor("blk.0.attn_norm.weight", torch.ones(H).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = CliRunner().invoke(main, ["inspect", str(bad)])
    assert r.exit_code == 1 and r.output.count("\n") == 1 and "kv_lora_rank" in r.output, r.output
    for change in ({"topk_method": "weird"}, {"mlp_bias": True}, {"kv_lora_rank": None}):
        cfg_dir = tmp_path / f"cfg{len(list(tmp_path.iterdir()))}"
        cfg_dir.mkdir()
        cfg = json.loads((folder / "config.json").read_text()) | change
        (cfg_dir / "config.json").write_text(json.dumps(cfg))
        (cfg_dir / "model.safetensors").symlink_to(folder / "model.safetensors")
        r = CliRunner().invoke(main, ["inspect", str(cfg_dir)])
        assert r.exit_code == 1 and r.output.count("\n") == 1, (change, r.output)


# ------------------------------------------------------------------------------------------- quantized

# GGUF -> the names in transformers' layer (written here from the two projects' conventions, not from moerun's
# table); attn_k_b and attn_v_b go back into kv_b_proj (join_kv_b)
_HF = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
       "attn_q.weight": "self_attn.q_proj.weight", "attn_q_a.weight": "self_attn.q_a_proj.weight",
       "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
       "attn_q_b.weight": "self_attn.q_b_proj.weight",
       "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
       "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
       "attn_output.weight": "self_attn.o_proj.weight",
       "ffn_gate_inp.weight": "mlp.gate.weight", "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
       "ffn_down_exps.weight": "mlp.experts.down_proj"}
_HF |= {f"ffn_{a}.weight": f"mlp.{a}_proj.weight" for a in ("gate", "up", "down")}
_HF |= {f"ffn_{a}_shexp.weight": f"mlp.shared_experts.{a}_proj.weight" for a in ("gate", "up", "down")}


def join_kv_b(prefix: str, parts: dict) -> dict:
    """kv_b_proj [heads * (nope + v), rank] from llama.cpp's attn_k_b [heads, rank, nope] and attn_v_b
    [heads, v, rank]: each head's key rows, then its value rows."""
    k_b, v_b = parts["attn_k_b.weight"], parts["attn_v_b.weight"]
    return {prefix + "self_attn.kv_b_proj.weight": torch.cat((k_b.transpose(1, 2), v_b), 1).flatten(0, 1)}


@pytest.fixture(scope="module", params=["v2", "v3"])
def wide(request, tmp_path_factory):
    """DeepSeek models with 256-wide rows (the K-quants' block) where the kernels multiply, and their HF
    folders."""
    config = ds_config(request.param == "v3", hidden=256, nope=64, rope=32, dv=64, rank=256, q_rank=256,
                       moe_ffn=256, dense_ffn=512, shared=1)
    model = build_ds(config, seed=1)
    return model, config, save(model, tmp_path_factory.mktemp(f"ds-wide-{request.param}"))


@pytest.mark.parametrize("ftype,fp32_bound", [("Q8_0", 0.3), ("Q4_K", 1.0)])
def test_quantized_conversion_runs_through_the_c_kernels(wide, tokens, tmp_path, ftype, fp32_bound):
    """Q8_0 and Q4_K GGUFs: the torch reference path equals transformers on the gguf.quants-dequantized
    weights (1e-4); the C kernels (experts, shared experts, dense FFN, the q / q_a / q_b / kv_a / output
    projections, the head; attn_k_b and attn_v_b are held as floats and multiplied per head in torch: a
    whole prompt takes the layer loop) are close to that oracle and to the float model.
    Measured relative logit error of the kernel path (`pytest tests/test_deepseek2.py -k quantized -s`, 3
    layers, hidden 256, rank 256): V2 Q8_0 4.8% against the oracle (2-4% per position; 12-19% at two positions
    where a near-tie in the router flips an expert) and 6.1% against fp32; V2 Q4_K 8.7% / 48% (the oracle
    itself 48% off fp32: Q4_K's own error, ~7% per weight); V3 Q8_0 9.8% (one position at 50%, a flip, where
    the oracle is 48% off fp32) / 6.5%; V3 Q4_K 17% (three flipped positions at 42-61%) / 79% (the oracle
    79%). The bounds are loose so a broken path still fails (random logits are ~140% off)."""
    model, config, folder = wide
    path = convert_hf_to_gguf(folder, tmp_path / "q.gguf", ftype=ftype, progress=False)
    with open_model(path) as mf:
        assert mf.records["blk.1.ffn_gate_exps.weight"].qtype == QType[ftype]
        assert mf.records["blk.0.ffn_gate.weight"].qtype == QType[ftype]
        assert mf.records["blk.1.attn_kv_a_mqa.weight"].qtype == QType[ftype]
        assert mf.records["blk.1.attn_v_b.weight"].qtype == QType[ftype]
    oracle = dequantized_reference(path, config, _HF, join_kv_b)
    calls, e_oracle, e_fp32 = kernel_path_errors(path, oracle, model, tokens)
    q = 2 if config.q_lora_rank else 1
    # per layer q (or q_a, q_b), kv_a, o and the FFN's three; the head in its own kernel (fused.head_logits)
    assert calls["experts"] == 2 and calls["matmul"] == 3 * (q + 2 + 3), calls
    print(f"{ftype} q_lora {config.q_lora_rank}: kernel path relative error {e_oracle:.4f} against the "
          f"oracle, {e_fp32:.4f} against fp32")
    assert e_oracle < 0.3 and e_fp32 < fp32_bound


# ------------------------------------------------------------------------------------------ inspect


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_inspect_counts_equal_an_independent_count(ds, source):
    _, model, folder, path = ds
    d = check_inspect_counts(folder if source == "hf" else path, model)
    assert d["family"] == "deepseek2" and d["layers"] == 3 and d["moe_layers"] == 2 and d["dense_ffn"] == 96


# ---------------------------------------------------------------- cache, stages, stand-in, server, estimate


@pytest.fixture(scope="module")
def preset_gguf(tmp_path_factory):
    """make-model's tiny-deepseek3 (q latent, dense layer, 2 shared experts, 4 groups), Q8_0, 4 layers."""
    from moerun.tools.make_model import make_model
    from moerun.tools.presets import preset

    spec = preset("tiny-deepseek3", layers=4)
    assert spec.moe_layers == (False, True, True, True) and spec.q_lora_rank and spec.fused_decode
    return str(make_model(spec, tmp_path_factory.mktemp("ds-preset") / "tiny-deepseek3.gguf", ftype="Q8_0",
                          progress=False, threads=1))


@pytest.fixture(scope="module")
def wide_q4km(tmp_path_factory):
    """tiny-deepseek2 in Q4_K_M at 256-wide rows: experts the kernels read interleaved (repack), as the
    cache's slots hold them."""
    from moerun.tools.make_model import make_model
    from moerun.tools.presets import preset

    spec = preset("tiny-deepseek2", hidden=256, expert_ffn=256, shared_ffn=512, dense_ffn=256, experts=16,
                  experts_used=4, kv_lora_rank=256, qk_nope_dim=64, qk_rope_dim=32, v_head_dim=64,
                  head_dim=96)
    return str(make_model(spec, tmp_path_factory.mktemp("ds-q4km") / "q4km.gguf", ftype="Q4_K_M",
                          progress=False, threads=1))


@pytest.mark.parametrize("which", ["v3-q8_0", "v2-q4_k_m"])
def test_expert_cache_never_changes_the_output(preset_gguf, wide_q4km, which):
    check_expert_cache(preset_gguf if which == "v3-q8_0" else wide_q4km)


@pytest.mark.parametrize("check", [check_speculative, check_kv_types], ids=["drafts", "kv_types"])
@pytest.mark.parametrize("which", ["v3-q8_0", "v2-q4_k_m"])
def test_drafts_and_kv_types_keep_the_output(preset_gguf, wide_q4km, which, check):
    check(preset_gguf if which == "v3-q8_0" else wide_q4km)


@pytest.mark.parametrize("split", [(1.0, 1.0), (1.0, 3.0)])
def test_two_cpu_stages_give_the_same_tokens(preset_gguf, split):
    check_two_cpu_stages(preset_gguf, split)


def test_standin_device_gives_the_same_tokens(preset_gguf, ds, tokens):
    check_standin_miss_paths(preset_gguf)
    _, model, folder, _ = ds
    check_standin_hf_logits(folder, model, tokens)


@pytest.mark.slow
def test_triton_kernels_on_the_standin(preset_gguf, tokens, monkeypatch):
    check_triton_standin(preset_gguf, tokens, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [2, None], ids=["2-slots", "all-in-vram"])
def test_gpu_logits(ds, preset_gguf, tokens, slots):
    """On cuda:0 (skipped without CUDA): family_checks.check_gpu_logits."""
    _, model, folder, _ = ds
    check_gpu_logits(folder, model, preset_gguf, tokens, slots)


def test_server_completion(preset_gguf, tmp_path):
    """One /v1/completions request through the openai client on the tiny DeepSeek GGUF: the engine's greedy
    text."""
    check_server_completion(preset_gguf, tmp_path)


def test_estimate_bytes_per_token(preset_gguf, tmp_path, monkeypatch):
    """Weight bytes per token from gguf's reader (the dense layer and shared experts whole, k/E of the routed
    experts, one embedding row) and KV bytes per token of context: the latent (4 layers x (32 + 8) floats)."""
    d = check_estimate(preset_gguf, "deepseek2", tmp_path, monkeypatch)
    assert d["plan"]["kv_bytes_per_token"] == 4 * 40 * 4  # float32 latents, as the pool holds them
