"""What the bench scripts share (issue 37): their common arguments, alternating rounds and medians, ratios and
Markdown tables, the machine a result was measured on, `moerun` subprocesses and servers, and the journal.

Scripts run as `python bench/NAME.py` find it beside them; a test that loads a script by its path, or imports this
file, puts bench/ on sys.path first (tests/test_faults.py, tests/test_server.py). It imports nothing outside the
standard library at the top, so a bare device machine can run a script that uses it.

- arguments: `add(parser, "model", "threads", "rounds", "append", rounds=5)` adds the common ones in that order,
  each name's default overridden by a value, or its keywords by a dict (`threads={"type": str, "default": "2"}`);
  `parser(__doc__, "line" | "paragraph" | "all")`;
- rounds: `alternate(names, rounds, run)` runs each setting in turn, round after round (optionally a warm-up round
  first, or each round starting further into the settings), so a machine whose speed drifts meets every setting
  alike; `medians`, `pair_ratio` (the median of per-round ratios), `median_time` for one callable;
- figures: `ratio`, `pct_err`, `mean_sd`, `spread`, `cell`; `md_row`, `md_table`;
- the machine: `parse_cpuinfo`, `parse_lscpu` (pure), `machine()`, `cpu_model()`, `cpu_ids()`, `moerun_commit()`,
  `machine_header()`;
- subprocesses: `moerun(*args)` (the CLI, exit on failure), `run_json(cmd)`;
- servers: `free_port()`, `ServerProcess` (`moerun serve` on a free loopback port, ready at /health 200, stopped by
  its PID), `Reply`;
- output: `write_json`, `append_jsonl`, `dated_heading`, `append_section` (a section at the end of the journal's
  inbox, bench/RESULTS.md; bench/journal/README.md says where it goes from there), `publish`.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"

# ------------------------------------------------------------------------------------------------- arguments

COMMON: dict[str, tuple[tuple[str, ...], dict]] = {
    "model": (("model",), {}),
    "models": (("models",), {"nargs": "+"}),
    "threads": (("-t", "--threads"), {"type": int, "default": 2}),
    "rounds": (("-r", "--rounds"), {"type": int, "default": 3}),  # "--rounds": the long flag alone
    "append": (("--append",), {"action": "store_true"}),
    "output": (("-o", "--output"), {"choices": ("md", "json"), "default": "md"}),
}


def parser(doc: str | None, part: str = "line") -> argparse.ArgumentParser:
    """An ArgumentParser described by the script's docstring: its first line, its first paragraph, or all of it
    as written ("all")."""
    if doc is None:
        return argparse.ArgumentParser()
    if part == "all":
        return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    return argparse.ArgumentParser(description=doc.split("\n\n" if part == "paragraph" else "\n")[0])


def add(p: argparse.ArgumentParser, *names: str, **overrides) -> argparse.ArgumentParser:
    """Add the common arguments `names` (COMMON's keys; "--rounds" is rounds without -r) in that order. A keyword
    named as one of them overrides its default (a plain value) or its keywords (a dict)."""
    for name in names:
        key = name.lstrip("-")
        flags, kw = COMMON[key]
        if name == "--rounds":
            flags = ("--rounds",)
        more = overrides.get(key, {})
        p.add_argument(*flags, **{**kw, **(more if isinstance(more, dict) else {"default": more})})
    return p


def ints(text: str) -> list[int]:
    """A comma list of whole numbers ("1,2" -> [1, 2])."""
    return [int(x) for x in text.split(",") if x.strip()]


# ---------------------------------------------------------------------------------------------------- rounds


def alternate(names: Sequence, rounds: int, run: Callable, warmup: bool = False, rotate: bool = False,
              each: Callable | None = None) -> dict:
    """`run(name, round)` for every name in turn, round after round -> {name: [result per round]}. warmup: a round
    0 first whose results are dropped (rounds are then numbered from 1); rotate: round r starts r/rounds of the way
    into `names`. each(name, round, result): called after every timed run (progress lines)."""
    out: dict = {name: [] for name in names}
    for r in range(0 if warmup else 1, rounds + 1):
        k = max(r - 1, 0) * len(names) // rounds if rotate else 0
        for name in list(names[k:]) + list(names[:k]):
            got = run(name, r)
            if r:
                out[name].append(got)
                if each is not None:
                    each(name, r, got)
    return out


def medians(samples: dict) -> dict:
    """{name: [values]} -> {name: their median}."""
    return {k: statistics.median(v) for k, v in samples.items()}


def pair_ratio(a: Iterable[float], b: Iterable[float]) -> float:
    """The median of a[i] / b[i]: two settings compared within each round, the drift between rounds left out."""
    return statistics.median(x / y for x, y in zip(a, b))


def median_time(fn: Callable[[int], object], repeats: int, calls: int = 1, warmup: int = 1) -> float:
    """Median seconds per call of fn(i), i = 0..calls-1, over `repeats` timed rounds, after `warmup` untimed calls
    fn(0), fn(1), ..."""
    for i in range(warmup):
        fn(i)
    rounds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        rounds.append((time.perf_counter() - t0) / calls)
    return statistics.median(rounds)


# --------------------------------------------------------------------------------------------------- figures


def ratio(a: float | None, b: float | None, fmt: str = ".2f") -> str:
    """a / b formatted, "-" where either is missing or b is 0."""
    return "-" if a is None or not b else format(a / b, fmt)


def pct_err(a: float, b: float) -> str:
    """a against b as a signed percentage: "+4.2%"."""
    return f"{100 * (a / b - 1):+.1f}%"


def mean_sd(xs: Sequence[float], fmt: str = ".2f") -> str:
    """"mean ± sample standard deviation" (0 for one value)."""
    return f"{format(statistics.mean(xs), fmt)} ± {format(statistics.stdev(xs) if len(xs) > 1 else 0.0, fmt)}"


def spread(xs: Sequence[float], fmt: str = ".1f") -> str:
    """"median (min, max)"."""
    return f"{format(statistics.median(xs), fmt)} (min {format(min(xs), fmt)}, max {format(max(xs), fmt)})"


def cell(x: float | None, fmt: str, missing: str = "-") -> str:
    """x formatted, `missing` where it is None."""
    return missing if x is None else format(x, fmt)


def md_row(cells: Iterable) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def md_table(header: Sequence[str], rows: Iterable[Iterable] = (), align: str = "", spaced: bool = False) -> str:
    """A Markdown table. align: one letter a column, "l" or "r" (right: `---:`; missing letters are "l");
    spaced: `| --- | ---: |` instead of `|---|---:|`."""
    marks = ["---:" if (align[i:i + 1] == "r") else "---" for i in range(len(header))]
    rule = md_row(marks) if spaced else "|" + "|".join(marks) + "|"
    return "\n".join([md_row(header), rule, *(md_row(r) for r in rows)])


# --------------------------------------------------------------------------------------------------- machine


def parse_cpuinfo(text: str) -> dict[str, str]:
    """/proc/cpuinfo's fields of its first processor ("model name", "vendor_id", "cpu family", "model", "flags",
    ...)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if out:
                break
            continue
        key, _, value = line.partition(":")
        out.setdefault(key.strip(), value.strip())
    return out


