"""Qwen3-Next (qwen3next) and Qwen3.5-MoE (qwen35moe), issue 17: tiny random transformers models with three
gated-DeltaNet layers and one gated attention layer are the reference: logits and greedy generation from the HF
folder and from our GGUF conversion (prompts prefilled in chunks of 5, inside the conv window), cached decode
against a full recompute, several sequences decoded together, the recurrent state's checkpoints and prefix reuse
(engine and scheduler), stages split at a linear layer, the expert cache, a real server, llama.cpp's names and
keys, the multimodal Qwen3.5 checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from family_checks import (
    check_expert_cache,
    check_greedy_generate,
    check_kv_types,
    check_server_completion,
    check_speculative,
    gguf_fields,
    names_outside_llama_cpp,
    prompt_and_steps,
    rel_err,
    run,
)
from hf_models import build, reference_logits, save

from moerun.arch import resolve
from moerun.config import RuntimeConfig, SamplingParams
from moerun.engine.engine import Engine
from moerun.engine.kv_cache import ContextOverflowError, KVPool, SeqKV
from moerun.engine.scheduler import Request, Scheduler
from moerun.formats import open_model
from moerun.loading import load_model
from moerun.runtime import build as build_runtime
from moerun.text import Tokenizer
from moerun.tools.convert import convert_hf_to_gguf

FAMILIES = ("qwen3next", "qwen35moe")
PROMPT = [5, 17, 300, 42, 99, 7, 256, 11, 3, 4, 9]
# layer_types: 3 linear, then full attention
TEXT_CONFIG = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8,
               "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 8,
               "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
               "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def hf_config(family: str):
    import transformers as tf

    cls = tf.Qwen3NextConfig if family == "qwen3next" else tf.Qwen3_5MoeTextConfig
    return cls(**TEXT_CONFIG)


def perturb(model, seed: int = 0):
    """hf_models.build's perturbation, the zero-centred norms (stored as w - 1) kept near 1 as trained ones are,
    and decays large enough that the state forgets within a prompt."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name:
                p.sub_(1.0)
            elif name.endswith("A_log"):
                p.copy_(torch.linspace(-1.0, 1.5, p.numel()))
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def hybrid(request, tmp_path_factory):
    """(family, transformers model, its save_pretrained folder, our F32 GGUF conversion)."""
    fam = request.param
    model = perturb(build(fam, config=hf_config(fam)))
    folder = save(model, tmp_path_factory.mktemp(f"{fam}-hf"))
    path = convert_hf_to_gguf(folder, tmp_path_factory.mktemp(f"{fam}-gguf") / f"{fam}.gguf", progress=False)
    return fam, model, folder, str(path)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 512, (48,), generator=torch.Generator().manual_seed(1234))


# ------------------------------------------------------------------------------------------------ parity


def test_the_tiny_model_is_hybrid(hybrid):
    fam, _, folder, path = hybrid
    for src in (folder, path):
        with open_model(src) as mf:
            spec = resolve(mf).spec
        assert spec.family == fam and spec.layer_kinds == ("linear", "linear", "linear", "full")
        assert spec.attn_gate and spec.ssm_v_heads == 2 * spec.ssm_k_heads  # value heads shared: the order matters
        assert spec.ssm_v_order == ("grouped" if fam == "qwen3next" else "tiled")


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_logits_match_transformers(hybrid, tokens, source):
    """48 tokens in one forward pass: transformers' logits within 1e-4 (fp32)."""
    _, model, folder, path = hybrid
    m = load_model(str(folder) if source == "hf" else path).model
    err = (m.forward(tokens) - reference_logits(model, tokens)).abs().max().item()
    assert err < 1e-4, f"max abs error {err:.2e}"


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_generate_in_chunks_of_5(hybrid, source):
    """32 greedy tokens equal generate(do_sample=False); the 11-token prompt goes in chunks of 5 (each boundary
    inside the conv1d's 3-position window) and its last token alone (the checkpoint)."""
    _, model, folder, path = hybrid
    check_greedy_generate(model, str(folder) if source == "hf" else path, PROMPT, ubatch=5)


