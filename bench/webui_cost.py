"""The web page's cost to decode (issue 42): `moerun serve`'s decode tok/s with the page open in headless
Chromium on its live view (polling GET /v1/moerun/state every second and drawing it) against no page open,
A/B alternating in one window, medians of the rounds; and what one /v1/moerun/state answer costs.

    python bench/webui_cost.py ~/.cache/moerun/bench-models/a3b-L4-Q4_K_M.gguf -t 2 --rounds 10 [--append]
    python bench/webui_cost.py ~/.cache/moerun/bench-models/a3b-L4-Q4_K_M.gguf --screenshots docs

The expert cache holds --cache-frac (default 0.25) of the model's routed experts (--expert-cache-mib). A
setting's figure in a round is the median of --requests chat completions of -n tokens each (greedy,
ignore_eos), read from the server's own timings (predicted_per_second: decode alone). The 1-minute load
average is read before and after every run: the machine may be shared. --screenshots DIR writes the README's
pictures of the chat and of the live view (webui-chat.png, webui-live.png) instead of measuring. Needs
playwright (pip install playwright) and Chromium (/usr/bin/chromium, --chromium).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from toolkit import (
    ServerProcess,
    add,
    alternate,
    dated_heading,
    machine_header,
    md_table,
    pair_ratio,
    parser,
    publish,
)

PROMPT = "Write a Python function that merges two sorted lists, then explain it."
SETTINGS = ("closed", "open")


def ctx_size(n: int) -> int:
    """The server's context: the prompt and n tokens, and the screenshots' conversation."""
    return max(1024, n + 256)


def expert_bytes(model: str) -> int:
    """Bytes of the model's routed experts."""
    from moerun.arch import resolve
    from moerun.arch.summary import summarize
    from moerun.formats import open_model

    with open_model(model) as mf:
        return sum(summarize(resolve(mf)).by_class.get("routed_experts", {}).values())


def decode(server: ServerProcess, n: int) -> float:
    """One greedy chat completion of n tokens -> its decode tok/s (the server's timings)."""
    r = server.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                                        "max_tokens": n, "temperature": 0, "ignore_eos": True})
    if r.status != 200:
        raise RuntimeError(f"chat completion failed: {r.status} {r.text[:300]}")
    t = r.json()["timings"]
    assert t["predicted_n"] == n, t
    return t["predicted_per_second"]


class Browser:
    """Headless Chromium; `open()` a page on the server's live view, `close()` it."""

    def __init__(self, chromium: str):
        from playwright.sync_api import sync_playwright

        self._pw = sync_playwright().start()
        self.browser = self._pw.chromium.launch(executable_path=chromium)
        self.context = self.page = None

    def open(self, url: str, viewport=(1280, 800)):
        self.context = self.browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
        self.page = self.context.new_page()
        self.page.set_default_timeout(120_000)
        self.page.goto(url + "/#live")
        self.page.wait_for_function("() => Number(document.getElementById('view-live').dataset.polls) >= 2")
        return self.page

    def polls(self) -> int:
        return int(self.page.get_attribute("#view-live", "data-polls") or 0)

    def close_page(self):
        if self.context is not None:
            self.context.close()
        self.context = self.page = None

    def stop(self):
        self.close_page()
        self.browser.close()
        self._pw.stop()


def ab(server: ServerProcess, browser: Browser, rounds: int, n: int, requests: int) -> dict:
    """Per setting and round: the median decode tok/s of `requests` completions, the loads, the page's polls."""
    log: dict = {"loads": [], "polls": []}

    def run(setting: str, r: int):
        load0 = os.getloadavg()[0]
        if setting == "open":
            browser.open(server.url)
            before = browser.polls()
        t0 = time.perf_counter()
        got = statistics.median(decode(server, n) for _ in range(requests))
        if setting == "open":
            log["polls"].append((browser.polls() - before, time.perf_counter() - t0))
            browser.close_page()
        log["loads"].append((load0, os.getloadavg()[0]))
        print(f"round {r}: page {setting}: {got:.2f} tok/s (load {load0:.2f} -> {os.getloadavg()[0]:.2f})",
              file=sys.stderr, flush=True)
        return got

    samples = alternate(SETTINGS, rounds, run, warmup=True, rotate=True)
    return {"samples": samples, **log}