def parse_lscpu(text: str) -> dict[str, str]:
    """lscpu's `Key: value` lines, named as /proc/cpuinfo names them where it has the field ("Model name" ->
    "model name", "Vendor ID" -> "vendor_id", "CPU family" -> "cpu family", "Model" -> "model", "Flags" ->
    "flags"); the others under lscpu's own name ("Socket(s)", "Core(s) per socket", "CPU(s)", ...)."""
    names = {"Model name": "model name", "Vendor ID": "vendor_id", "CPU family": "cpu family", "Model": "model",
             "Flags": "flags"}
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and value.strip():
            out.setdefault(names.get(key.strip(), key.strip()), value.strip())
    return out


def cpu_fields() -> dict[str, str]:
    """This machine's CPU as parse_cpuinfo gives it, with lscpu's fields where /proc/cpuinfo has none (other
    systems, or an architecture whose cpuinfo names no model)."""
    try:
        fields = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        fields = {}
    if "model name" not in fields:
        try:
            text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False,
                                  env={**os.environ, "LC_ALL": "C"}).stdout
        except OSError:
            text = ""
        fields = {**parse_lscpu(text), **fields}
    return fields


def cpu_model(fields: dict[str, str] | None = None) -> str:
    """The CPU's model name (platform.processor() where none is known, "unknown CPU" where that is empty)."""
    fields = cpu_fields() if fields is None else fields
    return fields.get("model name") or platform.processor() or "unknown CPU"


def cpu_ids(fields: dict[str, str] | None = None) -> str:
    """The vendor, family and model numbers: "AuthenticAMD family 25 model 17"."""
    fields = cpu_fields() if fields is None else fields
    ids = " ".join(f"{k.replace('cpu ', '')} {fields[k]}" for k in ("cpu family", "model") if k in fields)
    return f"{fields.get('vendor_id', '?')} {ids}".strip()


def simd(fields: dict[str, str]) -> str:
    flags = set(fields.get("flags", "").split())
    return ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags) or "no AVX2"


def machine(fields: dict[str, str] | None = None) -> str:
    """"MODEL NAME, C cores / L logical CPUs (SIMD), R GiB RAM" (psutil's counts)."""
    import psutil

    fields = cpu_fields() if fields is None else fields
    name = fields.get("model name", "unknown CPU")
    ram = psutil.virtual_memory().total / 2**30
    return (f"{name}, {psutil.cpu_count(logical=False)} cores / {os.cpu_count()} logical CPUs ({simd(fields)}), "
            f"{ram:.1f} GiB RAM")


