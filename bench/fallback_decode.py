"""Decode speed of the torch fallback (families whose spec is not `plain`: the fused whole-layer C path does not
apply) against a plain model of the same dimensions on the fused path, and that model with the fused path off;
the three alternate each round, so a busy machine slows all of them alike.

    moerun make-model tiny-glm4moe /tmp/glm-S.gguf --ftype Q4_K_M --layers 8 --hidden 1024 --heads 8 \\
        --kv-heads 2 --head-dim 128 --experts 32 --experts-used 4 --expert-ffn 512 --shared-ffn 512 \\
        --dense-ffn 2048 --vocab 1024 --set rope_dim=64
    moerun make-model tiny-qwen3moe /tmp/qwen-S.gguf --ftype Q4_K_M --layers 8 --hidden 1024 --heads 8 \\
        --kv-heads 2 --head-dim 128 --experts 32 --experts-used 4 --expert-ffn 512 --vocab 1024
    python bench/fallback_decode.py /tmp/glm-S.gguf /tmp/qwen-S.gguf -t 2 -n 64 -r 5

Greedy decode of n tokens after a 16-token prompt (one warm-up first); prints t/s per round and the medians.
"""

from __future__ import annotations

import argparse
import statistics

from moerun.config import RuntimeConfig, SamplingParams
from moerun.runtime import build


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("fallback", help="GGUF of a family on the torch fallback (e.g. glm4moe)")
    p.add_argument("plain", help="GGUF of a plain family of the same dimensions (e.g. qwen3moe)")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-n", type=int, default=64)
    p.add_argument("-r", "--rounds", type=int, default=5)
    a = p.parse_args()
    runs = {}
    for label, path, fused in (("fallback", a.fallback, True), ("plain, fused", a.plain, True),
                               ("plain, fused off", a.plain, False)):
        rt = build(RuntimeConfig(model=path, threads=a.threads))
        if not fused:
            rt.engine.model.fused = None
        rt.engine.generate(list(range(5, 21)), SamplingParams.greedy(max_tokens=8, ignore_eos=True)).run()
        runs[label] = (rt, [])
    for r in range(a.rounds):
        for label, (rt, out) in runs.items():
            gen = rt.engine.generate(list(range(5, 21)), SamplingParams.greedy(max_tokens=a.n, ignore_eos=True)).run()
            out.append(gen.timings.to_dict()["predicted_per_second"])
            print(f"round {r}: {label:18s} {out[-1]:7.1f} t/s", flush=True)
    for label, (rt, out) in runs.items():
        print(f"median {label:18s} {statistics.median(out):7.1f} t/s (min {min(out):.1f}, max {max(out):.1f})")
        rt.close()


if __name__ == "__main__":
    main()
