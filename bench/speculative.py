"""Speculative decoding on the CPU (issue 20): decode t/s without drafts, with prompt lookup and with a draft
model, on a code-editing prompt whose reply repeats much of the prompt, and the same settings in llama.cpp.

    python bench/speculative.py MODEL [--draft DRAFT] [-t 2] [-n 128] [--rounds 3] [--llama-bin DIR]

Two prompts. "fresh": a function of the standard library (textwrap.indent, with its docstring); its reply
repeats little. "edit": a reply that repeats the prompt, as an agent's edit of code does. Our small trained
models cannot follow an instruction to rewrite and do not copy a function by themselves, so the prompt is
built from the model's own text: the function's first 60 tokens X, a reply Y, X again, with Y the model's
reply to X + Y + X (iterated from its reply to X until it stays): the reply then repeats Y. The share of the
reply's 8-grams found in the prompt is printed with each table. Every setting runs in one process on one loaded model (the drafter swapped
between runs), greedy, `-n` tokens past end of text; the settings take turns within each round and the
medians are reported. "same text" checks the output against the plain run's (greedy output must not change).

With --llama-bin, llama.cpp's `llama-speculative-simple` runs the same prompts' text at the same threads, after
moerun (never together): plain, its n-gram drafter (`--spec-type ngram-simple`, the prompt lookup equivalent)
and a draft model (`--spec-type draft-simple -md`), with the t/s and draft counts it prints (the last
round's). Build it from llama.cpp's sources (e.g. those llama-cpp-python's sdist vendors) with cmake, target
llama-speculative-simple; this script does not build it.
"""

from __future__ import annotations

import inspect
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
from toolkit import add, alternate, parser

from moerun.config import DraftParams, RuntimeConfig, SamplingParams
from moerun.engine.speculative import LookupDrafter
from moerun.runtime import build, make_drafter


def fresh_prompt() -> str:
    return textwrap.dedent(inspect.getsource(textwrap.indent))


def edit_prompt(eng, n: int, head: int = 60) -> list[int]:
    """The function's first `head` tokens X, a reply Y, X again, where Y is what the model writes after that
    prompt (the reply to X + Y + X, iterated from Y = the reply to X until it stays; module docstring) ->
    token ids."""
    x = eng.tokenizer.encode(fresh_prompt())[:head]
    gap = eng.tokenizer.encode("\n\n", add_special=False)

    def greedy(ids):
        gen = eng.generate(ids, SamplingParams.greedy(max_tokens=n, ignore_eos=True)).run()
        gen.seq.free()
        return gen.tokens

    y = greedy(x)
    for _ in range(4):
        z = greedy(x + y + gap + x)
        if z == y:
            break
        y = z
    return x + y + gap + x


def verify_cost(eng, rows=(1, 2, 4, 8, 16), runs: int = 5) -> str:
    """A verify step's time against its rows (random tokens after a 200-token prompt; median of `runs`), beside
    the bytes model the draft length chooser starts from (moerun.engine.speculative.bytes_cost)."""
    from moerun.engine.speculative import bytes_cost

    m, seq = eng.model, eng.new_sequence()
    m.forward(torch.tensor(eng.tokenizer.encode(fresh_prompt())[:200]), seq.kv, last_only=True)
    start, g, times = seq.kv.length, torch.Generator().manual_seed(0), {n: [] for n in rows}
    for _ in range(runs):
        for n in rows:
            t0 = time.perf_counter()
            m.forward(torch.randint(0, m.spec.vocab, (n,), generator=g), seq.kv, phase="decode")
            times[n].append(time.perf_counter() - t0)
            seq.kv.truncate(start)
    seq.free()
    cost, one = bytes_cost([m]), statistics.median(times[rows[0]])
    measured = " | ".join(f"{statistics.median(times[n]) / one:.2f}" for n in rows[1:])
    model = " | ".join(f"{cost(n):.2f}" for n in rows[1:])
    return (f"| model | rows: {' | '.join(map(str, rows))} |\n|---|{'---:|' * len(rows)}\n"
            f"| measured | {one * 1e3:.1f} ms (1.00) | {measured} |\n| bytes model | 1.00 | {model} |")


