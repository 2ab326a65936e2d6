"""Each step runs on the cores other processes leave free (issue 15, item 1): torch's threads in prefill, the
kernel pool's in every step."""

from __future__ import annotations

import os

import pytest
import torch

from moerun.model import ops


@pytest.fixture
def machine(monkeypatch):
    """A 4-CPU machine whose /proc/loadavg reports `runnable[0]` runnable threads, this process running one."""
    runnable = [1]
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    real = ops._read

    def fake(path):
        if path == "/proc/loadavg":
            return f"0.50 0.40 0.30 {runnable[0]}/300 12345\n"
        if path.startswith("/proc/self/task/"):
            return "1 (python) R 1 1" if path.split("/")[4] == str(os.getpid()) else "2 (python) S 1 1"
        return real(path)

    monkeypatch.setattr(ops, "_read", fake)
    monkeypatch.setattr(ops, "_kernel_reading", lambda: -1)  # the Python reading, through the fake files
    return runnable


@pytest.mark.parametrize("others,budget,want", [(0, 4, 4), (1, 4, 3), (2, 4, 2), (3, 4, 1), (7, 4, 1), (1, 2, 2),
                                                (0, 1, 1)])
def test_free_cpus_leaves_out_cores_other_processes_run_on(machine, others, budget, want):
    machine[0] = 1 + others
    assert ops.FreeCpus(ttl=0)(budget) == want
    assert ops.FreeCpus(gap=0)(budget, long=True) == want


def test_a_moment_of_load_does_not_count_a_lasting_one_does(machine):
    free = ops.FreeCpus(ttl=0, keep=3, fresh=3600)
    machine[0] = 1
    assert free(4) == 4
    machine[0] = 4  # three other threads: the earlier reading still says none
    assert free(4) == 4 and free(4) == 4
    assert free(4) == 1  # three readings in a row
    cached = ops.FreeCpus(ttl=3600)
    assert cached(4) == 1
    machine[0] = 1
    assert cached(4) == 1  # within the ttl: no new reading


def test_the_cpu_set_is_read_again_only_after_cpus_ttl(machine, monkeypatch):
    machine[0] = 1
    calls = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: calls.append(pid) or {0, 1, 2, 3})
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    free = ops.FreeCpus(ttl=0, cpus_ttl=3600)
    assert [free(4) for _ in range(5)] == [4] * 5 and len(calls) == 1
    machine[0] = 3  # the load is still read every call (ttl 0)
    assert free(4) == 4 and free(4) == 4 and free(4) == 2 and len(calls) == 1
    again = ops.FreeCpus(ttl=0, cpus_ttl=0)
    again(4), again(4)
    assert len(calls) == 3


def test_a_narrow_affinity_or_no_proc_keeps_the_budget(machine, monkeypatch):
    machine[0] = 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # another process's CPUs count too
    assert ops.FreeCpus(ttl=0)(4) == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})

    def gone(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(ops, "_read", gone)
    assert ops.FreeCpus(ttl=0)(3) == 3


class Pool:
    """The kernel pool's thread calls, recorded."""

    def __init__(self, threads):
        self.threads, self.active = threads, []

    def get_threads(self):
        return self.threads

    def set_active(self, n):
        self.active.append(n)


def test_a_step_runs_on_the_free_cores_and_restores_the_budget(machine):
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    pool = Pool(4)
    try:
        machine[0] = 3  # two other processes running
        with ops.step_threads(ops.FreeCpus(ttl=0), pool=pool):  # prefill
            assert torch.get_num_threads() == 2 and pool.active == [2]
        with ops.step_threads(ops.FreeCpus(ttl=0), 1, pool):  # decode: the kernel pool works, torch one thread
            assert torch.get_num_threads() == 1 and pool.active[-1] == 2
        with ops.ReferenceOps().step(64):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 4 and pool.active == [2, 0, 2, 0]
    finally:
        torch.set_num_threads(before)


def test_kernel_pool_results_do_not_depend_on_its_active_threads():
    cpu = pytest.importorskip("moerun.kernels.cpu")
    if not cpu.available():
        pytest.skip("kernels not built")
    from moerun.quant.qtypes import QTensor, QType
    from moerun.quant.quantize import quantize

    g = torch.Generator().manual_seed(0)
    w = QTensor.from_bytes(quantize(torch.randn(512, 256, generator=g), QType.Q8_0), QType.Q8_0, (512, 256))
    x = torch.randn(7, 256, generator=g)
    threads = cpu.get_threads()
    cpu.set_threads(2)
    try:
        ref = cpu.matmul(x, w)
        for n in (1, 2, 0):
            cpu.set_active(n)
            assert torch.equal(cpu.matmul(x, w), ref)
    finally:
        cpu.set_active(0)
        cpu.set_threads(threads)


def test_the_kernels_reading_agrees_with_the_python_one():
    """The C reading (moerun/kernels/csrc/sysload.c) against the Python one of the same files: the count moves with the
    machine's load, so some of a few back-to-back pairs agree."""
    from moerun.kernels import cpu

    if not cpu.available() or not os.path.exists("/proc/loadavg"):
        pytest.skip("needs the CPU kernels and /proc")
    c = ops._kernel_reading()
    assert isinstance(c, int) and c >= 0
    real_c = ops._kernel_reading
    try:
        pairs = []
        for _ in range(8):
            ops._kernel_reading = lambda: -1
            py = ops._others_runnable()
            ops._kernel_reading = real_c
            pairs.append((ops._others_runnable(), py))
    finally:
        ops._kernel_reading = real_c
    assert any(a == b for a, b in pairs), pairs