def test_cached_decode_equals_full_recompute(hybrid, tokens):
    """A prefill in two chunks and four single-token steps through the state equal one pass without a cache."""
    _, _, _, path = hybrid
    m = load_model(path).model
    got = prompt_and_steps(m, SeqKV(KVPool(m.spec, 64), 64), tokens[:28])
    full = m.forward(torch.cat((tokens[:28], tokens[:4])))
    assert (got - full).abs().max().item() < 5e-5  # the chunked form and the step differ in rounding only


def test_sequences_decoded_together_equal_each_alone(hybrid):
    """Three sequences of different lengths decoded in one batch (states gathered from their slots) give each
    one's logits alone."""
    _, _, _, path = hybrid
    m = load_model(path).model
    prompts = [PROMPT, PROMPT[:4], PROMPT[3:]]
    alone = []
    for p in prompts:
        kv = SeqKV(KVPool(m.spec, 64), 64)
        m.forward(torch.tensor(p), kv)
        alone.append(torch.cat([m.forward(torch.tensor([t]), kv) for t in (7, 8, 9)]))
    pool = KVPool(m.spec, 3 * 64, seqs=3)
    kvs = [SeqKV(pool, 64) for _ in prompts]
    for p, kv in zip(prompts, kvs):
        m.forward(torch.tensor(p), kv)
    together = torch.stack([m.decode(torch.tensor([t] * 3), kvs) for t in (7, 8, 9)], dim=1)  # [3 seqs, 3, V]
    for r in range(3):  # a batch's products round differently from one row's, and the state carries it on
        assert (together[r] - alone[r]).abs().max().item() < 1e-4
        assert torch.equal(together[r].argmax(-1), alone[r].argmax(-1))


# ------------------------------------------------------------------------------------------ the state


def test_checkpoints_and_truncate(hybrid):
    """truncate() goes back to the latest checkpoint at or before the length asked for, restoring its state
    (the logits after it equal a cold run's), or to 0; the pool's state slots come back on free()."""
    _, _, _, path = hybrid
    m = load_model(path).model
    toks = torch.tensor(PROMPT * 2)
    pool = KVPool(m.spec, 2 * 64, seqs=2, checkpoints=1)
    kv = SeqKV(pool, 64)
    m.forward(toks[:10], kv)
    kv.checkpoint()
    m.forward(toks[10:], kv)
    assert kv.checkpoint_lengths == [10]
    kv.truncate(15)
    assert kv.length == 10
    again = m.forward(toks[10:14], kv)
    cold = m.forward(toks[:14])[10:]
    assert (again - cold).abs().max().item() < 1e-5
    kv.truncate(9)
    assert kv.length == 0 and kv.checkpoint_lengths == []
    other = SeqKV(pool, 64)
    other.reserve(1)
    with pytest.raises(ContextOverflowError, match="linear-attention layers hold 2"):
        SeqKV(pool, 64).reserve(1)
    kv.free()
    SeqKV(pool, 64).reserve(1)  # the freed slot group is handed out again


def test_prefix_reuse_keeps_the_prompt_state(hybrid):
    """The engine keeps the state before a prompt's last token: the same prompt again runs one token, a longer
    prompt sharing it runs only the rest, and both give a cold engine's tokens."""
    _, _, _, path = hybrid
    loaded = load_model(path)
    tok = Tokenizer.from_model_file(loaded.file)
    eng = Engine(loaded.model, tok, ctx_size=128, ubatch=4)
    params = SamplingParams.greedy(max_tokens=8, ignore_eos=True)
    seq = eng.new_sequence()
    first = eng.generate(PROMPT, params, seq).run()
    assert first.timings.cache_n == 0
    again = eng.generate(PROMPT, params, seq).run()
    assert again.timings.cache_n == len(PROMPT) - 1 and again.tokens == first.tokens
    longer = PROMPT + [1, 2, 3]
    more = eng.generate(longer, params, seq).run()
    assert more.timings.cache_n == len(PROMPT) - 1
    cold = Engine(loaded.model, tok, ctx_size=128, ubatch=4).generate(longer, params).run()
    assert more.tokens == cold.tokens


