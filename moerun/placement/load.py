"""The machine's load while a probe runs, and whether the probe's figure can be trusted (issue 39, item 5).

A probe's figure (GB/s, FLOP/s, seconds a layer) is lowered by whatever else the cores do meanwhile: a host read
probe taken beside two busy processes read 18.8 GB/s where a quiet one reads 34.6. Each probe therefore records,
beside its figure in `$MOERUN_CACHE/hardware.json`:

    "load": {"others_cores": 0.04, "own_cores": 1.93, "loadavg_before": 0.81, "loadavg_after": 1.02,
             "seconds": 2.6, "cpus": 2},
    "spread": 0.03, "trusted": true, "why": "quiet"

- `others_cores`: the CPU time every other process used during the probe, in cores (CPU seconds per second of
  wall time): /proc/stat's busy time of all CPUs (user, nice, system, irq, softirq) minus this process's own
  (/proc/self/stat's utime + stime, every thread). `own_cores` is this process's. Where /proc is missing, psutil's
  counters give the same; with neither the load is unknown (None).
- `loadavg_before` / `loadavg_after`: /proc/loadavg's one-minute average, recorded and not judged: it lags by a
  minute, so processes that ended just before a probe still weigh in it, and this process's own threads count.
- `spread`: the interquartile range of the probe's repeated passes over their median (`spread()`; None for a
  probe of one pass).

A probe is untrusted (`"trusted": false`, `why` says which) when other processes used more than BUSY_CORES of a
core during it, or its spread is above WIDE_SPREAD. An untrusted figure is still used, with a warning, and is
measured again the next time a probe may run and the machine is quiet (`quiet_now()`: the others' CPU time
over QUIET_WINDOW_S). An entry written before these keys existed has no "trusted" key: it is read as trusted,
its load unknown (`trusted()`, `describe()` says "load not recorded").
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self

BUSY_CORES = 0.25  # other processes' CPU time during a probe, in cores, above which it is taken under load
WIDE_SPREAD = 0.25  # interquartile range over median of a probe's passes above which it is too noisy to trust
QUIET_WINDOW_S = 0.2  # how long quiet_now() watches the machine before a cached figure is measured again


@dataclass(frozen=True)
class Sample:
    """One reading of the machine's counters: monotonic seconds, CPU seconds busy on all CPUs and used by this
    process (None where unknown), the one-minute load average (None where unknown)."""

    t: float
    busy_s: float | None
    own_s: float | None
    loadavg: float | None


def _tick() -> float:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):
        return 100.0


def _proc_busy() -> float | None:
    """Busy CPU seconds of all CPUs since boot from /proc/stat (user, nice, system, irq, softirq; guest time is
    inside user), None without /proc."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    vals = [int(x) for x in fields[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = vals + [0] * (7 - len(vals))
    return (user + nice + system + irq + softirq) / _tick()


def _proc_own() -> float | None:
    """This process's CPU seconds (utime + stime, all threads) from /proc/self/stat, None without /proc."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    rest = text[text.rfind(")") + 2:].split()  # the command name may hold spaces: fields after its ')'
    return (int(rest[11]) + int(rest[12])) / _tick()


def _psutil_counters() -> tuple[float | None, float | None]:
    try:
        import psutil
    except ImportError:
        return None, None
    c = psutil.cpu_times()
    busy = sum(getattr(c, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq"))
    own = psutil.Process().cpu_times()
    return busy, own.user + own.system


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def read() -> Sample:
    """The machine's counters now (/proc, else psutil)."""
    busy, own = _proc_busy(), _proc_own()
    if busy is None or own is None:
        busy, own = _psutil_counters()
    return Sample(time.monotonic(), busy, own, _loadavg())


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def between(a: Sample, b: Sample) -> dict:
    """The load from reading `a` to reading `b` (the module docstring's "load" record)."""
    dt = max(b.t - a.t, 1e-9)
    known = None not in (a.busy_s, b.busy_s, a.own_s, b.own_s)
    own = (b.own_s - a.own_s) / dt if known else None
    others = max((b.busy_s - a.busy_s) / dt - own, 0.0) if known else None
    return {"others_cores": None if others is None else round(others, 3),
            "own_cores": None if own is None else round(own, 3),
            "loadavg_before": _round(a.loadavg), "loadavg_after": _round(b.loadavg), "seconds": round(dt, 3),
            "cpus": os.cpu_count()}


class Watch:
    """`with Watch() as w: probe()` -> w.load, the load during the block (between())."""

    def __enter__(self) -> Self:
        self.start, self.load = read(), None
        return self

    def __exit__(self, *exc) -> None:
        self.load = between(self.start, read())


def quiet_now(seconds: float = QUIET_WINDOW_S) -> dict:
    """The load over the next `seconds` (this process sleeping): the machine as a probe started now would find
    it. is_quiet() judges it."""
    a = read()
    time.sleep(seconds)
    return between(a, read())


