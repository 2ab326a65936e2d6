"""Every Triton launch configuration of the GPU path, compiled for sm_90 (H100/H200) and sm_86 (RTX 30xx, A10)
by triton's bundled LLVM and ptxas: no GPU needed.

Cases come from `ptx_cases()` of every module moerun.kernels.triton_* that has one: (name, jit function,
signature, constexprs[, attrs[, options]]), attrs the integer-divisibility specialisation a real launch gets
(default: every pointer 16-byte aligned), options triton's compile options (num_warps, num_stages).

Checked for each: it compiles (ptxas included), fits in an SM's shared memory, and where it reads
quantized weights (uint8 tensors), it reads them in 16-byte vectors: every load of a uint8 pointer tensor
in the TTGIR has 16 or more contiguous bytes per thread, the PTX has no 8-bit global load, and it has
128-bit ones (ld.global .v4.b32 / .v2.b64 or wider, or 16-byte cp.async). Also: each decode launch of
Qwen3-30B-A3B's shapes has at least 4 programs per SM of a 132-SM H200.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
from concurrent.futures import ProcessPoolExecutor

import pytest

triton = pytest.importorskip("triton")

from moerun.kernels import triton_q as tq
from moerun.quant.qtypes import QType

# compiles every Triton kernel to PTX for two GPU generations (~150 s): `python -m pytest -m slow`, and CI
pytestmark = pytest.mark.slow

ARCHS = (90, 86)
SHARED_MAX = {90: 227 * 1024, 86: 99 * 1024}  # opt-in shared memory per block
BYTE_LOAD = re.compile(r"\bld\.global(?:\.[\w:]+)*?\.[bsu]8\b")
WIDE_LOAD = re.compile(r"\bld\.global(?:\.[\w:]+)*?\.(?:v4\.[bsuf]32|v2\.[bsuf]64|v4\.[bsuf]64|v8\.[bsuf]32)\b"
                       r"|\bcp\.async\.c[ag]\.shared\.global(?:\.[\w:]+)*\s+\[[^]]*\],\s*\[[^]]*\],\s*(?:16|0x10)\b")
I8_LOAD = re.compile(r"(?:tt\.load|ttg\.async_copy_global_to_local)\b[^\n]*tensor<[\dx]*!tt\.ptr<i8>, (#[\w]+)>")


def _modules():
    """The moerun.kernels.triton_* modules with ptx_cases(), built for the compiler (not the interpreter)."""
    import moerun.kernels

    tq._kernels()
    mods = []
    for info in sorted(pkgutil.iter_modules(moerun.kernels.__path__), key=lambda m: m.name):
        if not info.name.startswith("triton_"):
            continue
        mod = importlib.import_module(f"moerun.kernels.{info.name}")
        if getattr(mod, "INTERPRETED", False):
            mod = importlib.reload(mod)
        if hasattr(mod, "ptx_cases"):
            mods.append(mod)
    return mods


def _collect() -> list[tuple]:
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        if not isinstance(triton.language.standard._sum_combine, triton.runtime.jit.JITFunction):
            return []  # triton was imported under TRITON_INTERPRET=1: its library is interpreted
        cases = []
        for mod in _modules():
            for case in mod.ptx_cases():
                name, fn, sig, consts, *rest = case
                attrs = rest[0] if rest else {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
                                              if str(sig.get(p.name, "")).startswith("*")}
                options = rest[1] if len(rest) > 1 else getattr(mod, "ptx_options", lambda c: {})(case)
                cases.append((f"{mod.__name__.rsplit('.', 1)[1]}.{name}", fn, sig, consts, attrs, options))
        return cases
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


CASES = _collect()


def _compile(args) -> tuple[str, str, int]:
    """(ptx, ttgir, shared bytes) of one case for one arch (in a worker process)."""
    name, arch = args
    _, fn, sig, consts, attrs, options = next(c for c in CASES if c[0] == name)
    from triton.backends.compiler import GPUTarget

    src = triton.compiler.ASTSource(fn, sig, consts, attrs)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(options))
    assert len(k.asm["cubin"]) > 0
    return k.asm["ptx"], k.asm["ttgir"], int(k.metadata.shared)


@pytest.fixture(scope="module")
def compiled():
    """Every case for every arch, compiled in parallel once for the module: {(name, arch): (ptx, ttgir, shared)}."""
    if not CASES:
        pytest.skip("triton was imported with TRITON_INTERPRET=1: its library is interpreted")
    jobs = [(c[0], arch) for c in CASES for arch in ARCHS]
    workers = max(1, min(8, os.cpu_count() or 1))
    import multiprocessing

    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"  # the workers import triton compiled
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_compile, jobs))
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return dict(zip(jobs, results))


def _reads_weights(case) -> bool:
    """Whether the case reads quantized weights: a uint8 pointer, or a quantized QTYPE over address tables."""
    _, fn, _sig, consts, _, _ = case
    qtypes = {v for k, v in consts.items() if str(k).startswith("QTYPE") or k in [
        (i,) for i, p in enumerate(fn.params) if p.name.startswith("QTYPE")]}
    quantized = any(tq.supports(q) for q in qtypes if isinstance(q, int))
    flt = any(v is True for k, v in consts.items() if k == "FLOAT" or k in [
        (i,) for i, p in enumerate(fn.params) if p.name == "FLOAT"])
    return quantized and not flt


def _vector_bytes(ttgir: str, alias: str) -> int:
    """Contiguous elements per thread of the layout `alias` (#blockedN) along its fastest dimension."""
    m = re.search(rf"^{re.escape(alias)} = #ttg\.blocked<\{{sizePerThread = \[([\d, ]+)\][^}}]*order = \[([\d, ]+)\]",
                  ttgir, re.MULTILINE)
    assert m, f"no layout {alias}"
    spt = [int(v) for v in m[1].split(",")]
    order = [int(v) for v in m[2].split(",")]
    return spt[order[0]]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_compiles_with_vector_weight_loads(case, arch, compiled):
    ptx, ttgir, shared = compiled[(case[0], arch)]
    assert shared <= SHARED_MAX[arch], f"{shared} bytes of shared memory"
    if not _reads_weights(case):
        return
    assert not BYTE_LOAD.findall(ptx), f"byte loads: {sorted(set(BYTE_LOAD.findall(ptx)))}"
    assert WIDE_LOAD.search(ptx), "no 128-bit loads"
    loads = I8_LOAD.findall(ttgir)
    assert loads, "no uint8 tensor loads in the TTGIR"
    for alias in loads:
        assert _vector_bytes(ttgir, alias) >= 16, f"a uint8 load with layout {alias}: under 16 bytes per thread"


def test_cases_cover_every_type_and_option():
    names = [c[0] for c in CASES if c[0].startswith("triton_moe.")]
    if not CASES:
        pytest.skip("triton was imported with TRITON_INTERPRET=1")
    for qtype in tq.SUPPORTED:
        mine = [n for n in names if n.startswith(f"triton_moe.{qtype.name}_")]
        for part in ("_t1_matmul", "_t1_swiglu", "_t1_moe", "_t512_matmul", "_t512_moe"):
            assert any(part in n for n in mine), (qtype.name, part)
    for option in ("norm", "bias", "accumulate", "oai", "pairs", "sum_pairs_kernel", "moe_pair_kernel"):
        assert any(option in n for n in names), option


# a3b decode launches (T = 1): (qtype, N, K, choices per token, summed) -> at least 4 programs per SM
A3B_DECODE = {
    "q|k|v": (QType.Q4_K, 4096 + 512 + 512, 2048, 1, False),
    "o": (QType.Q4_K, 2048, 4096, 1, False),
    "expert gate/up": (QType.Q4_K, 768, 2048, 8, False),
    "expert down": (QType.Q6_K, 2048, 768, 8, True),
    "head": (QType.Q6_K, 151936, 2048, 1, False),
}


@pytest.mark.parametrize("name", sorted(A3B_DECODE))
@pytest.mark.parametrize("qtype", sorted(tq.SUPPORTED), ids=lambda q: q.name)
def test_a3b_decode_launches_fill_an_h200(name, qtype):
    _, n, k, experts, summed = A3B_DECODE[name]
    programs = tq.decode_programs(qtype, n, k, 1, experts=experts, summed=summed)
    assert programs >= 4 * 132, (name, programs)