def settings(args) -> list[tuple[str, DraftParams, str | None]]:
    """(label, draft settings, drafter kind: None | lookup | model)."""
    out = [("plain", DraftParams(), None),
           ("lookup 3, adaptive", DraftParams(lookup_ngram=3), "lookup"),
           ("lookup 3, fixed 8", DraftParams(lookup_ngram=3, draft_max=8, adaptive=False), "lookup")]
    if args.draft:
        out += [("draft model, adaptive", DraftParams(), "model"),
                ("draft model, fixed 8", DraftParams(draft_max=8, adaptive=False), "model")]
    return out


def with_ratios(rows: dict[str, dict], base: str) -> list[dict]:
    """The rows with each one's median t/s and its ratio to `base`'s."""
    for row in rows.values():
        row["median"] = statistics.median(row["tps"])
    return [{**row, "ratio": row["median"] / rows[base]["median"]} for row in rows.values()]


def run_moerun(args, eng, drafters, ids: list[int]) -> list[dict]:
    params = SamplingParams.greedy(max_tokens=args.n, ignore_eos=True)
    setting = {label: (draft, kind) for label, draft, kind in settings(args)}
    rows = {label: {"label": label, "tps": [], "draft_n": 0, "accepted": 0, "lengths": ""} for label in setting}
    ref = None

    def one(label: str, _round: int):
        nonlocal ref
        draft, kind = setting[label]
        eng.drafter = drafters[kind]
        seq = eng.new_sequence()
        gen = eng.generate(ids, params, seq, draft=draft).run()
        seq.free()
        if kind is None:  # each round's plain run: the prompt's blocks shared as for the others (round 0
            ref = gen.tokens  # prefills it cold, which can move a near tie of a random model's logits)
        return gen

    def record(label: str, _round: int, gen) -> None:
        row = rows[label]
        row["same"] = row.get("same", True) and gen.tokens == ref
        row["tps"].append(gen.timings.to_dict()["predicted_per_second"])
        row["text"] = eng.tokenizer.decode(gen.tokens)
        if gen.spec is not None:
            row["draft_n"] += gen.timings.draft_n
            row["accepted"] += gen.timings.draft_n_accepted
            row["lengths"] = gen.spec.lengths_line()

    alternate(list(setting), args.rounds, one, warmup=True, each=record)  # round 0 warms up
    return with_ratios(rows, "plain"), overlap(ids, ref)


def overlap(prompt: list[int], reply: list[int], n: int = 8) -> float:
    seen = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
    grams = [tuple(reply[i:i + n]) for i in range(len(reply) - n + 1)]
    return sum(g in seen for g in grams) / max(1, len(grams))


