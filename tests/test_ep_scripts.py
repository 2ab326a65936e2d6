"""bench/ep_bench.py and bench/ep_netns.py's pieces (issue 40): the link probe over loopback, processes run
together (one failing stops the others), and the namespace script's refusal without root or beside namespaces
of its names. Nothing here times anything against a bound.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import ep_bench
import ep_netns
from test_pipeline_dist import free_port


def test_processes_run_together_and_one_failing_stops_the_others():
    ok = ep_bench.run_together([[sys.executable, "-c", "print('zero')"], [sys.executable, "-c", "print('one')"]],
                               "two")
    assert ok == ["zero\n", "one\n"]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"pair, rank 1: failed:\n.*gone"):
        ep_bench.run_together([[sys.executable, "-c", "import time; time.sleep(600)"],
                               [sys.executable, "-c", "import sys; sys.exit('gone')"]], "pair", timeout=600)
    assert time.monotonic() - start < 300  # the sleeper was killed, not waited for


@pytest.mark.slow
def test_the_link_probe_over_loopback(monkeypatch):
    link = ep_bench.probe_link("127.0.0.1", free_port(), 64, 0.0001)
    assert {"round_trip_s", "gather_8b_s", "gather_hidden_s", "gather_16mib_s", "gather_spaced_s",
            "round_trip_spaced_s", "gbits"} <= set(link)
    assert all(link[k] > 0 for k in ("round_trip_s", "gather_8b_s", "gather_spaced_s", "gbits"))
    assert link["hidden"] == 64 and link["big_bytes"] == 16 << 20


def test_the_namespace_script_needs_root(monkeypatch, capsys):
    monkeypatch.setattr(ep_netns.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(sys, "argv", ["ep_netns.py", "model.gguf"])
    with pytest.raises(SystemExit, match="needs root"):
        ep_netns.main()


def test_the_namespace_script_leaves_namespaces_it_did_not_make(monkeypatch):
    monkeypatch.setattr(ep_netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(ep_netns, "existing", lambda: ["moerun-ep-a"])
    made = []
    monkeypatch.setattr(ep_netns, "set_up", lambda *a: made.append(a))
    monkeypatch.setattr(sys, "argv", ["ep_netns.py", "model.gguf"])
    with pytest.raises(SystemExit, match="moerun-ep-a exist"):
        ep_netns.main()
    assert not made


def test_the_namespaces_go_even_when_a_run_fails(monkeypatch):
    monkeypatch.setattr(ep_netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(ep_netns, "existing", list)
    monkeypatch.setattr(ep_netns.shutil, "which", lambda name: f"/usr/sbin/{name}")
    monkeypatch.setattr(ep_netns.signal, "signal", lambda *a: None)  # pytest's own SIGTERM handling stays
    calls = []
    monkeypatch.setattr(ep_netns, "set_up", lambda *a: calls.append("set up"))
    monkeypatch.setattr(ep_netns, "tear_down", lambda: calls.append("torn down") or [])

    def measure(a):
        raise subprocess.CalledProcessError(1, ["moerun", "bench"])

    monkeypatch.setattr(ep_netns, "measure", measure)
    monkeypatch.setattr(sys, "argv", ["ep_netns.py", "model.gguf"])
    with pytest.raises(subprocess.CalledProcessError):
        ep_netns.main()
    assert calls == ["set up", "torn down"]
