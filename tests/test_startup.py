"""Start-up (issue 39, item 4): what a short command imports, read from `python -X importtime` (no wall-clock
times are asserted: the machine is shared). `moerun --help` and `-h` import no torch; `run` imports torch but not
torch._dynamo (half a second, pulled in by torch.nn.attention.bias), the server, the hub's client, transformers or
uvicorn; the interpreter's last collections at exit skip the objects alive then (gc.freeze at exit), unless triton
is loaded."""

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


@pytest.mark.parametrize("triton,frozen", [(False, True), (True, False)])
def test_the_cli_freezes_the_heap_at_exit_unless_triton_is_loaded(triton, frozen):
    fake = "import sys, types; sys.modules['triton'] = types.ModuleType('triton'); " if triton else ""
    code = fake + "import atexit, gc, moerun.cli; atexit._run_exitfuncs(); print(gc.get_freeze_count() > 0)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert r.stdout.strip() == str(frozen)
