"""An agent loop's time to first token, turn by turn, with and without prefix reuse: a system prompt with tools
(Qwen3's published template, tests/data/templates), then 5 turns of a tool call and its result sent back, each
turn's prompt the whole conversation again, through the server's scheduler; alternating A and B, medians.

    python bench/agent_loop.py ~/.cache/moerun/bench-models/a3b-L4-Q4_K_M.gguf -t 2 [--append]
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from toolkit import add, alternate, dated_heading, moerun_commit, parser, publish

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE.parent / "tests" / "data" / "templates" / "Qwen-Qwen3-0.6B.jinja"
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} for the agent",
                                           "parameters": {"type": "object", "properties": {
                                               "query": {"type": "string"}, "limit": {"type": "integer"}},
                                               "required": ["query"]}}}
         for name in ("search", "read_file", "write_file", "run_tests")]
SYSTEM = ("You are a coding agent working in a repository. Use the tools to read, change and test code; answer "
          "briefly. " * 8)


def turns(n: int, session: int) -> list[list[dict]]:
    """The conversation sent at each of n turns (each the last one plus a call and its result); `session`
    starts the system prompt, so no loop finds another's blocks cached."""
    msgs = [{"role": "system", "content": f"Session {session}. {SYSTEM}"},
            {"role": "user", "content": "Fix the failing test in utils."}]
    out = []
    for t in range(n):
        out.append(list(msgs))
        call = {"id": f"call_{t}", "type": "function",
                "function": {"name": TOOLS[t % 4]["function"]["name"], "arguments": {"query": f"step {t}"}}}
        msgs += [{"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": f"call_{t}", "content": json.dumps({"result": "ok " * 20, "t": t})}]
    return out


def loop(sched, tok, template, reuse: bool, n: int, session: int) -> list[tuple[float, int, int]]:
    """(TTFT seconds, prompt tokens, cached tokens) of each turn."""
    from moerun.config import SamplingParams
    from moerun.engine.scheduler import Request

    out = []
    for msgs in turns(n, session):
        ids = tok.encode(template.render(msgs, add_generation_prompt=True, tools=TOOLS), add_special=False)
        req = Request(ids, SamplingParams.greedy(max_tokens=8, ignore_eos=True), cache_prompt=reuse)
        sched.submit(req)
        while sched.has_work():
            sched.step()
        out.append((req.t_first - req.arrival, len(ids), req.timings.cache_n))
    for slot in sched.slots:
        slot.seq.free()
    return out


def main() -> None:
    p = add(parser(__doc__), "model", "threads", "rounds")
    p.add_argument("-n", "--turns", type=int, default=5)
    args = add(p, "append").parse_args()
    from moerun.config import RuntimeConfig
    from moerun.engine.scheduler import Scheduler
    from moerun.runtime import build
    from moerun.text.chat import ChatTemplate

    rt = build(RuntimeConfig(model=args.model, threads=args.threads, ctx_size=4096))
    sched = Scheduler(rt.engine, parallel=1)
    tok, template = rt.engine.tokenizer, ChatTemplate(TEMPLATE.read_text())
    runs = alternate([False, True], args.rounds,
                     lambda reuse, r: loop(sched, tok, template, reuse, args.turns, 2 * (r - 1) + reuse))
    rt.close()
    rows = []
    for t in range(args.turns):
        cold = statistics.median(r[t][0] for r in runs[False]) * 1e3
        warm = statistics.median(r[t][0] for r in runs[True]) * 1e3
        rows.append(f"| {t + 1} | {runs[True][0][t][1]} | {runs[True][0][t][2]} | {cold:.0f} | {warm:.0f} | "
                    f"{cold / warm:.1f}x |")
    commit = moerun_commit()
    text = (dated_heading("an agent loop's TTFT with and without prefix reuse (issue 18)") + "\n\n"
            f"Command: `python bench/agent_loop.py {args.model} -t {args.threads} -r {args.rounds} -n {args.turns}` "
            f"(commit {commit}). A system prompt with four tools (Qwen3's template), then per turn a tool call "
            "and its result appended and the whole conversation sent again; 8 greedy tokens a turn; the "
            f"scheduler of `moerun serve` with one slot; {args.rounds} rounds alternating `cache_prompt` off and "
            "on, medians.\n\n| turn | prompt tokens | cached (reuse on) | TTFT off, ms | TTFT on, ms | speed-up |\n"
            "|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n")
    publish(text, args.append)


if __name__ == "__main__":
    main()
