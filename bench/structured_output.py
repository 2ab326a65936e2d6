"""Structured output's cost: llguidance (what moerun uses) against xgrammar for the token mask of one step, on
the same JSON schema and token sequence; then decode tok/s with and without the constraint on a model,
alternating, through the server's scheduler.

    pip install llguidance xgrammar          # xgrammar only for the comparison (--no-deps, with apache-tvm-ffi)
    python bench/structured_output.py ~/.cache/moerun/bench-models/a3b-L4-Q4_K_M.gguf -t 2 [--append]

The mask is computed on the engine thread before each sampling (moerun.engine.grammar); the figure that matters
is its time against a decode step's.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from toolkit import add, alternate, dated_heading, moerun_commit, parser, publish

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "email": {"type": "string", "maxLength": 40},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}}}


def walk(grammars, vocab: int, steps: int, seed: int = 0) -> list[int]:
    """A token sequence the schema allows: random logits masked by llguidance, greedy, until it is done."""
    c = grammars.constraint(grammars.json_schema(SCHEMA))
    g = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < steps and not c.done:
        tok = int(c.mask(torch.randn(vocab, generator=g)).argmax())
        if tok in grammars.tokenizer.eos_tokens:
            break
        c.accept(tok)
        out.append(tok)
    return out


def llguidance_us(grammars, tokens: list[int]) -> list[float]:
    c = grammars.constraint(grammars.json_schema(SCHEMA))
    times = []
    for tok in tokens:
        t = time.perf_counter()
        c.allowed()
        times.append((time.perf_counter() - t) * 1e6)
        c.accept(tok)
    return times


def xgrammar_us(backend, vocab: int, eos: list[int], steps: int, seed: int = 0) -> list[float] | None:
    """Mask times of xgrammar walking its own answer (random logits of the same seed, masked, greedy): the two
    libraries read schemas' string and number rules a little differently, so one's tokens may not suit the
    other."""
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=backend), vocab_size=vocab,
                                              stop_token_ids=eos)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    m = xgr.GrammarMatcher(compiled)
    bits = xgr.allocate_token_bitmask(1, vocab)
    g = torch.Generator().manual_seed(seed)
    times = []
    while len(times) < steps and not m.is_terminated():
        t = time.perf_counter()
        m.fill_next_token_bitmask(bits)
        times.append((time.perf_counter() - t) * 1e6)
        logits = torch.randn(1, vocab, generator=g)
        xgr.apply_token_bitmask_inplace(logits, bits)
        tok = int(logits.argmax())
        if tok in eos or not m.accept_token(tok):
            break
    return times


def decode_runs(path: str, threads: int, rounds: int) -> dict[str, list[float]]:
    """Decode tok/s of one request at temperature 1 with and without the schema, alternating."""
    from moerun.config import RuntimeConfig, SamplingParams
    from moerun.engine.scheduler import Request, Scheduler
    from moerun.runtime import build

    rt = build(RuntimeConfig(model=path, threads=threads))
    sched = Scheduler(rt.engine, parallel=1)
    grammar = rt.engine.grammars.json_schema(SCHEMA)
    prompt = rt.engine.tokenizer.encode("Describe a person as JSON:")

    def one(name: str, r: int):
        req = Request(prompt, SamplingParams(temperature=1.0, seed=r - 1, max_tokens=64, ignore_eos=True),
                      grammar=grammar if name == "schema" else None, cache_prompt=False)
        sched.submit(req)
        while sched.has_work():
            sched.step()
        return req.timings

    runs = alternate(["plain", "schema"], rounds, one)
    rt.close()
    out = {name: [t.predicted_n / t.predicted_ms * 1e3 for t in ts] for name, ts in runs.items()}
    return {**out, "schema_tokens": [t.predicted_n for t in runs["schema"]]}


def main() -> None:
    args = add(parser(__doc__), "model", "threads", "rounds", "append", rounds=5).parse_args()
    from moerun.engine.grammar import Grammars
    from moerun.text import Tokenizer
    from moerun.tools.tokenizer import build_tokenizer

    rows = []
    for vocab in (1024, 32768):
        backend = build_tokenizer(vocab)
        tok = Tokenizer(backend, kind="byte_level", vocab_size=vocab, bos_id=None, eos_id=vocab - 1)
        grammars = Grammars(tok, vocab)
        tokens = walk(grammars, vocab, 200)
        ll = llguidance_us(grammars, tokens)
        xg = xgrammar_us(backend, vocab, [vocab - 1], 200)
        rows.append(f"| {vocab} | {len(tokens)} | {statistics.median(ll):.0f} (max {max(ll):.0f}) | "
                    + ("not installed" if xg is None else f"{statistics.median(xg):.0f} (max {max(xg):.0f})") + " |")
    dec = decode_runs(args.model, args.threads, args.rounds)
    plain, schema = statistics.median(dec["plain"]), statistics.median(dec["schema"])
    commit = moerun_commit()
    text = (dated_heading("structured output: the grammar mask's cost (issue 18, item 2)") + "\n\n"
            f"Command: `python bench/structured_output.py {args.model} -t {args.threads} -r {args.rounds}` (commit "
            f"{commit}). The schema: an object of a bounded string name, an integer age 0-120, a bounded email "
            "string and up to 4 bounded tags, compact JSON. Mask time of one step (us, median over a whole answer "
            "of the schema, each library walking random logits of one seed; our byte-level BPE vocabularies of two "
            "sizes):\n\n| vocabulary | llguidance tokens | llguidance | xgrammar |\n|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n\n"
            f"Decode through the scheduler, one request at temperature 1, {args.rounds} rounds alternating: "
            f"without a constraint {plain:.1f} tok/s ({', '.join(f'{x:.1f}' for x in dec['plain'])}), with the "
            f"schema {schema:.1f} tok/s ({', '.join(f'{x:.1f}' for x in dec['schema'])}; answers of "
            f"{', '.join(map(str, dec['schema_tokens']))} tokens): {schema / plain:.3f}x.\n")
    publish(text, args.append)


if __name__ == "__main__":
    main()
