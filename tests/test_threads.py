"""Prefill's torch threads count only the cores other processes leave free (issue 15, item 1)."""

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
    return runnable


@pytest.mark.parametrize("others,budget,want", [(0, 4, 4), (1, 4, 3), (2, 4, 2), (3, 4, 1), (7, 4, 1), (1, 2, 2),
                                                (0, 1, 1)])
def test_free_cpus_leaves_out_cores_other_processes_run_on(machine, others, budget, want):
    machine[0] = 1 + others
    assert ops.free_cpus(budget) == want


def test_a_narrow_affinity_or_no_proc_keeps_the_budget(machine, monkeypatch):
    machine[0] = 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert ops.free_cpus(4) == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})

    def gone(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(ops, "_read", gone)
    assert ops.free_cpus(3) == 3


def test_a_prefill_step_runs_on_the_free_cores_and_restores_the_budget(machine):
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        machine[0] = 3  # two other processes running
        with ops.KernelOps().step(64):
            assert torch.get_num_threads() == 2
        with ops.KernelOps().step(1):  # decode: the kernel pool works, torch stays at one thread
            assert torch.get_num_threads() == 1
        with ops.ReferenceOps().step(64):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)
