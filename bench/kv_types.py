"""Decode deep in a context with each KV cache type (issue 20, item 4), beside llama.cpp's -ctk / -ctv.

    python bench/kv_types.py MODEL [-d 4096] [-n 32] [-t 2] [--rounds 2] [--llama-bin DIR]

For each type: one runtime (`-ctk T -ctv T`), a prompt of `-d` tokens (the source of a few standard library
modules, cut to length) prefilled, then `-n` greedy tokens timed (decode only); the types take turns within
each round and the medians are reported, with the KV bytes per token the planner counts and the pool's size.
With --llama-bin, llama-bench's `tg N @ dD` (-d D -n N -p 0, flash attention on, which its quantized V cache
needs) for the same types, run after moerun (never together).
"""

from __future__ import annotations

import inspect
import statistics
import textwrap
from pathlib import Path

import torch
from toolkit import add, alternate, parser, run_json

from moerun.config import RuntimeConfig, SamplingParams
from moerun.runtime import build

TYPES = (None, "f16", "q8_0")


def prompt_ids(eng, n: int) -> list[int]:
    import argparse as a
    import json as j
    import textwrap as t

    text = "\n\n".join(inspect.getsource(m) for m in (t, j.decoder, j.encoder, a))
    ids = eng.tokenizer.encode(text)
    while len(ids) < n:
        ids += ids
    return ids[:n]


def run_moerun(args) -> list[dict]:
    rows = {t: {"type": t or "f32 (default)"} for t in TYPES}
    runtimes = {}
    for t in TYPES:
        rt = build(RuntimeConfig(model=args.model, threads=args.threads, ctx_size=args.depth + args.n + 16,
                                 cache_type_k=t, cache_type_v=t))
        runtimes[t] = rt
        rows[t]["kv_bytes_per_token"] = rt.plan.kv_bytes_per_token
        rows[t]["pool_mib"] = rt.engine.pool.nbytes / 2**20
    ids = prompt_ids(runtimes[None].engine, args.depth)
    params = SamplingParams.greedy(max_tokens=args.n, ignore_eos=True)

    def decode(t, _round: int) -> float:
        eng = runtimes[t].engine
        seq = eng.new_sequence()
        gen = eng.generate(ids, params, seq).run()
        seq.free()
        return gen.timings.to_dict()["predicted_per_second"]

    for t, tps in alternate(TYPES, args.rounds, decode, warmup=True).items():  # round 0 warms up
        rows[t]["tps"] = tps
    for rt in runtimes.values():
        rt.close()
    return list(rows.values())


def run_llama(args) -> list[dict]:
    out = []
    for t in ("f16", "q8_0"):
        cmd = [str(Path(args.llama_bin) / "llama-bench"), "-m", args.model, "-t", str(args.threads), "-p", "0",
               "-n", str(args.n), "-d", str(args.depth), "-ctk", t, "-ctv", t, "-fa", "1", "-r", str(args.rounds),
               "-o", "json"]
        rec = run_json(cmd, timeout=1800, echo=False)[0]
        out.append({"type": t, "tps": rec["samples_ts"], "median": statistics.median(rec["samples_ts"])})
    return out


def main() -> None:
    ap = add(parser(__doc__, "all"), "model")
    ap.add_argument("-d", "--depth", type=int, default=4096)
    ap.add_argument("-n", type=int, default=32)
    add(ap, "threads", "--rounds", rounds=2)
    ap.add_argument("--llama-bin")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = run_moerun(args)
    base = statistics.median(rows[0]["tps"])
    print(textwrap.dedent(f"""
        decode of {args.n} tokens after {args.depth} prompt tokens, {args.threads} threads

        | KV type | decode t/s (runs) | median | vs f32 | KV bytes per token (planner) | KV pool |
        |---|---|---:|---:|---:|---:|"""))
    for row in rows:
        med = statistics.median(row["tps"])
        print(f"| moerun {row['type']} | {', '.join(f'{x:.1f}' for x in row['tps'])} | {med:.1f} | "
              f"{med / base:.2f}x | {row['kv_bytes_per_token']:,} | {row['pool_mib']:.1f} MiB |")
    if args.llama_bin:
        for row in run_llama(args):
            print(f"| llama.cpp {row['type']} (-fa 1) | {', '.join(f'{x:.1f}' for x in row['tps'])} | "
                  f"{row['median']:.1f} | | | |")


if __name__ == "__main__":
    main()
