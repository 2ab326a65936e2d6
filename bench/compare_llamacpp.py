"""moerun vs llama.cpp on the same GGUF files: pp and tg, same thread count; appends to bench/RESULTS.md.

    pip install -e ".[bench]"          # llama-cpp-python: builds llama.cpp from source (long on 2 cores);
                                       # CMAKE_ARGS="-DGGML_NATIVE=ON" for this CPU's instruction set
    python bench/compare_llamacpp.py ~/.cache/moerun/bench-models/a3b-L4-Q4_K_M.gguf -t 2 --note "baseline"

moerun runs as `moerun bench ... -o json` (a subprocess). llama.cpp runs in a second subprocess (this file
with --llama-worker, so torch and llama.cpp never share a process or an OpenMP runtime) through
llama-cpp-python's low-level bindings, doing what llama-bench's test_prompt/test_gen do: `llama_decode` of
`llama_batch_get_one` batches (n_batch = n_ubatch = 512 for the prompt, one token per step for generation),
`llama_synchronize`, the KV cache cleared with `llama_memory_clear` before each run, one warm-up (the whole
prompt for pp, one token for tg), timed with perf_counter_ns around the whole prompt / all steps. Fixed token
ids are fed (the weights are random, so sampled tokens mean nothing). `Llama.eval` is not used: it copies
logits into numpy and keeps books per call, which llama-bench does not; on a3b-L4 Q4_K_M at 2 threads it
gave the same pp512 and a 3% lower tg128 (174 vs 179 t/s) than the path used here.

The two tools run one after the other, never together (a third busy thread on two cores wrecks
llama.cpp's decode). The section appended to RESULTS.md has the date, the machine, the exact commands,
both tools' t/s (mean ± stddev), moerun/llama.cpp, and for tg the weight bandwidth each reached and its
fraction of the host-RAM bound (moerun's bytes per token and bandwidth figure, the same for both tools).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from toolkit import HERE, add, append_section, dated_heading, machine, moerun_commit

# --------------------------------------------------------------------------------------------- llama.cpp


def llama_worker(model: str, n_prompt: int, n_gen: int, threads: int, reps: int, batch: int) -> dict:
    """Time pp{n_prompt} and tg{n_gen} with llama.cpp, llama-bench's way -> {"pp": [ns...], "tg": [...], ...}."""
    import ctypes

    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_ctx=n_prompt + n_gen, n_threads=threads, n_threads_batch=threads,
                n_batch=batch, n_ubatch=batch, logits_all=False, verbose=False)
    ctx = llm.ctx
    llama_cpp.llama_set_n_threads(ctx, threads, threads)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    ids = [(i * 7919 + 13) % n_vocab for i in range(max(n_prompt, 1))]  # fixed, spread over the vocabulary
    buf = (llama_cpp.llama_token * batch)()

    def decode(tokens: list[int]) -> None:
        for i, t in enumerate(tokens):
            buf[i] = t
        if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(buf, len(tokens))) != 0:
            raise RuntimeError("llama_decode failed")

    def prompt(n: int) -> int:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), False)
        t0 = time.perf_counter_ns()
        for i in range(0, n, batch):
            decode(ids[i:i + batch])
        llama_cpp.llama_synchronize(ctx)
        return time.perf_counter_ns() - t0

    def gen(n: int) -> int:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), False)
        t0 = time.perf_counter_ns()
        for i in range(n):
            decode([ids[i % len(ids)]])
            llama_cpp.llama_synchronize(ctx)
        return time.perf_counter_ns() - t0

    out = {}
    if n_prompt:
        prompt(n_prompt)  # warm-up
        out["pp"] = [prompt(n_prompt) for _ in range(reps)]
    if n_gen:
        gen(1)  # warm-up
        out["tg"] = [gen(n_gen) for _ in range(reps)]
    desc = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(llm.model, desc, 256)
    out.update(model_type=desc.value.decode(), model_size=llama_cpp.llama_model_size(llm.model),
               model_n_params=llama_cpp.llama_model_n_params(llm.model), version=llama_cpp.__version__,
               system_info=llama_cpp.llama_print_system_info().decode().strip())
    llm.close()
    return out


# --------------------------------------------------------------------------------------------- driver


def ts_stats(samples_ns: list[int], n_tokens: int) -> tuple[float, float]:
    ts = [n_tokens * 1e9 / ns for ns in samples_ns]
    return statistics.fmean(ts), statistics.stdev(ts) if len(ts) > 1 else 0.0


