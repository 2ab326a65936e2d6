"""Expert parallelism on one machine (issue 40): `moerun bench` over 2 processes x 1 thread (EP over gloo on
loopback) against 1 process x 2 threads, prefill (ppN) and decode (tgN), alternating, medians of the rounds.

    python bench/ep_bench.py ~/.cache/moerun/bench-models/a3b-L12-Q4_K_M.gguf -p 128 -n 64 --rounds 4 [--out DIR]

One machine shares one memory bus, so this measures what expert parallelism costs, not what it gains. Besides t/s
each EP run reports the milliseconds a step spends in the all-gathers (bench's `ep_gather_ms`, per rank: the wait
for the slower rank's part included), and the link is probed before and after the rounds: two processes joined
as the ranks are (moerun.distributed.Link, gloo) time a message's round trip, the runtime's all-gather
(Link.all_gather) of 8 bytes (the cost model's per-message latency), of one token's hidden state, and of 16 MiB
(the bandwidth), each call right after the last ("back to back"); then an all-gather of 8 bytes after each rank
has done as much work as a decode step does between two MoE layers ("spaced": matmuls that take the estimate's
EP compute time over the MoE layers when undisturbed; a rank preempted meanwhile arrives late, as in a step), as
a step's all-gathers come, and gloo's own all-gather collective the same way, for comparison. On a VM a waiting process's idle vCPU is slow to wake, so back to back and spaced differ. `moerun
estimate -t 1 --expert-parallel 2 --link-gbps G --link-latency-us L` with each latency is the prediction set
beside the EP runs. The 1-minute load is read before and after every run.

bench/ep_netns.py runs the same pieces across two network namespaces joined by a rate-limited veth pair.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import toolkit as tk

PROBE_CALLS = 400  # per timed batch of the link probe; 5 batches, the median taken


# ------------------------------------------------------------------------------------------------ the link probe


def probe_rank(rank: int, addr: str, port: int, hidden: int, gap_s: float) -> None:
    """One side of the link probe (`python bench/ep_bench.py probe RANK ADDR PORT HIDDEN GAP_S`); rank 0 prints
    JSON: seconds of a round trip of 8 bytes, of Link.all_gather of 8 bytes, of `hidden` float32s, of 16 MiB, back to
    back; and of Link.all_gather of 8 bytes, a round trip and gloo's all-gather collective each after a fixed
    amount of work (one-thread matmuls that take `gap_s` seconds undisturbed: a rank that is preempted finishes it
    late, as a step's layer does, where a clock-bounded spin would hide that)."""
    import torch
    import torch.distributed as dist

    from moerun.distributed import Link

    link = Link(rank, 2, 120.0, addr, port, "gloo", name="probe")
    word = torch.zeros(1, dtype=torch.int64)

    def round_trip() -> None:
        if rank == 0:
            dist.send(word, 1)
            dist.recv(word, 1)
        else:
            dist.recv(word, 0)
            dist.send(word, 0)

    def gather(t):
        return lambda: link.all_gather(t, "probing")

    def collective(t):
        parts = [torch.empty_like(t) for _ in range(2)]
        return lambda: dist.all_gather(parts, t)

    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    t0 = time.perf_counter()
    for _ in range(50):
        a @ b
    work = max(1, round(gap_s / ((time.perf_counter() - t0) / 50))) if gap_s else 0  # matmuls of about gap_s

    def per_call(fn, calls: int, spaced: bool = False) -> float:
        batches = []
        for _ in range(6):
            dist.barrier()
            spent = 0.0
            for _ in range(calls):
                for _ in range(work if spaced else 0):
                    a @ b
                t0 = time.perf_counter()
                fn()
                spent += time.perf_counter() - t0
            batches.append(spent / calls)
        return statistics.median(batches[1:])  # the first warms up

    big = torch.zeros(4 << 20, dtype=torch.float32)
    out = {"round_trip_s": per_call(round_trip, PROBE_CALLS), "gather_8b_s": per_call(gather(word), PROBE_CALLS),
           "gather_hidden_s": per_call(gather(torch.zeros(1, hidden)), PROBE_CALLS),
           "gather_16mib_s": per_call(gather(big), 8), "hidden": hidden, "big_bytes": big.numel() * 4,
           "gap_s": gap_s, "gather_spaced_s": per_call(gather(word), PROBE_CALLS // 4, True),
           "round_trip_spaced_s": per_call(round_trip, PROBE_CALLS // 4, True),
           "collective_spaced_s": per_call(collective(word), PROBE_CALLS // 4, True)}
    out["gbits"] = out["big_bytes"] * 8 / (out["gather_16mib_s"] - out["gather_8b_s"]) / 1e9
    link.close()
    if rank == 0:
        print(json.dumps(out))


def run_together(cmds: Sequence[Sequence[str]], what: str, timeout: float = 3600) -> list[str]:
    """Start the commands (the last first: rank 0 is cmds[0]) and wait for all -> their standard outputs; when one
    fails, the others (started here) are killed and RuntimeError carries its standard error's tail."""
    with tempfile.TemporaryDirectory() as tmp:
        outs, errs = [Path(tmp, f"{k}.out") for k in range(len(cmds))], [Path(tmp, f"{k}.err") for k in range(len(cmds))]
        procs: list[subprocess.Popen | None] = [None] * len(cmds)
        for k in reversed(range(len(cmds))):
            with open(outs[k], "w") as o, open(errs[k], "w") as e:
                procs[k] = subprocess.Popen(cmds[k], stdout=o, stderr=e)
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            failed = [k for k, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                k = failed[0] if failed else 0
                raise RuntimeError(f"{what}, rank {k}: {'failed' if failed else 'timed out'}:\n"
                                   f"{errs[k].read_text()[-3000:]}")
            time.sleep(0.2)
        bad = [k for k, p in enumerate(procs) if p.returncode]
        if bad:
            raise RuntimeError(f"{what}, rank {bad[0]} failed:\n{errs[bad[0]].read_text()[-3000:]}")
        return [o.read_text() for o in outs]


def probe_link(addr: str, port: int, hidden: int, gap_s: float, prefixes: Sequence[Sequence[str]] = ((), ())) -> dict:
    """The link probe's figures (probe_rank), its two processes started with prefixes[rank] (e.g. `ip netns exec
    NS env GLOO_SOCKET_IFNAME=DEV`)."""
    me = str(Path(__file__).resolve())
    cmds = [[*prefixes[r], sys.executable, me, "probe", str(r), addr, str(port), str(hidden), repr(gap_s)]
            for r in (0, 1)]
    return json.loads(run_together(cmds, "link probe", timeout=600)[0])


# ---------------------------------------------------------------------------------------------------- the runs


def load1() -> float:
    return os.getloadavg()[0]


def bench_records(out: str) -> dict[str, dict]:
    """bench's JSON Lines -> {"pp": record, "tg": record}."""
    recs = [json.loads(line) for line in out.splitlines() if line.strip()]
    return {("tg" if r["n_gen"] else "pp"): r for r in recs}


def run_ranks(args: Sequence[str], world: int, kind: str, addr: str, port: int,
              prefixes: Sequence[Sequence[str]] | None = None, timeout: float = 3600) -> dict[str, dict]:
    """`moerun bench ARGS` over `world` processes ("ep": --ep-rank, "pipeline": --pipeline-rank), rank r started
    with prefixes[r]; rank 0's records."""
    prefixes = prefixes or [()] * world
    flag = {"ep": "--ep", "pipeline": "--pipeline"}[kind]
    common = [f"{flag}-world-size", str(world), "--master-addr", addr, "--master-port", str(port),
              f"{flag}-timeout", "300"]
    cmds = [[*prefixes[r], *tk.moerun_cmd("bench", *args, *common, f"{flag}-rank", str(r), "-o", "jsonl")]
            for r in range(world)]
    print(f"$ {shlex.join(cmds[0])}", file=sys.stderr, flush=True)
    return bench_records(run_together(cmds, f"bench over {kind} ranks", timeout)[0])


def run_one(args: Sequence[str], prefix: Sequence[str] = ()) -> dict[str, dict]:
    """`moerun bench ARGS` in one process (started with `prefix`)."""
    cmd = [*prefix, *tk.moerun_cmd("bench", *args, "-o", "jsonl")]
    print(f"$ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if p.returncode:
        raise RuntimeError(f"bench failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return bench_records(p.stdout)


def figures(recs: dict[str, dict], load: tuple[float, float]) -> dict:
    """One run's t/s per test, the all-gathers' ms a step per rank (EP across processes), the load around it."""
    out = {"load": load}
    for test, rec in recs.items():
        out[f"{test}_ts"] = rec["avg_ts"]
        out[f"{test}_gather_ms"] = rec.get("ep_gather_ms")
        out[f"{test}_gathers"] = rec.get("ep_gathers")
    return out


def estimate(model: str, threads: int, n_prompt: int, gbits: float | None = None, latency_s: float = 0.0,
             ranks: int = 2) -> dict:
    """`moerun estimate --json` for `threads` threads; given a link, with --expert-parallel over it."""
    cmd = tk.moerun_cmd("estimate", model, "-t", str(threads), "-p", str(n_prompt), "--json", "--no-progress")
    if gbits is not None:
        cmd += ["--expert-parallel", str(ranks), "--link-gbps", f"{gbits:.3f}", "--link-latency-us",
                f"{latency_s * 1e6:.1f}"]
    return tk.run_json(cmd)


def step_gap(model: str, n_prompt: int) -> tuple[float, int]:
    """(seconds a decode step of 2 ranks x 1 thread computes between two MoE layers, MoE layers), by the
    estimate."""
    from moerun.arch import resolve
    from moerun.formats import open_model

    with open_model(model) as mf:
        spec = resolve(mf).spec
    ep = estimate(model, 1, n_prompt, 10.0)["hosts"]["expert_parallel"]
    moe = sum(spec.moe_layers)
    return ep["compute_s"] / moe, spec.hidden


def med(rounds: list[dict], key: str, index: int | None = None) -> float | None:
    vals = [r[key] if index is None else r[key][index] for r in rounds if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def link_line(link: dict) -> str:
    return (f"back to back: round trip {link['round_trip_s'] * 1e6:.0f} us, all-gather of 8 bytes "
            f"{link['gather_8b_s'] * 1e6:.0f} us, of one token's hidden state ({link['hidden']} x 4 bytes) "
            f"{link['gather_hidden_s'] * 1e6:.0f} us, of 16 MiB {link['gather_16mib_s'] * 1e3:.1f} ms "
            f"({link['gbits']:.2f} Gbit/s); spaced by {link['gap_s'] * 1e3:.2f} ms of work: all-gather of 8 bytes "
            f"{link['gather_spaced_s'] * 1e6:.0f} us, round trip {link['round_trip_spaced_s'] * 1e6:.0f} us"
            + ("" if "collective_spaced_s" not in link else
               f", gloo's all-gather collective {link['collective_spaced_s'] * 1e6:.0f} us"))


def mean_link(probes: list[dict]) -> dict:
    return {k: statistics.mean(p[k] for p in probes) for k in probes[0]}


def main() -> None:
    p = tk.add(tk.parser(__doc__, "paragraph"), "model", "--rounds")
    p.add_argument("-p", "--n-prompt", type=int, default=128)
    p.add_argument("-n", "--n-gen", type=int, default=64)
    p.add_argument("-r", "--repetitions", type=int, default=3, help="bench's timed runs per test")
    p.add_argument("--port", type=int, default=29650)
    p.add_argument("--out", type=Path, default=None, help="write every round's figures here (JSON)")
    a = p.parse_args()
    gap, hidden = step_gap(a.model, a.n_prompt)
    probes = [probe_link("127.0.0.1", a.port, hidden, gap)]
    print("loopback: " + link_line(probes[0]), file=sys.stderr, flush=True)
    common = ["-m", a.model, "-p", str(a.n_prompt), "-n", str(a.n_gen), "-r", str(a.repetitions), "--no-progress"]
    ports = iter(range(a.port + 2, a.port + 1000, 2))

    def run(name: str, r: int) -> dict:
        before = load1()
        if name == "1 process x 2 threads":
            recs = run_one([*common, "-t", "2"])
        else:
            recs = run_ranks([*common, "-t", "1"], 2, "ep", "127.0.0.1", next(ports))
        return figures(recs, (before, load1()))

    names = ["1 process x 2 threads", "2 processes x 1 thread (EP)"]
    rounds = tk.alternate(names, a.rounds, run, rotate=True,
                          each=lambda n, r, f: print(f"round {r} {n}: pp {f['pp_ts']:.1f} t/s, tg {f['tg_ts']:.1f} "
                                                     f"t/s, load {f['load'][0]:.2f}-{f['load'][1]:.2f}",
                                                     file=sys.stderr, flush=True))
    probes.append(probe_link("127.0.0.1", a.port + 1, hidden, gap))
    print("loopback after: " + link_line(probes[1]), file=sys.stderr, flush=True)
    link = mean_link(probes)
    one, ep = rounds[names[0]], rounds[names[1]]
    est = {how: estimate(a.model, 1, a.n_prompt, link["gbits"], link[key])["hosts"]
           for how, key in (("back to back", "gather_8b_s"), ("spaced", "gather_spaced_s"))}
    est_one = estimate(a.model, 2, a.n_prompt)
    result = {"model": a.model, "probes": probes, "link": link, "rounds": rounds, "estimate_ep": est,
              "estimate_one": {"decode": est_one["decode"]["expected_tok_s"], "prefill": est_one["prefill"]["tok_s"]}}
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        tk.write_json(a.out / "ep_bench.json", result)
    print(tk.machine_header("1 x 2 against 2 x 1", sys.argv))
    print(f"\nloopback (gloo), before the rounds: {link_line(probes[0])}; after: {link_line(probes[1])}\n")
    rows = []
    for test, key in (("pp", "prefill_tok_s"), ("tg", "tok_s")):
        m1, m2 = med(one, f"{test}_ts"), med(ep, f"{test}_ts")
        ratio = tk.pair_ratio([r[f"{test}_ts"] for r in ep], [r[f"{test}_ts"] for r in one])
        g0, g1 = med(ep, f"{test}_gather_ms", 0), med(ep, f"{test}_gather_ms", 1)
        e1, e2 = (est[how]["expert_parallel"][key] for how in ("back to back", "spaced"))
        name = f"pp{a.n_prompt}" if test == "pp" else f"tg{a.n_gen}"
        rows.append([name, f"{m1:.1f}", f"{m2:.1f}", f"{ratio:.2f}x", f"{g0:.2f} / {g1:.2f}",
                     f"{e1:.1f} ({m2 / e1:.2f})", f"{e2:.1f} ({m2 / e2:.2f})"])
    print(tk.md_table(["test", "1 x 2 t/s", "EP 2 x 1 t/s", "EP / 1 x 2", "all-gathers ms a step, rank 0 / 1",
                       "estimate, latency back to back (measured / it)", "estimate, latency spaced (measured / it)"],
                      rows, "lrrrrrr"))
    loads = [x for r in one + ep for x in r["load"]]
    print(f"\n1-minute load {min(loads):.2f}-{max(loads):.2f}; {a.rounds} rounds, medians. Estimates: `moerun "
          f"estimate -t 1 --expert-parallel 2 --link-gbps {link['gbits']:.3f} --link-latency-us L` with L = "
          f"{link['gather_8b_s'] * 1e6:.1f} us (back to back) or {link['gather_spaced_s'] * 1e6:.1f} us (spaced "
          f"by {gap * 1e3:.2f} ms): decode compute {est['spaced']['expert_parallel']['compute_s'] * 1e3:.2f} ms + "
          f"link {est['back to back']['expert_parallel']['comm_s'] * 1e3:.2f} / "
          f"{est['spaced']['expert_parallel']['comm_s'] * 1e3:.2f} ms; one host, -t 2: decode "
          f"{result['estimate_one']['decode']:.1f}, prefill {result['estimate_one']['prefill']:.1f} t/s")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "probe":
        probe_rank(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]))
    else:
        main()