def moerun_commit() -> str:
    """`git describe --always --dirty` of this checkout ("unknown" outside one)."""
    try:
        return subprocess.run(["git", "-C", str(HERE), "describe", "--always", "--dirty"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_header(threads: int | str, argv: Sequence[str] | None = None, fields: dict[str, str] | None = None,
                   commit: str | None = None, day: str | None = None) -> str:
    """A result's first line: the CPU, its cores, the threads used, the commit, the date and the command."""
    fields = cpu_fields() if fields is None else fields
    line = (f"Machine: {cpu_model(fields)} ({cpu_ids(fields)}; {os.cpu_count()} logical CPUs), {threads} threads; "
            f"moerun commit {commit or moerun_commit()}; {day or date.today().isoformat()}.")
    if argv is not None:
        line += f" Run: `{shlex.join(['python', *argv])}`."
    return line


# ---------------------------------------------------------------------------------------------- subprocesses


def moerun_cmd(*args: str) -> list[str]:
    """The command line of `moerun ARGS` with this Python."""
    return [sys.executable, "-m", "moerun", *map(str, args)]


def moerun(*args: str, env: dict | None = None, out: Path | None = None) -> str:
    """`moerun ARGS`'s standard output (also written to `out`); env: added to this process's. Exits the script with
    the tail of its standard error when it fails."""
    r = subprocess.run(moerun_cmd(*args), capture_output=True, text=True, env={**os.environ, **(env or {})},
                       check=False)
    if r.returncode:
        sys.exit(f"moerun {' '.join(map(str, args))} failed:\n{r.stderr[-2000:]}")
    if out is not None:
        out.write_text(r.stdout)
    return r.stdout


def run_json(cmd: list[str], env: dict | None = None, timeout: float | None = 3600, echo: bool = True):
    """The JSON a command prints (its line `$ CMD` on stderr first, unless echo is off); RuntimeError with the tail
    of its standard error when it fails."""
    if echo:
        print(f"$ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout,
                       env=None if env is None else {**os.environ, **env})
    if p.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout)


# ---------------------------------------------------------------------------------------------------- server


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Reply:
    status: int
    text: str
    headers: dict = field(default_factory=dict)

    def json(self):
        return json.loads(self.text)


class ServerProcess:
    """`python -m moerun serve --port P [--api-key KEY] ARGS` on a free loopback port, ready once /health says 200;
    every /health answer until then is in `health` as (status, body). log_path: the server's output (None: none
    kept). launcher: what runs moerun's command line instead of `-m moerun` (e.g. `-c CODE`). Stopped by its
    PID (stop(): SIGTERM, then its exit status)."""

    def __init__(self, args: Sequence[str], log_path: Path | None = None, key: str | None = None,
                 wait: float = 300, launcher: tuple[str, ...] = ("-m", "moerun"), poll: float = 0.05):
        self.port, self.key, self.log_path = free_port(), key, log_path
        self.cmd = [sys.executable, *launcher, "serve", "--port", str(self.port),
                    *(["--api-key", key] if key is not None else []), *map(str, args)]
        self.health: list[tuple[int, object]] = []
        if log_path is None:
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        else:
            with open(log_path, "w") as log:
                self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + wait
        while time.time() < deadline and self.proc.poll() is None:
            try:
                r = self.request("GET", "/health", timeout=30)
            except OSError:
                time.sleep(poll)
                continue
            self.health.append((r.status, _json_or_text(r.text)))
            if r.status == 200:
                return
            time.sleep(poll)
        self.stop()
        log = log_path.read_text() if log_path is not None else ""
        raise RuntimeError(f"the server did not start: {shlex.join(self.cmd)}\n{log}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def connect(self, method: str, path: str, body=None, key: str | None = None, timeout: float = 300):
        """The request sent on a new connection (the caller reads the response and closes it)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        headers = {"Authorization": f"Bearer {key or self.key}"} if (key or self.key) else {}
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        if body is not None:
            headers["Content-Type"] = "application/json"
        conn.request(method, path, body=body, headers=headers)
        return conn

    def request(self, method: str, path: str, body=None, key: str | None = None, timeout: float = 300) -> Reply:
        conn = self.connect(method, path, body, key, timeout)
        try:
            r = conn.getresponse()
            return Reply(r.status, r.read().decode(), dict(r.getheaders()))
        finally:
            conn.close()

    def rss(self) -> int:
        """The server process's resident memory, bytes."""
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics (gauges and counters without labels)."""
        out = {}
        for line in self.request("GET", "/metrics").text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM to the server's PID (unless it has exited), then its exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(timeout=timeout)


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


# ---------------------------------------------------------------------------------------------------- output


def write_json(path: Path, obj, indent: int | None = 1) -> str:
    """obj as JSON into path (its text returned)."""
    text = json.dumps(obj, indent=indent)
    Path(path).write_text(text)
    return text


def append_jsonl(path: str | Path, obj) -> None:
    """obj as one JSON line at the end of path."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(obj) + "\n")


def dated_heading(title: str, day: str | None = None) -> str:
    """A journal section's heading: "## YYYY-MM-DD — title"."""
    return f"## {day or date.today().isoformat()} — {title}"


def append_section(text: str, path: Path = RESULTS) -> None:
    """Append a results section (its own paragraph) to a journal file, bench/RESULTS.md by default."""
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n" + text)
    print(f"appended to {path}", file=sys.stderr)


def publish(text: str, append: bool, path: Path = RESULTS) -> None:
    """Print a section, and append it to the journal file with --append."""
    print(text)
    if append:
        append_section(text, path)
