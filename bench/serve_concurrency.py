"""Aggregate generation throughput of `moerun serve` with 1 client and with N concurrent clients.

    python bench/serve_concurrency.py -m MODEL --clients 1,8 -n 128 -r 3 -t 2 [-o md|json]

Starts `moerun serve` on a free port (--parallel = the largest client count, prompt caching off), sends one
warm-up request, then for each client count runs `-r` rounds: every client streams one greedy completion of
`-n` tokens (ignore_eos, a prompt of its own) at the same moment. Per round: aggregate t/s = all completion
tokens / wall time from the start to the last stream's end; per client t/s = its tokens / its own time; TTFT
= request sent to first text chunk. Reported as mean ± stddev over the rounds. Clients are threads speaking
plain HTTP (http.client), so they cost the machine little next to the server.
"""

from __future__ import annotations

import http.client
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from toolkit import ServerProcess, add, ints, mean_sd, parser

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Parser:\n    def", "    return self.",
           "for i in range(len(items)):", "data = {", "while True:\n    line =", "# compute the checksum",
           "try:\n    import", "with open(path) as f:", "async def fetch(url):", "if __name__ == '__main__':",
           "x = [i * i for i in", "@property\ndef", "raise ValueError(", "from collections import"]


def _stream(port: int, prompt: str, n: int) -> dict:
    """One streaming completion -> tokens, seconds, ttft."""
    body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True, "ignore_eos": True,
                       "cache_prompt": False})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read().decode()}")
    ttft, last = None, None
    for line in iter(r.readline, b""):
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        if ttft is None:
            ttft = time.perf_counter() - t0
        last = line
    t1 = time.perf_counter()
    conn.close()
    return {"tokens": json.loads(last[6:])["usage"]["completion_tokens"], "seconds": t1 - t0, "ttft": ttft}


def _round(port: int, clients: int, n: int) -> dict:
    results: list[dict | None] = [None] * clients
    errors: list[BaseException] = []
    go = threading.Barrier(clients + 1)

    def client(i: int) -> None:
        go.wait()
        try:
            results[i] = _stream(port, PROMPTS[i % len(PROMPTS)], n)
        except BaseException as e:  # noqa: BLE001 - reported after the round
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    tokens = sum(r["tokens"] for r in results)
    return {"aggregate": tokens / wall, "per_client": statistics.mean(r["tokens"] / r["seconds"] for r in results),
            "ttft": statistics.mean(r["ttft"] for r in results), "tokens": tokens, "wall": wall}


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("-m", "--model", default=None, help="model file (default: the built-in model)")
    ap.add_argument("--clients", default="1,8", help="comma list of concurrent client counts")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    add(ap, "threads", threads=None)
    ap.add_argument("-c", "--ctx-size", type=int, default=1024)
    add(ap, "output")
    ap.add_argument("--server-log", type=Path, default=None, help="write the server's log here")
    args = ap.parse_args(argv)
    counts = ints(args.clients)
    serve = ["-np", str(max(counts)), "-c", str(args.ctx_size), "--no-cache-prompt", "--log-interval", "0"]
    serve += ["-m", args.model] if args.model else []
    serve += ["-t", str(args.threads)] if args.threads else []
    try:
        server = ServerProcess(serve, args.server_log, wait=600)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    cmd = server.cmd
    try:
        _stream(server.port, PROMPTS[0], 16)  # warm-up
        rows = []
        for c in counts:
            rounds = [_round(server.port, c, args.n_predict) for _ in range(args.repetitions)]
            rows.append({"clients": c, "rounds": rounds})
    finally:
        server.stop()
    if args.output == "json":
        print(json.dumps({"command": cmd, "n_predict": args.n_predict, "rows": rows}, indent=2))
        return 0
    print(f"server: `{' '.join(cmd[1:])}`; -n {args.n_predict}, {args.repetitions} rounds per row\n")
    print("| clients | tokens per round | aggregate t/s | per-client t/s | TTFT ms | wall s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        rs = row["rounds"]
        print(f"| {row['clients']} | {rs[0]['tokens']} | {mean_sd([r['aggregate'] for r in rs])} | "
              f"{mean_sd([r['per_client'] for r in rs])} | {mean_sd([1e3 * r['ttft'] for r in rs])} | "
              f"{mean_sd([r['wall'] for r in rs])} |")
    base = statistics.mean(r["aggregate"] for r in rows[0]["rounds"])
    for row in rows[1:]:
        agg = statistics.mean(r["aggregate"] for r in row["rounds"])
        print(f"\n{row['clients']} clients / {rows[0]['clients']}: {agg / base:.2f}x aggregate t/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