def endpoint_cost(server: ServerProcess, n: int, calls: int = 100) -> dict:
    """/v1/moerun/state: the server's build time and the client's round trip (medians), idle and while a reply
    decodes, and the answer's size."""
    def measure() -> tuple[list[float], list[float], int]:
        build, trip, size = [], [], 0
        for _ in range(calls):
            t0 = time.perf_counter()
            r = server.request("GET", "/v1/moerun/state")
            trip.append((time.perf_counter() - t0) * 1e3)
            build.append(r.json()["build_ms"])
            size = len(r.text)
        return build, trip, size

    idle = measure()
    done = threading.Event()

    def busy_loop():
        while not done.is_set():
            decode(server, n)

    worker = threading.Thread(target=busy_loop)
    worker.start()
    time.sleep(0.5)
    busy = measure()
    done.set()
    worker.join()
    return {name: {"build_ms": statistics.median(b), "round_trip_ms": statistics.median(t), "bytes": size}
            for name, (b, t, size) in (("idle", idle), ("decoding", busy))}


def cpu_ms_per_s(procs: list, seconds: float) -> float:
    """CPU time (user + system) the processes take over `seconds`, in ms per second."""
    def total() -> float:
        t = 0.0
        for proc in procs:
            try:
                c = proc.cpu_times()
                t += c.user + c.system
            except psutil.NoSuchProcess:
                pass
        return t

    t0 = total()
    time.sleep(seconds)
    return (total() - t0) / seconds * 1e3


def page_cpu(server: ServerProcess, browser: Browser, seconds: float = 20.0) -> dict:
    """With the server idle: CPU ms per second of the server with no page, then of the server and of Chromium's
    processes with the page open on its live view."""
    srv = psutil.Process(server.proc.pid)
    closed = cpu_ms_per_s([srv], seconds)
    browser.open(server.url)
    chromium = [c for c in psutil.Process().children(recursive=True) if "chrom" in c.name().lower()]
    both = [cpu_ms_per_s([srv], seconds / 2), cpu_ms_per_s(chromium, seconds / 2)]
    browser.close_page()
    return {"server_closed": closed, "server_open": both[0], "chromium_open": both[1]}


def screenshots(server: ServerProcess, browser: Browser, out: Path) -> None:
    """The chat after two replies, and the live view after them."""
    out.mkdir(parents=True, exist_ok=True)
    page = browser.open(server.url)
    page.route("**/v1/chat/completions", lambda route: route.continue_(
        post_data=json.dumps({**json.loads(route.request.post_data), "ignore_eos": True})))
    page.click("#tab-chat")
    page.click("#settings-button")
    page.fill("#set-max_tokens", "48")
    page.fill("#set-temperature", "0.7")
    page.click("#settings-button")
    for text in ("Write a Python function that merges two sorted lists.", "Now explain it **step by step**."):
        page.fill("#input", text)
        page.click("#send")
        page.wait_for_function("() => !document.getElementById('send').hidden"
                               " && !document.querySelector('.msg.assistant.pending')")
    page.screenshot(path=str(out / "webui-chat.png"))
    page.click("#tab-live")
    worker = threading.Thread(target=decode, args=(server, 900))  # a reply decoding while the view is taken
    worker.start()
    polls = browser.polls()
    page.wait_for_function("n => Number(document.getElementById('view-live').dataset.polls) >= n", arg=polls + 4)
    height = page.evaluate("() => document.getElementById('top').offsetHeight"
                           " + document.getElementById('view-live').scrollHeight")
    page.set_viewport_size({"width": 1280, "height": height})
    page.wait_for_timeout(300)
    page.screenshot(path=str(out / "webui-live.png"))
    worker.join()
    browser.close_page()
    for name in ("webui-chat.png", "webui-live.png"):
        print(f"wrote {out / name} ({(out / name).stat().st_size} bytes)", file=sys.stderr)