def is_quiet(load: dict | None) -> bool:
    """Other processes used at most BUSY_CORES of a core (an unknown load counts as quiet)."""
    others = (load or {}).get("others_cores")
    return others is None or others <= BUSY_CORES


def spread(samples: Sequence[float] | None) -> float | None:
    """Interquartile range over median of a probe's passes (rates or times alike); None for fewer than 2. Not
    the full range: one pass that meets a page fault or a timer tick would set that alone."""
    xs = [float(x) for x in samples or () if x is not None]
    if len(xs) < 2:
        return None
    mid = statistics.median(xs)
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return round((q3 - q1) / mid, 4) if mid > 0 else None


def judge(load: dict | None, spread_: float | None) -> dict:
    """{"trusted": bool, "why": str} for a probe taken under `load` with this spread."""
    others = (load or {}).get("others_cores")
    whys = []
    if others is not None and others > BUSY_CORES:
        whys.append(f"under load (other processes used {others:.1f} cores)")
    if spread_ is not None and spread_ > WIDE_SPREAD:
        whys.append(f"with a wide spread over its passes ({spread_:.0%})")
    return {"trusted": not whys, "why": "; ".join(whys) if whys else "quiet"}


def mark(entry: dict, load: dict | None, spread_: float | None = None) -> dict:
    """`entry` with the load, spread and verdict added (the module docstring's keys)."""
    return {**entry, "load": load, "spread": spread_, **judge(load, spread_)}


def why_all(entries: Sequence[dict]) -> str:
    """One reason for several untrusted entries: "under load (other processes used up to 1.6 cores)", "with a
    wide spread over their passes (up to 68%)", or both."""
    busy = [e["load"]["others_cores"] for e in entries if isinstance(e.get("load"), dict)
            and isinstance(e["load"].get("others_cores"), (int, float)) and e["load"]["others_cores"] > BUSY_CORES]
    wide = [e["spread"] for e in entries if isinstance(e.get("spread"), (int, float)) and e["spread"] > WIDE_SPREAD]
    parts = ([f"under load (other processes used up to {max(busy):.1f} cores)"] if busy else []) + \
        ([f"with a wide spread over their passes (up to {max(wide):.0%})"] if wide else [])
    return " and ".join(parts) or "untrusted"


def trusted(entry: dict | None) -> bool:
    """False only for an entry marked untrusted; one without the key (an older cache) counts as trusted."""
    return not (isinstance(entry, dict) and entry.get("trusted") is False)


def age_s(entry: dict, now: datetime | None = None) -> float | None:
    """Seconds since the entry's `measured_at`, None where it has none or it does not parse."""
    try:
        at = datetime.fromisoformat(str(entry.get("measured_at")))
    except ValueError:
        return None
    if at.tzinfo is None:
        at = at.replace(tzinfo=timezone.utc)
    return ((now or datetime.now(timezone.utc)) - at).total_seconds()


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "at an unknown time"
    if seconds >= 86400:
        n = round(seconds / 86400)
        return f"{n} day{'' if n == 1 else 's'} ago"
    if seconds >= 3600:
        return f"{seconds / 3600:.0f} h ago"
    if seconds >= 60:
        return f"{seconds / 60:.0f} min ago"
    return "just now"


def describe(entry: dict, now: datetime | None = None) -> str:
    """"probed 3 h ago, quiet (spread 4%)", "probed 2 min ago under load (other processes used 1.6 cores)",
    "probed 5 days ago (load not recorded)"; a figure a run raised (bandwidth.raise_to_floor): "read by moerun
    bench tg128 (bytes per token x t/s), 1 h ago"."""
    ago = _ago(age_s(entry, now))
    if entry.get("floor"):
        return f"read by {entry.get('method') or 'a run'}, {ago}"
    sp = entry.get("spread")
    sp_text = f" (spread {sp:.0%})" if isinstance(sp, (int, float)) else ""
    if "trusted" not in entry:
        return f"probed {ago} (load not recorded)"
    if entry["trusted"] is False:
        return f"probed {ago} {entry.get('why') or 'under load'}"
    return f"probed {ago}, {entry.get('why') or 'quiet'}{sp_text}"


def note(label: str, entry: dict | None, rerun: str) -> str:
    """One line for a figure a command uses: "host read 34.6 GB/s, probed 3 h ago, quiet (spread 4%)"; for an
    untrusted one, `rerun` follows ("... under load (other processes used 1.6 cores): re-run with --measure when
    quiet")."""
    if entry is None:
        return f"{label}, not measured (a built-in default)"
    line = f"{label}, {describe(entry)}"
    return line if trusted(entry) else f"{line}: {rerun}"