def test_scheduler_reuses_the_snapshot_and_frees_on_cancel(hybrid):
    """Through the server's scheduler: a second request sharing the first's prompt reuses its checkpoint
    (cache_n > 0) with a cold run's tokens; a cancelled request gives back its KV blocks and state slot."""
    _, _, _, path = hybrid
    loaded = load_model(path)
    tok = Tokenizer.from_model_file(loaded.file)
    params = SamplingParams.greedy(max_tokens=6, ignore_eos=True)

    def serve(*prompts: list[int]) -> tuple[Scheduler, list[Request]]:
        sched = Scheduler(Engine(loaded.model, tok, ctx_size=64, ubatch=4), parallel=1)
        reqs = []
        for p in prompts:
            reqs.append(Request(p, params))
            sched.submit(reqs[-1])
            while sched.has_work():
                sched.step()
        return sched, reqs

    _, (a, b) = serve(PROMPT, PROMPT + [1, 2])
    _, (cold,) = serve(PROMPT + [1, 2])
    assert b.timings.cache_n == len(PROMPT) - 1 and b.tokens == cold.tokens and a.finish_reason == "length"
    sched, _ = serve(PROMPT)
    pool = sched.engine.pool
    req = Request(PROMPT + [3], params)
    sched.submit(req)
    sched.step()
    req.cancel()
    sched.step()
    assert req.finish_reason == "cancelled"
    assert pool.allocator.n_free == pool.allocator.n_blocks and len(pool._free_states) == 1


def test_two_stages_split_at_a_linear_layer(hybrid):
    """Stages [0, 2) and [2, 4): the second starts with a linear layer; tokens and logits of one stage."""
    _, _, _, path = hybrid
    ref = run(path)
    rt = build_runtime(RuntimeConfig(model=path, devices=("cpu", "cpu"), tensor_split=(0.5, 0.5), threads=1))
    first = rt.stages[1].layers[0]
    assert rt.stages[0].model.spec.linear(first) and first == 2
    rt.close()
    got = run(path, devices=("cpu", "cpu"), tensor_split=(0.5, 0.5), expert_cache_slots=3)
    assert got[3] == 2 and got[0] == ref[0] and (got[1] - ref[1]).abs().max().item() < 1e-4


def test_expert_cache_does_not_change_the_output(hybrid):
    check_expert_cache(hybrid[3])


def test_kv_cache_types(hybrid):
    check_kv_types(hybrid[3])


def test_drafts_keep_the_output(hybrid):
    """Speculative decoding over recurrent layers: a rejected draft sends the state back to its checkpoint."""
    check_speculative(hybrid[3])


def test_server_completion(hybrid, tmp_path):
    check_server_completion(hybrid[3], tmp_path)


# ----------------------------------------------------------------------------------------- the files


def test_gguf_has_llama_cpp_names_and_keys(hybrid):
    import gguf

    fam, model, _, path = hybrid
    arch = {"qwen3next": gguf.MODEL_ARCH.QWEN3NEXT, "qwen35moe": gguf.MODEL_ARCH.QWEN35MOE}[fam]
    assert names_outside_llama_cpp(path, arch) == []
    keys = gguf_fields(path, fam)
    cfg = model.config
    assert (keys["ssm.conv_kernel"], keys["ssm.state_size"], keys["ssm.group_count"], keys["ssm.time_step_rank"],
            keys["ssm.inner_size"], keys["full_attention_interval"], keys["rope.dimension_count"]) == (
        cfg.linear_conv_kernel_dim, cfg.linear_key_head_dim, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
        cfg.linear_value_head_dim * cfg.linear_num_value_heads, 4, int(cfg.head_dim * 0.25))
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert ("blk.0.ssm_ba.weight" in names) == (fam == "qwen3next")
    assert "blk.0.ssm_a" in names and "blk.3.attn_q.weight" in names and "blk.0.post_attention_norm.weight" in names