def run(cmd: list[str]) -> str:
    print(f"$ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout


def compare(model: str, args) -> dict:
    """Both tools on one file (moerun first, then llama.cpp) -> their results and the commands run."""
    moerun_cmd = ["moerun", "bench", "-m", model, "-p", str(args.n_prompt), "-n", str(args.n_gen),
                  "-r", str(args.reps), "-t", str(args.threads), "-o", "json"]
    if args.measure_bw:
        moerun_cmd.append("--measure-bw")
    load_m = os.getloadavg()[0]
    recs = json.loads(run([sys.executable, "-m", "moerun", *moerun_cmd[1:]]))
    llama_cmd = [sys.executable, str(Path(__file__).resolve()), "--llama-worker", model, "-p", str(args.n_prompt),
                 "-n", str(args.n_gen), "-r", str(args.reps), "-t", str(args.threads)]
    load_l = os.getloadavg()[0]
    llama = json.loads(run(llama_cmd))
    return {"model": model, "moerun": recs, "llama": llama, "moerun_cmd": moerun_cmd, "load": (load_m, load_l),
            "llama_cmd": ["python", "bench/compare_llamacpp.py", *llama_cmd[2:]]}


def section(results: list[dict], args) -> str:
    first, llama0 = results[0]["moerun"][0], results[0]["llama"]
    title = dated_heading(f"moerun vs llama.cpp (llama-cpp-python {llama0['version']})")
    lines = [f"{title}, {args.threads} thread(s)", ""]
    if args.note:
        lines += [args.note, ""]
    invocation = shlex.join(["python", "bench/compare_llamacpp.py", *args.argv])
    lines += [f"Machine: {machine()}.", f"moerun: {first['moerun_version']}, commit {moerun_commit()}.",
              f"llama.cpp build: `{llama0['system_info']}`", "",
              f"Run: `{invocation}`, which ran (one after the other, load average before each in brackets):", ""]
    for r in results:
        lines.append(f"- `{shlex.join(r['moerun_cmd'])}` [{r['load'][0]:.2f}]")
        lines.append(f"- `{shlex.join(r['llama_cmd'])}` [{r['load'][1]:.2f}]")
    how = ("llama.cpp timing: low-level bindings as llama-bench (`llama_decode` + `llama_synchronize`, KV cache "
           "cleared per run, n_batch = n_ubatch = 512, one warm-up), fixed token ids. GB/s = weight bytes read "
           "per token (moerun's count for the file) × t/s; % of bound = t/s ÷ (host read bandwidth ÷ bytes per "
           f"token), host read bandwidth {first['host_read_gbps']:.2f} GB/s at {first['n_threads']} thread(s) "
           f"({first['host_read_source']}).")
    header = ["model", "size", "test", "moerun t/s", "llama.cpp t/s", "moerun / llama.cpp", "GB/s moerun",
              "GB/s llama.cpp", "% of bound moerun", "% of bound llama.cpp"]
    lines += ["", how, "", "| " + " | ".join(header) + " |",
              "| --- | ---: | --- |" + " ---: |" * (len(header) - 3)]
    for r in results:
        for rec in r["moerun"]:
            kind = "pp" if rec["n_gen"] == 0 else "tg"
            n = rec["n_prompt"] + rec["n_gen"]
            l_avg, l_sd = ts_stats(r["llama"][kind], n)
            gib = rec["model_size"] / 2**30
            size = f"{gib:.2f} GiB" if gib >= 1 else f"{gib * 1024:.2f} MiB"
            cells = [f"{Path(r['model']).name} ({r['llama']['model_type']})", size, f"{kind}{n}",
                     f"{rec['avg_ts']:.2f} ± {rec['stddev_ts']:.2f}", f"{l_avg:.2f} ± {l_sd:.2f}",
                     f"{rec['avg_ts'] / l_avg:.3f}"]
            if kind == "tg":
                bpt, bound = rec["bytes_per_token"], rec["bound_ts"]
                cells += [f"{bpt * rec['avg_ts'] / 1e9:.2f}", f"{bpt * l_avg / 1e9:.2f}",
                          f"{100 * rec['avg_ts'] / bound:.1f}", f"{100 * l_avg / bound:.1f}"]
            else:
                cells += ["-"] * 4
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("models", nargs="+", help="GGUF files")
    add(p, "threads")
    p.add_argument("-p", "--n-prompt", type=int, default=512)
    p.add_argument("-n", "--n-gen", type=int, default=128)
    p.add_argument("-r", "--reps", type=int, default=3)
    p.add_argument("--measure-bw", action="store_true", help="pass --measure-bw to moerun bench")
    p.add_argument("--note", default="", help="a paragraph for the top of the section")
    p.add_argument("--results", type=Path, default=HERE / "RESULTS.md", help="file the section is appended to")
    p.add_argument("--no-append", action="store_true", help="print the section, do not append it")
    p.add_argument("--llama-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    args.argv = [a for i, a in enumerate(argv) if a != "--note" and (i == 0 or argv[i - 1] != "--note")]
    if args.llama_worker:
        out = llama_worker(args.models[0], args.n_prompt, args.n_gen, args.threads, args.reps, batch=512)
        print(json.dumps(out))
        return 0
    results = [compare(m, args) for m in args.models]
    text = section(results, args)
    print(text)
    if not args.no_append:
        append_section(text, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
