"""MLA's W_UK and W_UV read in the file's quantized types by the fused decode (csrc/deqdot.c): each product must be the
float32 one of the dequantized weights, bit for bit, so where the bytes are read never changes a token (the layer
loop and the device paths multiply the float32 copies). The oracle for each row is the fused path's own float kernel
on dequant_rows' values, which tests/test_kernels_cpu.py ties to gguf.quants."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType, quants
from qblocks import random_blocks

from moerun.engine.kv_cache import KVPool, SeqKV
from moerun.loading import load_model
from moerun.quant.qtypes import QTensor, QType
from moerun.tools.make_model import make_model
from moerun.tools.presets import preset

cpu = pytest.importorskip("moerun.kernels.cpu")
pytestmark = pytest.mark.skipif(not cpu.available(), reason="CPU kernels not built")

VNNI = "avx512vnni" in cpu.features()["isas"]
TYPES = [QType.Q4_0, QType.Q5_0, QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("K", [256, 512])
def test_a_row_dotted_in_registers_is_the_float_kernel_on_its_dequantized_values(qtype, K):
    gen = torch.Generator().manual_seed(K + int(qtype))
    w = QTensor.from_bytes(random_blocks(qtype, 24, K, gen), qtype, (24, K))
    floats = cpu.dequant_rows(w, torch.arange(24))
    ref = torch.from_numpy(quants.dequantize(w.data.numpy(), GGMLQuantizationType[qtype.name]).copy())
    assert torch.equal(floats, ref.reshape(24, K))  # the values: gguf.quants'
    x = torch.randn(K, generator=gen)
    got = cpu.deq_dot(w, x)
    assert cpu.has_deq_dot(qtype) == (got is not None)
    if not VNNI:
        assert got is None
        pytest.skip("the in-register kernels are AVX-512 ones")
    assert torch.equal(got, cpu.matmuls(x[None], [floats])[0][0])  # the sums: the float kernel's, in its order


def test_bad_input_is_refused():
    w = QTensor.from_bytes(random_blocks(QType.Q8_0, 2, 64, torch.Generator()), QType.Q8_0, (2, 64))
    with pytest.raises(ValueError, match="64 values"):
        cpu.deq_dot(w, torch.zeros(32))
    assert not cpu.has_deq_dot(QType.IQ4_XS) and not cpu.has_deq_dot(QType.F32)


def steps(model) -> torch.Tensor:
    kv = SeqKV(KVPool(model.spec, 64), 64)
    toks = torch.randint(0, model.spec.vocab, (20,), generator=torch.Generator().manual_seed(1))
    rows = torch.stack((toks[5:7], toks[7:9]))  # two 2-row steps (speculative verification's shape)
    out = [model.forward(toks[:5], kv, last_only=True)] + [model.forward(r, kv) for r in rows]
    return torch.cat(out + [model.forward(t.view(1), kv) for t in toks[9:]])


@pytest.mark.parametrize("name", ["tiny-deepseek2", "tiny-deepseek3"])
@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_K_M", "Q4_0"])
def test_fused_mla_in_the_file_types_gives_the_float_weights_logits(tmp_path, monkeypatch, name, ftype):
    """Whole-model decode, latent rank 256 and 32 nope dimensions (whole blocks of every type): the fused path
    reading W_UK / W_UV quantized gives the logits it gives from their float32 copies, bit for bit."""
    base = preset(name)
    spec = preset(name, layers=4, kv_lora_rank=256, qk_nope_dim=32, head_dim=32 + base.qk_rope_dim, v_head_dim=32)
    path = make_model(spec, tmp_path / "m.gguf", ftype=ftype, progress=False, threads=1)
    quantized = load_model(path).model
    lw = quantized.layers[1]
    assert lw.wk_b_q.interleave == 1 and lw.wv_b_q.interleave == 1  # never rewritten for the matmul kernels
    assert lw.wk_b_q.qtype not in (QType.F32, QType.F16) and lw.wv_b_q.qtype not in (QType.F32, QType.F16)
    reads = [cpu.has_deq_dot(q.qtype) for q in (lw.wk_b_q, lw.wv_b_q)]
    assert reads == [VNNI, VNNI]
    got = steps(quantized)
    monkeypatch.setattr(cpu, "has_deq_dot", lambda *a, **k: False)
    floats = load_model(path).model
    assert floats.fused is not None and quantized.fused is not None
    assert torch.equal(got, steps(floats))
