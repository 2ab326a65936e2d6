"""Every family on the fused C decode path (moerun.kernels.layer): make-model's tiny shape of each, quantized, goes
from token ids to logits in one C call per step, and gives what the torch layer loop over the same kernels gives,
bit for bit (the loop's norms, RoPE, gates, attention and routing of decode-sized steps in the C layers'
arithmetic, moerun.kernels.rows): for one sequence, a multi-row step, and a batch of sequences.

The oracle is the layer loop (MoEModel.run_layers with `fused` off), which the family tests tie to transformers;
tests/test_loop_rows.py ties each C piece to its torch form."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from fused_vs_loop import layer_by_layer

from moerun.engine.kv_cache import KVPool, SeqKV
from moerun.loading import load_model
from moerun.tools.make_model import make_model
from moerun.tools.presets import preset

cpu = pytest.importorskip("moerun.kernels.cpu")
pytestmark = pytest.mark.skipif(not cpu.available(), reason="CPU kernels not built")

# each family's tiny shape, with what it brings to the fused layers
FAMILIES = {
    "tiny-qwen3moe": "q/k norms per head",
    "tiny-qwen2moe": "shared expert with its sigmoid gate, q/k/v biases",
    "tiny-mixtral": "plain",
    "tiny-olmoe": "q/k norms over the whole projection",
    "tiny-glm4moe": "dense leading layer, shared experts, sigmoid routing with groups and scale, partial rotary",
    "tiny-gptoss": "sinks, windows, biases, top-k-softmax routing, clamped SwiGLU",
    "tiny-qwen3next": "gated DeltaNet, gated attention, partial rotary, shared expert",
    "tiny-qwen35moe": "gated DeltaNet (separate beta / alpha), gated attention, shared expert",
    "tiny-deepseek2": "multi-head latent attention absorbed over the latent cache, dense leading layer, shared experts",
    "tiny-deepseek3": "MLA with q's low-rank pair, sigmoid routing with groups and correction bias, yarn",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(name: str, ftype: str = "Q8_0", **overrides):
        key = (name, ftype, *sorted(overrides.items()))
        if key not in cache:
            spec = preset(name, layers=max(4, preset(name).n_layers), **overrides)
            path = make_model(spec, tmp_path_factory.mktemp(name) / f"{ftype}.gguf", ftype=ftype, progress=False,
                              threads=1)
            cache[key] = load_model(path).model
        return cache[key]

    return get


def close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Logits per step within float noise of each other, allowing the rare step where a 1e-7 difference moves one
    activation across an 8-bit rounding boundary before a quantized product, or flips a near tie between two
    experts (then that step and the cache after it differ by up to ~1e-2, as tests/test_fused_decode.py allows);
    bench/fused_vs_loop.layer_by_layer checks the arithmetic itself to 1e-5."""
    per_step = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert per_step.max().item() < 0.05, f"{what}: {per_step.tolist()}"


def steps(model, tokens, fused: bool):
    """Prefill 9 (the layer loop), a 4-row step of one sequence, then six 1-token steps -> logits [11, V] and the
    greedy tokens of 6 more steps."""
    saved = model.fused
    model.fused = saved if fused else None
    try:
        kv = SeqKV(KVPool(model.spec, 64), 64)
        out = [model.forward(tokens[:9], kv, last_only=True), model.forward(tokens[9:13], kv)]
        out += [model.forward(t.view(1), kv) for t in tokens[13:19]]
        greedy, t = [], int(out[-1][-1].argmax())
        for _ in range(6):
            greedy.append(t)
            t = int(model.forward(torch.tensor([t]), kv)[-1].argmax())
        return torch.cat(out), greedy
    finally:
        model.fused = saved


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_layer_is_whole_and_equals_the_layer_loop(models, tokens32, name):
    model = models(name)
    f = model.fused
    assert f is not None and f.whole_model and f.embd is not None, f"{name}: {FAMILIES[name]} not on the fused path"
    flips = [layer_by_layer(model, T)[1:] for T in (1, 5)]  # each layer within 1e-5 of the loop's
    assert sum(a + b for a, b in flips) <= 1, flips
    fused_logits, fused_greedy = steps(model, tokens32, True)
    loop_logits, loop_greedy = steps(model, tokens32, False)
    assert fused_greedy == loop_greedy
    assert torch.equal(fused_logits, loop_logits), f"{name}: {(fused_logits - loop_logits).abs().max().item()}"


