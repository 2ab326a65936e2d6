"""kernels/reads.py: a load's reads taken by a few threads in one C call each, the GIL free throughout."""

from __future__ import annotations

import errno
import random
import threading

import pytest
import torch
from qblocks import random_blocks

from moerun.quant.qtypes import QTensor, QType, row_bytes

cpu = pytest.importorskip("moerun.kernels.cpu")
pytestmark = pytest.mark.skipif(not cpu.available(), reason="moerun.kernels._cpu not built or disabled")
reads = pytest.importorskip("moerun.kernels.reads")

KINDS = [None, QType.Q4_K, QType.Q6_K, QType.Q8_0, QType.MXFP4]


def _file(tmp_path, n: int, seed: int = 0):
    """A file of n tensors (as stored, or GGUF blocks of a type the kernels interleave), after a 13-byte header ->
    its path and [(offset, kind, shape, bytes)]."""
    gen, rnd = torch.Generator().manual_seed(seed), random.Random(seed)
    parts, items, at = [b"h" * 13], [], 13
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        if kind is None:
            shape = (rnd.randrange(1, 50_000),)
            data = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        else:
            shape = (rnd.choice([1, 3]), 8 * rnd.randrange(1, 6), 256 * rnd.randrange(1, 4))
            data = random_blocks(kind, shape[0] * shape[1], shape[2], gen).reshape(-1)
        items.append((at, kind, shape, data))
        parts.append(data.numpy().tobytes())
        at += data.numel()
    path = tmp_path / "t.bin"
    path.write_bytes(b"".join(parts))
    return path, items


def _want(kind, shape, data: torch.Tensor) -> torch.Tensor:
    if kind is None:
        return data
    return cpu.interleave(QTensor.from_bytes(data, kind, shape)).data.reshape(-1)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_read_lands_once_as_stored_or_interleaved(tmp_path, threads):
    path, items = _file(tmp_path, 40)
    seen = []
    with open(path, "rb", buffering=0) as f:
        jobs = [reads.Read(f.fileno(), at, torch.full((data.numel(),), 7, dtype=torch.uint8), kind, shape)
                for at, kind, shape, data in items]
        got = reads.read_all(jobs, threads, progress=lambda i, rc: seen.append((i, rc)), poll=0.001)
    assert got == [data.numel() for *_, data in items]
    assert sorted(seen) == list(enumerate(got))  # each read told once, with its result
    for job, (_, kind, shape, data) in zip(jobs, items):
        assert torch.equal(job.dst, _want(kind, shape, data))


def test_a_file_that_ends_early_or_a_read_that_fails_is_in_the_results(tmp_path):
    path, items = _file(tmp_path, 5)
    size = path.stat().st_size
    _, kind, shape, data = items[1]  # Q4_K
    with open(path, "rb", buffering=0) as f:
        short = reads.Read(f.fileno(), size - 100, torch.empty(300, dtype=torch.uint8))
        late = reads.Read(f.fileno(), size - data.numel() + 8 * row_bytes(kind, shape[-1]), torch.empty_like(data),
                          kind, shape)
        got = reads.read_all([short, late], 2)
    assert got[0] == 100 and 0 <= got[1] < data.numel()
    with open(path, "ab") as w:  # write-only: a read fails with its errno
        assert reads.read_all([reads.Read(w.fileno(), 0, torch.empty(10, dtype=torch.uint8))], 1) == [
            -1000 - errno.EBADF]
    with pytest.raises(ValueError):
        reads.read_all([reads.Read(0, 0, torch.empty(20, dtype=torch.uint8)[::2])], 1)
    with pytest.raises(ValueError):  # the interleaved layout needs whole groups of 8 rows
        reads.read_all([reads.Read(0, 0, torch.empty(12 * 144, dtype=torch.uint8), QType.Q4_K, (12, 256))], 1)


def test_the_reads_go_on_while_this_thread_holds_the_gil(tmp_path):
    """`meanwhile` holds the GIL in long native calls (as the tokenizer's build does), and the reads all end beside
    it. Reads that needed the GIL between tensors would get it once a call at most: a few of the 64 in six calls."""
    path, items = _file(tmp_path, 64, seed=1)
    big = [random.random() for _ in range(400_000)]
    wants = [_want(kind, shape, data).numpy().tobytes() for _, kind, shape, data in items]
    where, ended = [], []
    with open(path, "rb", buffering=0) as f:
        jobs = [reads.Read(f.fileno(), at, torch.zeros(data.numel(), dtype=torch.uint8), kind, shape)
                for at, kind, shape, data in items]

        def meanwhile():
            where.append(threading.get_ident())
            for _ in range(6):
                sorted(big)  # one native call, the GIL held throughout
            ended.append(sum(j.dst.numpy().tobytes() == w for j, w in zip(jobs, wants)))  # still holding it

        got = reads.read_all(jobs, 2, meanwhile=meanwhile)
    assert where == [threading.get_ident()] and got == [data.numel() for *_, data in items]
    assert ended == [64]


def test_an_error_in_meanwhile_waits_for_the_reads(tmp_path):
    path, items = _file(tmp_path, 10, seed=2)
    with open(path, "rb", buffering=0) as f:
        jobs = [reads.Read(f.fileno(), at, torch.zeros(data.numel(), dtype=torch.uint8), kind, shape)
                for at, kind, shape, data in items]

        def meanwhile():
            raise KeyError("the tokenizer")

        with pytest.raises(KeyError):
            reads.read_all(jobs, 2, meanwhile=meanwhile)
    for job, (_, kind, shape, data) in zip(jobs, items):  # every read had ended when the error came out
        assert torch.equal(job.dst, _want(kind, shape, data))
