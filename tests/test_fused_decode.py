"""The fused decode path (moerun/kernels/csrc/attn.c through moerun/model/fused.py), batched decode
(MoEModel.decode) and the embedding row lookup (moerun/kernels/csrc/dequant.c).

Oracles: a plain-torch attention layer written here, the model's own torch path (the reference the
parity tests tie to transformers), and gguf.quants for dequantized rows."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hf_models import FAMILIES

from moerun.engine.kv_cache import KVPool, SeqKV
from moerun.loading import load_model
from moerun.quant.qtypes import QTensor, QType, row_bytes
from moerun.tools.convert import convert_hf_to_gguf

cpu = pytest.importorskip("moerun.kernels.cpu")
kl = pytest.importorskip("moerun.kernels.layer")
pytestmark = pytest.mark.skipif(not cpu.available(), reason="CPU kernels not built")

ATTENTION_FIELDS = {"n_heads", "n_kv_heads", "head_dim", "qk_norm", "rope_style", "wq", "wk", "wv", "wo", "q_norm",
                    "k_norm", "bq", "bk", "bv", "bo", "sinks", "window", "rope_dim", "gate", "scale"}


def attn_layer(**fields) -> kl.Layer:
    """A Layer with attention from one flat set of fields (the attention's and the layer's)."""
    att = {k: fields.pop(k) for k in list(fields) if k in ATTENTION_FIELDS}
    return kl.Layer(attention=kl.Attention(**att), **fields)

DEQUANT_TYPES = ("Q4_0", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "IQ4_XS", "IQ4_NL", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


@pytest.mark.parametrize("qtype", DEQUANT_TYPES)
@pytest.mark.parametrize("many", [False, True], ids=["few", "pool"])
def test_dequant_rows_equals_gguf_quants(qtype, many):
    """Random bytes (every scale and code pattern, NaN and inf scales included), rows gathered in any order; more
    than 64 rows go over the thread pool."""
    g = torch.Generator().manual_seed(1)
    N, K = (300, 256) if many else (9, 512)
    raw = torch.randint(0, 256, (N, row_bytes(QType[qtype], K)), dtype=torch.uint8, generator=g)
    rows = torch.randint(0, N, (250,), generator=g) if many else torch.tensor([3, 0, 8, 3, 5])
    got = cpu.dequant_rows(QTensor(raw, QType[qtype], (N, K)), rows)
    with np.errstate(all="ignore"):
        ref = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), QType[qtype].value).astype(np.float32))[rows]
    assert torch.equal(got.isnan(), ref.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(ref))


@pytest.mark.parametrize("qtype", DEQUANT_TYPES)
def test_kernel_ops_floats_are_the_reference_values(qtype):
    """A weight used as floats (MLA's per-head matrices): the C dequantizer gives QTensor.dequantize's values, for a
    stack and for an interleaved one too."""
    from moerun.model.ops import KernelOps

    g = torch.Generator().manual_seed(2)
    raw = torch.randint(0, 256, (3, 8, row_bytes(QType[qtype], 512)), dtype=torch.uint8, generator=g)
    w = QTensor(raw, QType[qtype], (3, 8, 512))
    ref = w.dequantize(torch.float32)
    for t in (w, cpu.interleave(w)) if cpu.can_interleave(w) else (w,):
        got = KernelOps().floats(t)
        assert got.shape == ref.shape and torch.equal(got.isnan(), ref.isnan())
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(ref))


def test_dequant_rows_rejects_out_of_range_rows():
    w = QTensor(torch.zeros((4, row_bytes(QType.Q8_0, 64)), dtype=torch.uint8), QType.Q8_0, (4, 64))
    for rows in (torch.tensor([4]), torch.tensor([0] * 99 + [-1])):  # one row, and many (the pooled path)
        with pytest.raises(ValueError, match="out of range"):
            cpu.dequant_rows(w, rows)


# ------------------------------------------------------------------ the attention block kernel


def torch_block(p, x, tables, pos, kc, vc, cos, sin, eps, clip, stored=lambda t: t):
    """The same layer half in plain torch, row by row (GQA, per-head q/k norm, neox RoPE, bias, clamp); `stored`:
    what the cache keeps of a row written to it (a KV type's rounding)."""
    nh, nkv, D = p["n_heads"], p["n_kv_heads"], p["head_dim"]

    def rms(v, w):
        return w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps))

    def rope(v, c, s):  # [heads, D]
        a, b = v[:, : D // 2], v[:, D // 2:]
        return torch.cat((a * c - b * s, b * c + a * s), dim=-1)

    x = x.clone()
    xn = rms(x, p["attn_norm"])
    q, k, v = (torch.clamp(xn @ p[w].T + p[b], -clip, clip) for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
    att = []
    for r in range(len(x)):
        qr = rope(rms(q[r].view(nh, D), p["q_norm"]), cos[pos[r]], sin[pos[r]])
        kr = rope(rms(k[r].view(nkv, D), p["k_norm"]), cos[pos[r]], sin[pos[r]])
        kc[tables[r][pos[r]]], vc[tables[r][pos[r]]] = stored(kr), stored(v[r].view(nkv, D))
    for r in range(len(x)):
        qr = rope(rms(q[r].view(nh, D), p["q_norm"]), cos[pos[r]], sin[pos[r]])
        keys, vals = kc[tables[r][: pos[r] + 1]], vc[tables[r][: pos[r] + 1]]  # [n, nkv, D]
        keys, vals = (t.repeat_interleave(nh // nkv, dim=1).transpose(0, 1) for t in (keys, vals))
        att.append(torch.softmax(qr[:, None, :] @ keys.transpose(1, 2) / D**0.5, dim=-1) @ vals)
    x += torch.stack(att).reshape(len(x), -1) @ p["wo"].T
    xn2 = rms(x, p["ffn_norm"])
    probs = torch.softmax(xn2 @ p["router"].T, dim=-1)
    w, ids = torch.topk(probs, p["n_used"], dim=-1)
    return x, xn2, ids, w / w.sum(-1, keepdim=True)


def random_block(g, head_dim: int, H: int, nh: int, nkv: int, E: int, n_used: int):
    """A random F32 attention block: its weights as torch_block takes them, the kernel's Layer, and the
    drawing function (rnd(*shape, scale))."""
    def rnd(*shape, scale=0.3):
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    p = {"n_heads": nh, "n_kv_heads": nkv, "head_dim": head_dim, "n_used": n_used,
         "attn_norm": 1 + rnd(H), "ffn_norm": 1 + rnd(H), "q_norm": 1 + rnd(head_dim), "k_norm": 1 + rnd(head_dim),
         "wq": rnd(nh * head_dim, H), "wk": rnd(nkv * head_dim, H), "wv": rnd(nkv * head_dim, H),
         "bq": rnd(nh * head_dim), "bk": rnd(nkv * head_dim), "bv": rnd(nkv * head_dim),
         "wo": rnd(H, nh * head_dim, scale=0.1), "router": rnd(E, H)}
    layer = attn_layer(hidden=H, n_heads=nh, n_kv_heads=nkv, head_dim=head_dim, qk_norm="head", rope_style="neox",
                          attn_norm=p["attn_norm"], ffn_norm=p["ffn_norm"], wq=p["wq"], wk=p["wk"], wv=p["wv"],
                          wo=p["wo"], q_norm=p["q_norm"], k_norm=p["k_norm"], bq=p["bq"], bk=p["bk"], bv=p["bv"],
                          router=p["router"], n_used=n_used, norm_topk=True)
    return p, layer, rnd


@pytest.mark.parametrize("head_dim", [12, 64, 128])
def test_attn_block_matches_plain_torch(head_dim):
    """F32 weights (no activation rounding): every piece of the block, keys in scattered slots, two
    sequences of different lengths in one call, up to 70 positions (the vector and tail paths)."""
    g = torch.Generator().manual_seed(head_dim)
    H, nh, nkv = 64, 6, 2
    p, layer, rnd = random_block(g, head_dim, H, nh, nkv, E=8, n_used=3)
    slots = torch.randperm(200, generator=g)
    tables = [slots[:80].clone(), slots[80:160].clone()]
    pos = torch.tensor([69, 17])
    kc, vc = rnd(200, nkv, head_dim, scale=1.0), rnd(200, nkv, head_dim, scale=1.0)
    inv = 1.0 / (1e4 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    ang = torch.arange(100).float()[:, None] * inv
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    x = rnd(2, H, scale=1.0)
    want = torch_block(p, x, tables, pos, kc.clone(), vc.clone(), cos, sin, 1e-6, 1.5)
    for isa in cpu.features()["isas"]:
        xk, kk, vk = x.clone(), kc.clone(), vc.clone()
        xn, ids, w = kl.attn_block(layer, xk, kl.AttnRows(tables, pos, cos, sin), kk, vk, 1e-6, 1.5, isa=isa)
        assert (xk - want[0]).abs().max() < 2e-5, isa
        assert (xn - want[1]).abs().max() < 2e-5, isa
        assert torch.equal(ids, want[2]), isa
        assert (w - want[3]).abs().max() < 1e-5, isa


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
@pytest.mark.parametrize("head_dim", [32, 128])
def test_attn_block_reads_and_writes_f16_and_q8_0_caches(head_dim, kv):
    """The same block over a cache of halves or Q8_0 blocks (moerun.engine.kv_types): against the plain-torch
    block over the float values those hold, the new rows rounded as the type stores them; the rows the kernel
    wrote decode to the reference's rounded k and v."""
    from moerun.engine.kv_types import KV_TYPES

    t = KV_TYPES[kv]
    g = torch.Generator().manual_seed(7 + head_dim)
    H, nh, nkv = 64, 4, 2
    p, layer, rnd = random_block(g, head_dim, H, nh, nkv, E=8, n_used=2)

    def stored(v):  # [..., nkv, D] float -> what the type keeps, as floats
        shape = tuple(v.shape[-2:])
        flat = v.reshape(-1, *shape)
        return t.decode(t.encode(flat, t.storage(shape, torch.float32)[1]), shape, torch.float32).view(v.shape)

    slots = torch.randperm(120, generator=g)
    tables = [slots[:60].clone(), slots[60:].clone()]
    pos = torch.tensor([41, 9])
    kf, vf = stored(rnd(120, nkv, head_dim, scale=1.0)), stored(rnd(120, nkv, head_dim, scale=1.0))
    inv = 1.0 / (1e4 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    ang = torch.arange(64).float()[:, None] * inv
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    x = rnd(2, H, scale=1.0)
    kr, vr = kf.clone(), vf.clone()
    want = torch_block(p, x, tables, pos, kr, vr, cos, sin, 1e-6, 1.5, stored)
    shape, dt = t.storage((nkv, head_dim), torch.float32)
    for isa in cpu.features()["isas"]:
        xk = x.clone()
        kc, vc = (t.encode(c, dt).view(120, *shape).contiguous() for c in (kf, vf))
        xn, ids, _ = kl.attn_block(layer, xk, kl.AttnRows(tables, pos, cos, sin), kc, vc, 1e-6, 1.5, isa=isa)
        assert (xn - want[1]).abs().max() < 1e-4, isa
        assert (xk - want[0]).abs().max() < 1e-4, (isa, (xk - want[0]).abs().max())
        assert torch.equal(ids, want[2]), isa
        new = torch.stack([tables[r][pos[r]] for r in range(2)])
        for c, ref in ((kc, kr), (vc, vr)):
            got = t.decode(c[new], (nkv, head_dim), torch.float32)
            step = 2e-3 if kv == "f16" else ref[new].abs().amax() / 100  # one rounding step apart at most
            assert (got - ref[new]).abs().max() <= step, isa


def test_attn_rows_and_caches_are_checked():
    t = torch.arange(8)
    cos = sin = torch.zeros(16, 4)
    with pytest.raises(ValueError, match="slot tables"):
        kl.AttnRows([t], torch.tensor([8]), cos, sin)  # position beyond its table
    with pytest.raises(ValueError, match="rope_cos"):
        kl.AttnRows([t], torch.tensor([3]), torch.zeros(3, 4), sin)
    H = 32
    layer = attn_layer(hidden=H, n_heads=1, n_kv_heads=1, head_dim=8, qk_norm=None, rope_style="neox",
                          attn_norm=torch.ones(H), ffn_norm=torch.ones(H), wq=torch.zeros(8, H), wk=torch.zeros(8, H),
                          wv=torch.zeros(8, H), wo=torch.zeros(H, 8))
    rows = kl.AttnRows([t], torch.tensor([5]), cos, sin)
    with pytest.raises(ValueError, match="k_cache"):
        kl.attn_block(layer, torch.zeros(1, H), rows, torch.zeros(5, 1, 8), torch.zeros(5, 1, 8), 1e-6)  # no slot 5
    xn, ids, w = kl.attn_block(layer, torch.zeros(1, H), rows, torch.zeros(8, 1, 8), torch.zeros(8, 1, 8), 1e-6)
    assert xn.shape == (1, H) and ids is None and w is None
    negative = kl.AttnRows([torch.tensor([0, -1])], torch.tensor([1]), cos, sin)  # checked where a cache is read
    with pytest.raises(ValueError, match="negative"):
        kl.attn_block(layer, torch.zeros(1, H), negative, torch.zeros(8, 1, 8), torch.zeros(8, 1, 8), 1e-6)


def test_attn_layer_rejects_mismatched_weights():
    H = 64
    good = {"hidden": H, "n_heads": 2, "n_kv_heads": 2, "head_dim": 32, "qk_norm": None, "rope_style": "neox",
            "attn_norm": torch.ones(H), "ffn_norm": torch.ones(H), "wq": torch.zeros(64, H), "wk": torch.zeros(64, H),
            "wv": torch.zeros(64, H), "wo": torch.zeros(H, 64)}
    attn_layer(**good)
    with pytest.raises(ValueError, match="wk"):
        attn_layer(**(good | {"wk": torch.zeros(32, H)}))
    with pytest.raises(ValueError, match="attn_norm"):
        attn_layer(**(good | {"attn_norm": torch.ones(H, dtype=torch.float64)}))
    with pytest.raises(ValueError, match="heads"):
        attn_layer(**(good | {"n_kv_heads": 3}))


# -------------------------------------------------------------------------------- whole models


@pytest.fixture(scope="module")
def gguf_models(hf_model, tmp_path_factory):
    cache = {}

    def get(family, ftype):
        if (family, ftype) not in cache:
            _, folder = hf_model(family)
            path = tmp_path_factory.mktemp(f"fused-{family}") / f"{ftype}.gguf"
            cache[family, ftype] = load_model(convert_hf_to_gguf(folder, path, ftype=ftype, progress=False)).model
        return cache[family, ftype]

    return get


def run_steps(model, tokens):
    """Prefill 20 (torch path), a 5-token step and five 1-token steps (fused when available)."""
    kv = SeqKV(KVPool(model.spec, 64), 64)
    outs = [model.forward(tokens[:20], kv, last_only=True), model.forward(tokens[20:25], kv)]
    outs += [model.forward(t.view(1), kv) for t in tokens[25:30]]
    return torch.cat(outs)


@pytest.mark.parametrize("ftype", ["F32", "Q8_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_steps_equal_the_torch_path(gguf_models, tokens32, family, ftype):
    model = gguf_models(family, ftype)
    assert model.fused is not None, "the fused path should apply to this model"
    fused = run_steps(model, tokens32)
    saved, model.fused = model.fused, None
    try:
        ref = run_steps(model, tokens32)
    finally:
        model.fused = saved
    per_row = (fused - ref).abs().amax(-1)  # one row per step's token
    if ftype == "F32":
        err = per_row.max().item()
        assert err < 2e-5, f"{family} {ftype}: fused vs torch max abs {err:.2e} (measured <= 3.1e-6)"
    else:
        # Quantized weights: activations are rounded to 8 bits before each product, so a float-order difference
        # of 1e-7 between the two attention paths can move one value of h across a rounding boundary, and that
        # step's logits then differ by ~1e-2 (seen once: the tiny qwen3moe in Q8_0, interleaved, one step of
        # eleven). Most steps must agree to float noise and none may differ by more than such a flip.
        med, worst = per_row.median().item(), ((fused - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        assert med < 2e-5, f"{family} {ftype}: fused vs torch median max abs {med:.2e} per step"
        assert worst < 0.05, f"{family} {ftype}: fused vs torch relative {worst:.3f} in one step"


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("family", ["qwen3moe", "qwen2moe"])
def test_batched_decode_equals_one_sequence_at_a_time(gguf_models, family, fused):
    """Three sequences of different lengths sharing one pool (so their blocks interleave), decoded together
    for four steps, give each sequence's own logits."""
    model = gguf_models(family, "Q8_0")
    saved = model.fused
    model.fused = saved if fused else None
    try:
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, 256, (n,), generator=g) for n in (5, 19, 11)]
        steps = torch.randint(0, 256, (4, 3), generator=g)
        alone = []
        for b, prompt in enumerate(prompts):
            kv = SeqKV(KVPool(model.spec, 64), 64)
            model.forward(prompt, kv)
            alone.append(torch.cat([model.forward(steps[s, b].view(1), kv) for s in range(4)]))
        pool = KVPool(model.spec, 192)
        kvs = [SeqKV(pool, 64) for _ in prompts]
        for kv, prompt in zip(kvs, prompts):
            for chunk in prompt.split(4):  # interleave the sequences' blocks in the pool
                model.forward(chunk, kv)
        together = torch.stack([model.decode(steps[s], kvs) for s in range(4)], dim=1)  # [B, steps, V]
    finally:
        model.fused = saved
    assert [kv.length for kv in kvs] == [len(p) + 4 for p in prompts]
    for b in range(3):
        err = (together[b] - alone[b]).abs().max().item()
        assert err < 2e-5, f"sequence {b}: {err:.2e}"


def test_decode_rejects_bad_batches(gguf_models):
    model = gguf_models("qwen3moe", "F32")
    pool = KVPool(model.spec, 64)
    kv = SeqKV(pool, 64)
    model.forward(torch.tensor([1, 2]), kv)
    with pytest.raises(ValueError, match="distinct"):
        model.decode(torch.tensor([3, 4]), [kv, kv])
    with pytest.raises(ValueError, match="distinct"):
        model.decode(torch.tensor([3]), [kv, SeqKV(pool, 64)])


def test_embedding_lookup_through_the_kernel_equals_the_reference(gguf_models):
    model = gguf_models("mixtral", "Q8_0")
    assert model.embd.qtype == QType.Q8_0
    tokens = torch.tensor([0, 7, 511, 7])
    assert torch.equal(model.embed(tokens), model.embd.dequantize(torch.float32)[tokens])
    assert F.mse_loss(model.embed(tokens), model.embd.dequantize(torch.float32)[tokens]) == 0
