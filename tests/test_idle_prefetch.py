"""A thread done with its share of a pool job prefetches into L2 where its share of the next job starts (pool.h's
qk_pool_run_then, matmul.h's qk_then_spans): the table's default, the setting's checks, and where the spans lie. That
the threads of a real decode step start where the job before said, and that no result moves, is in
tests/test_fused_families.py."""

from __future__ import annotations

from itertools import pairwise

import pytest

cpu = pytest.importorskip("moerun.kernels.cpu")
pytestmark = pytest.mark.skipif(not cpu.available(), reason="CPU kernels not built")

QK_R8 = 1000
Q4_K_R8, Q6_K_R8, F32 = QK_R8 + 12, QK_R8 + 14, 0
R8_BLOCK = {Q4_K_R8: 1152, Q6_K_R8: 1680}  # bytes of 8 rows' block of 256 values
BASE = 1 << 40  # addresses only: qk_then_spans never reads the matrices


@pytest.fixture
def pool():
    """The pool's threads and the idle prefetch as they were, afterwards."""
    threads = cpu.get_threads()
    cpu.set_idle_prefetch(1 << 20)
    yield
    cpu.set_threads(threads)
    cpu.set_idle_prefetch()


def spans(mats, K, T):
    return cpu._cpu.then_spans(cpu.ISA_IDS[cpu.features()["isa"]], mats, K, T)


def test_the_tables_default_and_the_settings_checks():
    """1 MiB on Intel family 6 model 207, where it was measured (bench/journal/issue-36.md, "A thread's next share
    prefetched while it waits"); none elsewhere until measured there, every row whatever CPU runs the test."""
    rows = {("GenuineIntel", 6, 207): 1 << 20, ("GenuineIntel", 6, 143): 0, ("GenuineIntel", 6, 0): 0,
            ("AuthenticAMD", 26, 2): 0, ("AuthenticAMD", 25, 17): 0, ("HygonGenuine", 24, 0): 0}
    for (vendor, family, model), want in rows.items():
        assert cpu._cpu.idle_prefetch_default(vendor, family, model) == want, vendor
    for bad in (-4096, 100, 4097, (16 << 20) + 4096, True, 1.5, "1m"):
        with pytest.raises(ValueError, match="idle prefetch"):
            cpu.set_idle_prefetch(bad)
    try:
        cpu.set_idle_prefetch(8192)
        assert cpu.features()["idle_prefetch"] == 8192
        cpu.set_idle_prefetch(0)
        assert cpu.features()["idle_prefetch"] == 0
        assert spans([(BASE, Q4_K_R8, 4096)], 2048, 1) == []  # off: no spans at all
    finally:
        cpu.set_idle_prefetch()
    assert cpu.features()["idle_prefetch"] in {r for r in rows.values()}


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("T, group", [(1, 8), (4, 16)])  # a batch reads two groups of 8 rows a call
def test_one_matrixs_spans_tile_it_thread_by_thread(pool, threads, T, group):
    cpu.set_threads(threads)
    N, K = 4096, 2048
    row = K // 256 * R8_BLOCK[Q4_K_R8] // 8  # bytes a row
    got = spans([(BASE, Q4_K_R8, N)], K, T)
    assert len(got) == threads
    assert got[0][0] == BASE
    for (a, n), (b, _) in pairwise(got):
        assert a + n == b  # each thread's range ends where the next one's starts
    assert sum(n for _, n in got) == N * row
    for a, n in got:
        assert (a - BASE) % (group * row) == 0 and n % (8 * row) == 0 and n > 0


def test_several_matrices_each_span_within_one(pool):
    """q, k and v of one input (Q4_K_R8, Q4_K_R8, Q6_K_R8) and a float router: a thread's span is the part of its range
    in the matrix where it starts, never past that matrix's end."""
    cpu.set_threads(3)
    K = 2048
    mats = [(BASE, Q4_K_R8, 4096), (BASE + (1 << 30), Q4_K_R8, 512), (BASE + (2 << 30), Q6_K_R8, 512),
            (BASE + (3 << 30), F32, 128)]
    sizes = [4096 * K // 256 * 1152 // 8, 512 * K // 256 * 1152 // 8, 512 * K // 256 * 1680 // 8, 128 * K * 4]
    got = spans(mats, K, 1)
    assert len(got) == 3 and got[0][0] == BASE
    for a, n in got:
        j = max(i for i, (base, _, _) in enumerate(mats) if base <= a)
        assert n > 0 and a + n <= mats[j][0] + sizes[j], (a - mats[j][0], n, sizes[j])
    for bad in ([(BASE, 7777, 64)], [(BASE, Q4_K_R8, 12)], []):  # no such type, not whole groups, nothing
        assert spans(bad, K, 1) == []