def report(args, mib: float, res: dict, cost: dict, cpu: dict) -> str:
    s = res["samples"]
    rows = [(r + 1, f"{s['closed'][r]:.2f}", f"{s['open'][r]:.2f}", f"{s['open'][r] / s['closed'][r]:.3f}")
            for r in range(args.rounds)]
    loads = [x for pair in res["loads"] for x in pair]
    polls = [p / t for p, t in res["polls"]]
    closed, opened = statistics.median(s["closed"]), statistics.median(s["open"])
    name = Path(args.model).name
    how = (f"`moerun serve -m {name} -t {args.threads} -c {ctx_size(args.n)} -np 1 --expert-cache-mib {mib:.2f}` "
           f"({100 * args.cache_frac:.0f} % of the routed experts); per setting and round the median of "
           f"{args.requests} greedy chat completions of {args.n} tokens (ignore_eos), the server's decode "
           f"tok/s; \"open\": headless Chromium on the page's live view, polling every second "
           f"({min(polls):.2f}-{max(polls):.2f} polls/s seen), opened before and closed after the setting's "
           f"requests; a warm-up round first, the order rotating round by round.")
    sums = (f"Medians: closed {closed:.2f} tok/s, open {opened:.2f} tok/s; open / closed, the median of the "
            f"rounds' ratios: {pair_ratio(s['open'], s['closed']):.3f} (rounds' spread: closed "
            f"{min(s['closed']):.2f}-{max(s['closed']):.2f}, open {min(s['open']):.2f}-{max(s['open']):.2f}). "
            f"1-minute load average {min(loads):.2f}-{max(loads):.2f} over the runs.")
    state = "; ".join(f"{k}: built in {v['build_ms']:.3f} ms, round trip {v['round_trip_ms']:.2f} ms, "
                      f"{v['bytes']} bytes" for k, v in cost.items())
    use = (f"CPU with the server idle: the server {cpu['server_closed']:.1f} ms per second with no page, "
           f"{cpu['server_open']:.1f} ms per second with the page open on its live view, and Chromium's "
           f"processes {cpu['chromium_open']:.1f} ms per second.")
    lines = [dated_heading(f"the web page open and polling against closed: decode tok/s, {name} (issue 42)"), "",
             machine_header(args.threads, sys.argv), "", how, "",
             md_table(["round", "closed, tok/s", "open, tok/s", "open / closed"], rows), "", sums, "",
             f"GET /v1/moerun/state, medians of 100 answers: {state}.", "", use]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = parser(__doc__, "paragraph")
    add(p, "model", "threads", "rounds", "append", rounds=10)
    p.add_argument("-n", type=int, default=2048, help="tokens per completion (default 2048: several polls each)")
    p.add_argument("--requests", type=int, default=1, help="completions per setting and round (default 1)")
    p.add_argument("--cache-frac", type=float, default=0.25, help="expert cache / routed experts (default 0.25)")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    p.add_argument("--screenshots", type=Path, help="write the README's pictures into this folder instead")
    args = p.parse_args()
    mib = expert_bytes(args.model) * args.cache_frac / 2**20
    log = Path(tempfile.mkdtemp(prefix="webui-cost-")) / "serve.log"
    server = ServerProcess(["-m", args.model, "-t", args.threads, "-c", ctx_size(args.n), "-np", "1",
                            "--expert-cache-mib", f"{mib:.2f}", "--log-interval", "0"], log, wait=600)
    browser = Browser(args.chromium)
    try:
        decode(server, 8)  # the page cache and the expert cache warm
        if args.screenshots is not None:
            screenshots(server, browser, args.screenshots)
            return
        res = ab(server, browser, args.rounds, args.n, args.requests)
        cost = endpoint_cost(server, args.n)
        cpu = page_cpu(server, browser)
    finally:
        browser.stop()
        server.stop()
    publish(report(args, mib, res, cost, cpu), args.append)


if __name__ == "__main__":
    main()