@pytest.mark.parametrize("name", ["tiny-glm4moe", "tiny-qwen35moe", "tiny-gptoss", "tiny-deepseek3"])
def test_batched_decode_equals_each_sequence_alone(models, name):
    """Three sequences of different lengths in one pool, decoded together in one C call per step."""
    model = models(name)
    g = torch.Generator().manual_seed(3)
    V = model.spec.vocab
    prompts = [torch.randint(0, V, (n,), generator=g) for n in (5, 19, 11)]
    nxt = torch.randint(0, V, (4, 3), generator=g)
    alone = []
    for b, prompt in enumerate(prompts):
        kv = SeqKV(KVPool(model.spec, 64), 64)
        model.forward(prompt, kv)
        alone.append(torch.cat([model.forward(nxt[s, b].view(1), kv) for s in range(4)]))
    pool = KVPool(model.spec, 192, seqs=3)
    kvs = [SeqKV(pool, 64) for _ in prompts]
    for kv, prompt in zip(kvs, prompts):
        model.forward(prompt, kv)
    assert model._from_ids(kvs)
    together = torch.stack([model.decode(nxt[s], kvs) for s in range(4)], dim=1)  # [B, steps, V]
    for b in range(3):
        assert torch.equal(together[b], alone[b]), f"{name} sequence {b}"  # batch-invariant, bit for bit


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_mla_reads_its_latent_cache_in_each_type(models, tokens32, kv_type):
    """MLA's latent cache in halves or Q8_0 blocks: the C path stores the bytes the loop stores and reads them as the
    loop does (greedy equal, logits within the noise of test_every_layer). The latent in whole Q8_0 blocks: rank
    64 and 32 rotated dimensions (V2-Lite's are 512 and 64)."""
    nope = preset("tiny-deepseek2").qk_nope_dim
    model = models("tiny-deepseek2", kv_lora_rank=64, qk_rope_dim=32, head_dim=nope + 32)
    outs = []
    for fused in (True, False):
        saved = model.fused
        model.fused = saved if fused else None
        try:
            kv = SeqKV(KVPool(model.spec, 64, kv_types=(kv_type, kv_type)), 64)
            assert not fused or model.fused.reads(kv.pool)
            out = [model.forward(tokens32[:7], kv, last_only=True)] + [model.forward(t.view(1), kv)
                                                                       for t in tokens32[7:15]]
            outs.append((torch.cat(out), kv.pool.layer(1)[0].clone()))
        finally:
            model.fused = saved
    (fl, fc), (ll, lc) = outs
    assert torch.equal(fl.argmax(-1), ll.argmax(-1))
    close(fl, ll, f"MLA with a {kv_type} latent cache")
    assert fc.dtype == lc.dtype and (fc.float() - lc.float()).abs().max() < 0.05  # the same encoding of near values


def test_q4_k_m_hybrid_equals_the_layer_loop(models, tokens32):
    """Qwen3.5's shape in Q4_K_M (the interleaved expert layouts, Q6_K and Q4_K matrices in the DeltaNet layers)."""
    model = models("tiny-qwen35moe", "Q4_K_M")
    assert model.fused.whole_model and sum(layer_by_layer(model, 3)[1:]) <= 1
    fused_logits, fused_greedy = steps(model, tokens32, True)
    loop_logits, loop_greedy = steps(model, tokens32, False)
    assert fused_greedy == loop_greedy
    assert torch.equal(fused_logits, loop_logits), (fused_logits - loop_logits).abs().max().item()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_threads_start_where_the_job_before_said_and_no_bit_moves(models, tokens32, name):
    """A thread done with its share of a pool job prefetches where its share of the next one starts (pool.h's
    qk_pool_run_then): the next layer's first product, the output projection after attention, the experts' down rows
    after their gate and up, the shared expert's down, the head, and the next step's first layer after the head
    (a step of as many rows as this one). Traced over one-token steps, the first item of every thread's share reads
    where the job before said it would; and the logits are the same bit for bit with the prefetch off."""
    model = models(name)
    was = cpu.get_threads()
    try:
        cpu.set_threads(2)
        cpu.set_idle_prefetch(0)
        off = steps(model, tokens32, True)
        cpu.set_idle_prefetch(1 << 20)
        on = steps(model, tokens32, True)
        kv = SeqKV(KVPool(model.spec, 64), 64)
        model.forward(tokens32[:9], kv)
        model.forward(tokens32[9:10], kv)
        cpu._cpu.pool_trace(True)
        for t in tokens32[10:16]:
            model.forward(t.view(1), kv)
        matched, missed = cpu._cpu.pool_span_checks()
    finally:
        cpu._cpu.pool_trace(False)
        cpu.set_idle_prefetch()
        cpu.set_threads(was)
    assert torch.equal(on[0], off[0]) and on[1] == off[1]
    assert missed == 0 and matched >= 6 * model.spec.n_layers, (matched, missed)