def run_llama(args, prompt: str) -> list[dict]:
    """llama.cpp's llama-speculative-simple on the same prompt text: t/s and drafts as it prints them. Plain
    decode is its n-gram drafter looking for 1000-grams, which never match (no drafts; --spec-draft-n-max 0
    does not stop it), so all three runs are the same program."""
    prompt_file = Path(tempfile.mkstemp(suffix=".txt")[1])
    prompt_file.write_text(prompt, encoding="utf-8")
    common = [str(Path(args.llama_bin) / "llama-speculative-simple"), "-m", args.model, "-t", str(args.threads),
              "-n", str(args.n), "--temp", "0", "-c", str(args.ctx), "--ignore-eos", "-f", str(prompt_file)]
    ngram = ["--spec-type", "ngram-simple", "--spec-draft-n-max", "8", "--spec-ngram-simple-size-n"]
    runs = [("llama.cpp plain (no drafts)", [*ngram, "1000"]),
            ("llama.cpp ngram-simple 3, --spec-draft-n-max 8", [*ngram, "3", "--spec-ngram-simple-size-m", "8"])]
    if args.draft:
        runs.append(("llama.cpp draft-simple -md, --spec-draft-n-max 8, p-min 0.75",
                     ["--spec-type", "draft-simple", "-md", args.draft, "--spec-draft-n-max", "8",
                      "--spec-draft-p-min", "0.75"]))
    extra = dict(runs)

    def one(label: str, _round: int) -> dict:
        p = subprocess.run(common + extra[label], check=False, capture_output=True, timeout=600)
        log = (p.stdout + p.stderr).decode("utf-8", errors="replace")
        m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log)
        if p.returncode != 0 or m is None:
            raise RuntimeError(f"llama-speculative-simple failed ({p.returncode}):\n{log[-2000:]}")
        counts = {key: re.search(rf"{key}\s*=\s*(\d+)", log) for key in ("n_drafted", "n_accept")}
        return {"tps": float(m.group(3)), **{k: int(km.group(1)) if km else None for k, km in counts.items()}}

    got = alternate(list(extra), args.rounds, one)
    prompt_file.unlink()
    rows = {label: {"label": label, "tps": [g["tps"] for g in gs], "n_drafted": gs[-1]["n_drafted"],
                    "n_accept": gs[-1]["n_accept"]} for label, gs in got.items()}
    return with_ratios(rows, runs[0][0])


def main() -> None:
    ap = add(parser(__doc__, "all"), "model")
    ap.add_argument("--draft", help="a draft model of the same vocabulary")
    add(ap, "threads")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-c", "--ctx", type=int, default=2048)
    add(ap, "--rounds")
    ap.add_argument("--llama-bin", help="a folder with llama.cpp's llama-lookup and llama-speculative-simple")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    rt = build(RuntimeConfig(model=args.model, threads=args.threads, ctx_size=args.ctx))
    eng = rt.engine
    drafters = {None: None, "lookup": LookupDrafter(3)}
    if args.draft:
        drafters["model"] = make_drafter(RuntimeConfig(model=args.model, model_draft=args.draft,
                                                       threads=args.threads), eng)
    print("verify step against its rows:\n\n" + verify_cost(eng))
    prompts = {"fresh": eng.tokenizer.encode(fresh_prompt()), "edit": edit_prompt(eng, args.n)}
    texts = {}
    for name, ids in prompts.items():
        rows, shared = run_moerun(args, eng, drafters, ids)
        print(f"\n{name} prompt: {len(ids)} tokens, reply {args.n} tokens; {shared:.0%} of the reply's 8-grams "
              "are in the prompt\n")
        print("| setting | decode t/s (runs) | median | vs plain | drafted | accepted | same text |")
        print("|---|---|---:|---:|---:|---:|---|")
        for row in rows:
            runs = ", ".join(f"{x:.1f}" for x in row["tps"])
            acc = f"{row['accepted']} ({row['accepted'] / row['draft_n']:.0%})" if row["draft_n"] else "-"
            print(f"| moerun {row['label']} | {runs} | {row['median']:.1f} | {row['ratio']:.2f}x | "
                  f"{row['draft_n'] or '-'} | {acc} | {'yes' if row['same'] else 'NO'} |")
        for row in rows:
            if row["lengths"]:
                print(f"- {row['label']}: {row['lengths']} (last round)")
        texts[name] = eng.tokenizer.decode(ids)
    rt.close()
    if args.llama_bin:
        for name, text in texts.items():
            print(f"\nllama.cpp, {name} prompt (the same text, tokenized by llama.cpp)\n")
            print("| setting | decode t/s (runs) | median | vs plain | drafted | accepted |")
            print("|---|---|---:|---:|---:|---:|")
            for row in run_llama(args, text):
                runs = ", ".join(f"{x:.1f}" for x in row["tps"])
                print(f"| {row['label']} | {runs} | {row['median']:.1f} | {row['ratio']:.2f}x | "
                      f"{row['n_drafted'] or '-'} | {row['n_accept'] if row['n_drafted'] else '-'} |")
    print(f"({time.time() - t0:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
