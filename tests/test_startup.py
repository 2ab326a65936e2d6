"""Start-up (issue 39, item 4): what a short command imports, read from `python -X importtime` (no wall-clock
times are asserted: the machine is shared). `moerun --help` and `-h` import no torch; `run` imports torch but not
torch._dynamo (half a second, pulled in by torch.nn.attention.bias), the server, the hub's client, transformers or
uvicorn. A process run from the command line ends without the interpreter's teardown (moerun.cli._exit_now), but
joins its threads and runs its exit functions first."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

IMPORTED = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", re.MULTILINE)


def imported(*args: str) -> set[str]:
    """The modules `python -X importtime -m moerun ARGS` imports (it must exit 0)."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "moerun", *args], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    return set(IMPORTED.findall(r.stderr))


@pytest.mark.parametrize("args", [("--help",), ("-h",), ("run", "-h"), ("serve", "--help"), ("estimate", "-h")])
def test_help_imports_no_torch(args):
    mods = imported(*args)
    assert "moerun.cli" in mods  # the parser found something
    assert not {m for m in mods if m == "torch" or m.startswith("torch.")}


def test_a_short_run_imports_no_dynamo_server_hub_client_or_transformers():
    mods = imported("run", "-p", "x", "-n", "1")
    assert "torch" in mods and "moerun.runtime" in mods
    tops = {m.split(".")[0] for m in mods}
    assert not {"transformers", "uvicorn", "fastapi", "starlette", "sympy", "huggingface_hub"} & tops, sorted(tops)
    assert not {m for m in mods if m.startswith(("torch._dynamo", "torch._inductor", "moerun.server", "moerun.hub"))}


EXITS = """
import atexit, sys, threading, time
atexit.register(lambda: print("exit function ran", file=sys.stderr))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread joined", file=sys.stderr))).start()
sys.argv = ["moerun", *sys.argv[1:]]
from moerun.cli import main
main()
print("not reached")
"""


@pytest.mark.parametrize("args,code", [(("--help",), 0), (("run", "-n", "0"), 2), (("inspect", "/no/such"), 1)])
def test_a_command_line_process_ends_without_teardown_but_as_python_would(args, code):
    r = subprocess.run([sys.executable, "-c", EXITS, *args], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == code, r.stderr
    assert "not reached" not in r.stdout and (r.stdout.startswith("Usage: ") or code)
    lines = r.stderr.splitlines()  # the thread's line before or after the command's own error, as the machine goes
    assert lines[-1] == "exit function ran" and "thread joined" in lines[:-1], r.stderr


@pytest.mark.parametrize("given", [None, "9"])
def test_importing_moerun_first_sets_the_thread_spins_a_users_setting_stands(given):
    """GOMP_SPINCOUNT (torch's OpenMP workers) and OPENBLAS_THREAD_TIMEOUT (numpy's OpenBLAS threads, which spun about
    0.1 s of a core after numpy's import, beside a load's reading threads): moerun's defaults where the environment
    has none, the user's where it has."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT")}
    if given is not None:
        env.update(GOMP_SPINCOUNT=given, OPENBLAS_THREAD_TIMEOUT=given)
    code = "import moerun, os; print(os.environ['GOMP_SPINCOUNT'], os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=True)
    assert r.stdout.split() == (["10000", "4"] if given is None else [given, given])
