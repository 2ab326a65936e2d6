"""A second host, emulated (issue 40): decode over two processes in separate network namespaces joined by a veth
pair limited to 10 Gbit/s (tc tbf), expert parallelism against a pipeline of 2 stages, beside one process with
one thread, alternating, medians of the rounds; and what `moerun estimate` predicts for both from the link's
measured latency and bandwidth.

    sudo python bench/ep_netns.py ~/.cache/moerun/bench-models/a3b-L12-Q4_K_M.gguf -n 64 --rounds 3 [--out DIR]

Needs root (ip netns, ip link, tc) and iproute2. It creates the namespaces moerun-ep-a and moerun-ep-b, a veth
pair between them (10.231.40.1 and .2, tbf at --rate on both ends), and deletes them when it ends, however it
ends (an error, Ctrl-C, SIGTERM); it refuses to start while namespaces of those names exist. Rank 0 runs in
moerun-ep-a and listens on its veth address (MASTER_ADDR), rank 1 in moerun-ep-b, each told its veth device by
GLOO_SOCKET_IFNAME (else gloo takes the hostname's address, loopback here); each process has 1 thread.

The kernel here has no netem delay, so the link's latency is what it measures: bench/ep_bench.py's probe across
the pair (a round trip, all-gathers back to back, of 16 MiB for the bandwidth, and spaced by a decode step's work
between two MoE layers). Both namespaces share this machine's cores and memory bus: this measures the link's
cost, not a second host's bandwidth. The 1-minute load is read before and after every run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import toolkit as tk
from ep_bench import (
    estimate,
    figures,
    link_line,
    load1,
    mean_link,
    med,
    probe_link,
    run_one,
    run_ranks,
    step_gap,
)

NAMESPACES = ("moerun-ep-a", "moerun-ep-b")
VETH = ("mrep-a", "mrep-b")
ADDRS = ("10.231.40.1", "10.231.40.2")


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def existing() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    return [ns for ns in NAMESPACES if any(line.split()[0] == ns for line in out.splitlines() if line.strip())]


def set_up(rate: str, burst: str) -> None:
    """The namespaces, the veth pair between them with an address and tbf at each end, loopback up in each."""
    for ns in NAMESPACES:
        ip("netns", "add", ns)
    ip("link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
    for ns, dev, addr in zip(NAMESPACES, VETH, ADDRS):
        ip("link", "set", dev, "netns", ns)
        ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        ip("-n", ns, "link", "set", dev, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                        "latency", "10ms"], check=True, capture_output=True, text=True)


def tear_down() -> list[str]:
    """Delete the namespaces this script made (their veth ends go with them) -> the ones that would not go."""
    left = []
    for ns in NAMESPACES:
        r = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True, check=False)
        if r.returncode and "No such file" not in r.stderr:
            left.append(f"{ns}: {r.stderr.strip()}")
    return left


def qdisc_line() -> str:
    return subprocess.run(["tc", "-n", NAMESPACES[0], "qdisc", "show", "dev", VETH[0]], capture_output=True,
                          text=True, check=False).stdout.strip()


def main() -> None:
    p = tk.add(tk.parser(__doc__, "paragraph"), "model", "--rounds")
    p.add_argument("-n", "--n-gen", type=int, default=64)
    p.add_argument("-r", "--repetitions", type=int, default=3, help="bench's timed runs per test")
    p.add_argument("--rate", default="10gbit", help="tbf's rate at each end of the pair")
    p.add_argument("--burst", default="4mb", help="tbf's burst")
    p.add_argument("--port", type=int, default=29750)
    p.add_argument("--out", type=Path, default=None, help="write every round's figures here (JSON)")
    a = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/ep_netns.py needs root: it creates network namespaces, a veth pair and a tc qdisc")
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        sys.exit(f"bench/ep_netns.py needs iproute2 ({', '.join(missing)} not found)")
    if existing():
        sys.exit(f"namespaces {', '.join(existing())} exist: another run of this script, or one that was killed "
                 f"(remove them with `ip netns del NAME` if no run is going on)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))
    try:
        set_up(a.rate, a.burst)
        result = measure(a)
    finally:
        left = tear_down()
        print("namespaces removed" if not left else "could not remove: " + "; ".join(left), file=sys.stderr)
    report(a, result)


def measure(a) -> dict:
    """The link probes (before and after the rounds) and the alternating rounds."""
    prefixes = [["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={dev}"] for ns, dev in zip(NAMESPACES, VETH)]
    qdisc = qdisc_line()
    print(f"link: {qdisc}", file=sys.stderr, flush=True)
    gap, hidden = step_gap(a.model, 128)
    probes = [probe_link(ADDRS[0], a.port, hidden, gap, prefixes)]
    print("veth: " + link_line(probes[0]), file=sys.stderr, flush=True)
    common = ["-m", a.model, "-p", "0", "-n", str(a.n_gen), "-r", str(a.repetitions), "-t", "1", "--no-progress"]
    ports = iter(range(a.port + 2, a.port + 1000))

    def run(name: str, r: int) -> dict:
        before = load1()
        if name == "one process":
            recs = run_one(common, prefixes[0])
        else:
            recs = run_ranks(common, 2, "ep" if name == "expert parallel" else "pipeline", ADDRS[0], next(ports),
                             prefixes)
        return figures(recs, (before, load1()))

    names = ["one process", "expert parallel", "pipeline"]
    rounds = tk.alternate(names, a.rounds, run, rotate=True,
                          each=lambda n, r, f: print(f"round {r} {n}: tg {f['tg_ts']:.1f} t/s, load "
                                                     f"{f['load'][0]:.2f}-{f['load'][1]:.2f}", file=sys.stderr,
                                                     flush=True))
    probes.append(probe_link(ADDRS[0], a.port + 1, hidden, gap, prefixes))
    print("veth after: " + link_line(probes[1]), file=sys.stderr, flush=True)
    return {"qdisc": qdisc, "probes": probes, "rounds": rounds, "gap": gap}


LATENCIES = {"one-way message": lambda link: link["round_trip_spaced_s"] / 2,
             "all-gather": lambda link: link["gather_spaced_s"]}


def report(a, result: dict) -> None:
    """The table: measured decode against the estimate with each latency (both spaced by a step's work)."""
    link = mean_link(result["probes"])
    est = {how: estimate(a.model, 1, 128, link["gbits"], latency(link))["hosts"] for how, latency in LATENCIES.items()}
    est_one = estimate(a.model, 1, 128)["decode"]["expected_tok_s"]
    result |= {"link": link, "estimate": est, "estimate_one": est_one}
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        tk.write_json(a.out / "ep_netns.json", result)
    rounds = result["rounds"]
    print(tk.machine_header("1 per process", sys.argv))
    p0, p1 = result["probes"]
    print(f"\nveth pair ({result['qdisc']}, at each end); before the rounds: {link_line(p0)}; after: "
          f"{link_line(p1)}\n")
    one = med(rounds["one process"], "tg_ts")
    rows = [["one process, 1 thread", f"{one:.1f}", "1.00x", "-", f"{est_one:.1f} ({one / est_one:.2f})", "-"]]
    for name, key in (("expert parallel", "expert_parallel"), ("pipeline", "pipeline")):
        m = med(rounds[name], "tg_ts")
        ratio = tk.pair_ratio([r["tg_ts"] for r in rounds[name]], [r["tg_ts"] for r in rounds["one process"]])
        gather = "-" if rounds[name][0]["tg_gather_ms"] is None else \
            f"{med(rounds[name], 'tg_gather_ms', 0):.2f} / {med(rounds[name], 'tg_gather_ms', 1):.2f}"
        cells = [f"{est[how][key]['tok_s']:.1f} ({m / est[how][key]['tok_s']:.2f}; link "
                 f"{est[how][key]['comm_s'] * 1e3:.2f} ms)" for how in LATENCIES]
        rows.append([f"{name}, 2 processes x 1 thread", f"{m:.1f}", f"{ratio:.2f}x", gather, *cells])
    print(tk.md_table([f"tg{a.n_gen}", "t/s", "/ one process", "all-gathers ms a step, rank 0 / 1",
                       *(f"estimate, L = {how} (measured / it; its link a step)" for how in LATENCIES)], rows,
                      "lrrrrr"))
    loads = [x for rs in rounds.values() for r in rs for x in r["load"]]
    ls = {how: latency(link) * 1e6 for how, latency in LATENCIES.items()}
    print(f"\n1-minute load {min(loads):.2f}-{max(loads):.2f}; {a.rounds} rounds, medians. Estimates: `moerun "
          f"estimate -t 1 --expert-parallel 2 --link-gbps {link['gbits']:.3f} --link-latency-us L`, L measured "
          f"between the namespaces with {result['gap'] * 1e3:.2f} ms of work before each message (the decode "
          "step's work between two MoE layers): " + ", ".join(f"{how} {v:.1f} us" for how, v in ls.items())
          + "; better for decode: " + ", ".join(f"{est[how]['better']} (L = {how})" for how in LATENCIES))


if __name__ == "__main__":
    main()