def test_gguf_values_are_llama_cpps(hybrid):
    """The stored values llama.cpp's converter writes: norms + 1, ssm_a = -exp(A_log), and for Qwen3.5 the value
    heads reordered from grouped to tiled (its _reorder_v_heads: [nk, r, d] -> [r, nk, d])."""
    import gguf

    fam, model, _, path = hybrid
    t = {x.name: torch.from_numpy(x.data.copy()) for x in gguf.GGUFReader(path).tensors}
    la, cfg = model.model.layers[0].linear_attn, model.config
    assert torch.equal(t["blk.0.attn_norm.weight"], model.model.layers[0].input_layernorm.weight.detach() + 1)
    a_log = la.A_log.detach()
    if fam == "qwen35moe":
        nk, r = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads

        def tile(w, d):
            return w.reshape(nk, r, d, *w.shape[1:]).transpose(0, 1).reshape(w.shape)

        a_log = tile(a_log, 1)
        assert torch.equal(t["blk.0.attn_gate.weight"], tile(la.in_proj_z.weight.detach(), cfg.linear_value_head_dim))
    assert torch.allclose(t["blk.0.ssm_a"], -a_log.exp())


def test_multimodal_qwen35_checkpoint(tmp_path, tokens):
    """Qwen3_5MoeForConditionalGeneration's folder (text_config, model.language_model.*, a vision tower): its
    language model's logits, and a note that the tower is skipped."""
    import transformers as tf

    cfg = tf.Qwen3_5MoeConfig(text_config=TEXT_CONFIG, vision_config={
        "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
        "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 16})
    torch.manual_seed(0)
    model = perturb(tf.Qwen3_5MoeForConditionalGeneration(cfg).eval())
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    with open_model(tmp_path) as mf:
        arch = resolve(mf)
    assert arch.spec.family == "qwen35moe" and any("vision tower" in n for n in arch.notes)
    with torch.no_grad():
        ref = model(input_ids=tokens[None]).logits[0]
    got = load_model(str(tmp_path)).model.forward(tokens)
    assert (got - ref).abs().max().item() < 1e-4


def test_standin_device(hybrid, tokens):
    """The GPU code path on the CPU stand-in device (dense weights and states placed there, 2 expert slots):
    transformers' logits, in one pass and as a prompt then steps."""
    from family_checks import check_standin_hf_logits

    _, model, folder, _ = hybrid
    check_standin_hf_logits(folder, model, tokens)
    ref = torch.cat([reference_logits(model, tokens[:28]), reference_logits(model, torch.cat((tokens[:28],
                                                                                               tokens[:4])))[28:]])
    rt = build_runtime(RuntimeConfig(model=str(folder), devices=("standin:0",), expert_cache_slots=2, threads=1))
    got = prompt_and_steps(rt.engine.model, rt.engine.new_sequence().kv, tokens[:28])
    assert (got - ref).abs().max().item() < 1e-4
    rt.close()


def test_decode_in_c_and_in_torch_agree(hybrid, tokens, tmp_path):
    """Q8_0 (a type the expert kernels take): the whole step in one C call (moerun.kernels.layer: gated attention,
    partial rotary, DeltaNet, shared experts with their gate) and the torch layer loop over the same kernels give
    the same greedy tokens and logits within float noise (measured 3e-7). F32: the C layers' mixers with torch's
    experts, and the torch forms alone (kernels off), give the same greedy tokens."""
    fam, _, folder, f32 = hybrid
    q8 = convert_hf_to_gguf(folder, tmp_path / f"{fam}-q8.gguf", ftype="Q8_0", progress=False)
    params = SamplingParams.greedy(max_tokens=16, ignore_eos=True)
    runs = {}
    for name, path, kernels, fused in (("fused", q8, True, True), ("loop", q8, True, False),
                                       ("f32-kernels", f32, True, True), ("f32-torch", f32, False, False)):
        loaded = load_model(path, kernels=kernels)
        model = loaded.model
        if name == "fused":
            assert model.fused is not None and model.fused.whole_model and model.fused.embd is not None
        elif not fused:
            model.fused = None
        eng = Engine(model, Tokenizer.from_model_file(loaded.file), ctx_size=128, ubatch=4)
        kv = SeqKV(KVPool(model.spec, 64), 64)
        logits = [model.forward(tokens[:9], kv, last_only=True)] + [model.forward(t.view(1), kv) for t in tokens[9:15]]
        runs[name] = (eng.generate(PROMPT, params).run().tokens, torch.cat(logits))
    assert runs["fused"][0] == runs["loop"][0] and runs["f32-kernels"][0] == runs["f32-torch"][0]
    err = rel_err(runs["fused"][1], runs["loop"][1])
    assert err < 1e-5, f"fused vs the layer loop: {err:.2e}"


@pytest.mark.parametrize("change, phrase", [
    (lambda k, v: None if k.endswith("ssm.conv_kernel") else v, "'ssm.conv_kernel' must be an integer"),
    (lambda k, v: 3 if k.endswith("ssm.group_count") else v, "a multiple of the key heads"),
    (lambda k, v: 7 if k.endswith("ssm.inner_size") else v, "not a multiple of 'ssm.time_step_rank'"),
])
def test_bad_linear_attention_keys_are_one_line(hybrid, tmp_path, change, phrase):
    """A GGUF whose linear-attention keys are missing or inconsistent: one ModelFormatError naming the file."""
    from family_checks import rewrite_gguf

    from moerun.errors import ModelFormatError

    bad = tmp_path / "bad.gguf"
    rewrite_gguf(hybrid[3], bad, key=change)
    with pytest.raises(ModelFormatError, match=phrase) as info, open_model(bad) as mf:
        resolve(mf)
    assert "\n" not in str(info.value) and str(bad) in str(info.value)


def test_missing_linear_tensor_and_bad_layer_types(hybrid, tmp_path):
    """A linear layer's tensor missing from the GGUF, and config.json layer_types of another length: one line
    each."""
    import shutil

    from family_checks import rewrite_gguf

    from moerun.errors import ModelFormatError

    _, _, folder, path = hybrid
    bad = tmp_path / "bad.gguf"
    rewrite_gguf(path, bad, tensor=lambda name, d: [] if name == "blk.1.ssm_a" else [(name, d)])
    with pytest.raises(ModelFormatError, match="missing tensor 'blk.1.ssm_a'"), open_model(bad) as mf:
        resolve(mf)
    hf = tmp_path / "hf"
    shutil.copytree(folder, hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["layer_types"] = cfg["layer_types"][:3]
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match="'layer_types' must give one of"), open_model(hf) as mf:
        resolve(mf)


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [2, None], ids=["2-slots", "all-in-vram"])
def test_gpu_logits(hybrid, tokens, slots):
    """On cuda:0 (skipped without CUDA; bench/gpu_check.sh runs it): family_checks.check_gpu_logits, the linear
    layers' states in VRAM."""
    from family_checks import check_gpu_logits

    pytest.importorskip("transformers")
    _, model, folder, path = hybrid
    check_gpu_logits(folder, model, path, tokens[:28], slots)


def test_slot_file_carries_the_recurrent_state(hybrid, tmp_path):
    """A sequence saved to a slot file (moerun.engine.slotfile) and restored into another pool continues with the
    original's logits: the attention layers' KV and the linear layers' states both come back."""
    from moerun.engine import slotfile
    from moerun.engine.engine import Sequence

    m = load_model(hybrid[3]).model
    a = Sequence(SeqKV(KVPool(m.spec, 64), 64))
    m.forward(torch.tensor(PROMPT), a.kv)
    a.tokens = list(PROMPT)
    n, nbytes = slotfile.save(a, tmp_path / "s.bin")
    assert n == len(PROMPT) and nbytes > 0
    b = Sequence(SeqKV(KVPool(m.spec, 2 * 64, seqs=2), 64))
    b.kv.reserve(3)  # holds something already: restore replaces it
    assert slotfile.restore(b, tmp_path / "s.bin", 64)[0] == n and b.tokens == PROMPT
    steps = [torch.cat([m.forward(torch.tensor([t]), s.kv) for t in (7, 8, 9)]) for s in (a, b)]
    assert torch.equal(steps[0], steps[1])
