"""bench/toolkit.py, the bench scripts' shared parts (issue 37): alternating rounds and their medians, ratios,
Markdown and JSON output, the journal, the machine header from sample /proc/cpuinfo and lscpu text, the common
arguments, and the server helper against a stand-in server (no model loaded)."""

import json
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import toolkit as tk

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: a second processor, never read
"""

LSCPU = """Architecture:                         x86_64
CPU op-mode(s):                       32-bit, 64-bit
CPU(s):                               2
Vendor ID:                            GenuineIntel
Model name:                           Intel(R) Xeon(R) Platinum 8488C
CPU family:                           6
Model:                                143
Thread(s) per core:                   2
Core(s) per socket:                   1
Socket(s):                            1
Flags:                                fpu avx2 avx512f amx_tile
"""


# ------------------------------------------------------------------------------------------------- rounds


def test_alternate_runs_every_setting_in_turn_each_round():
    calls = []
    out = tk.alternate(["a", "b", "c"], 2, lambda name, r: calls.append((name, r)) or f"{name}{r}")
    assert calls == [("a", 1), ("b", 1), ("c", 1), ("a", 2), ("b", 2), ("c", 2)]
    assert out == {"a": ["a1", "a2"], "b": ["b1", "b2"], "c": ["c1", "c2"]}


def test_alternate_drops_the_warmup_round_and_reports_the_timed_ones():
    calls, seen = [], []
    out = tk.alternate(["x", "y"], 2, lambda name, r: calls.append(r) or r * 10, warmup=True,
                       each=lambda name, r, got: seen.append((name, r, got)))
    assert calls == [0, 0, 1, 1, 2, 2]
    assert out == {"x": [10, 20], "y": [10, 20]}
    assert seen == [("x", 1, 10), ("y", 1, 10), ("x", 2, 20), ("y", 2, 20)]


def test_alternate_rotates_the_start_of_each_round():
    order = []
    tk.alternate(list("abcd"), 2, lambda name, r: order.append(name), rotate=True)
    assert order == list("abcd") + list("cdab")  # the second round starts half way in
    order.clear()
    tk.alternate(list("ab"), 2, lambda name, r: order.append(name), rotate=True, warmup=True)
    assert order == list("ab") * 2 + list("ba")


def test_medians_and_the_per_round_ratio():
    samples = {"plain": [10.0, 30.0, 20.0], "fast": [12.0, 33.0, 30.0]}
    assert tk.medians(samples) == {"plain": 20.0, "fast": 30.0}
    # round by round 1.2, 1.1, 1.5: the median ratio is 1.2, not the ratio of the medians (1.5)
    assert tk.pair_ratio(samples["fast"], samples["plain"]) == pytest.approx(1.2)


def test_median_time_calls_warmup_then_rounds_of_calls():
    seen = []
    s = tk.median_time(seen.append, repeats=3, calls=2, warmup=2)
    assert seen == [0, 1] + [0, 1] * 3 and s >= 0


# ------------------------------------------------------------------------------------------------ figures


def test_ratios_and_cells():
    assert tk.ratio(3.0, 2.0) == "1.50" and tk.ratio(1.0, 3.0, ".3f") == "0.333"
    assert tk.ratio(None, 2.0) == "-" and tk.ratio(2.0, 0) == "-" and tk.ratio(2.0, None) == "-"
    assert tk.pct_err(105.0, 100.0) == "+5.0%" and tk.pct_err(90.0, 100.0) == "-10.0%"
    assert tk.mean_sd([1.0, 2.0, 3.0]) == "2.00 ± 1.00" and tk.mean_sd([4.0]) == "4.00 ± 0.00"
    assert tk.spread([3.0, 1.0, 2.0]) == "2.0 (min 1.0, max 3.0)"
    assert tk.cell(None, ".1f") == "-" and tk.cell(0.25, ".1%") == "25.0%"


def test_markdown_tables():
    assert tk.md_row(["a", 1, 2.5]) == "| a | 1 | 2.5 |"
    assert tk.md_table(["file", "t/s", "ratio"], [["x.gguf", "1.0", "2.00"]], align="lrr") == (
        "| file | t/s | ratio |\n|---|---:|---:|\n| x.gguf | 1.0 | 2.00 |")
    assert tk.md_table(["a", "b"], align="r", spaced=True) == "| a | b |\n| ---: | --- |"


def test_json_and_the_journal(tmp_path, capsys):
    text = tk.write_json(tmp_path / "r.json", {"a": [1, 2]})
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": [1, 2]} and text == json.dumps({"a": [1, 2]}, indent=1)
    tk.append_jsonl(tmp_path / "runs.jsonl", {"round": 0})
    tk.append_jsonl(tmp_path / "runs.jsonl", {"round": 1})
    assert [json.loads(x) for x in (tmp_path / "runs.jsonl").read_text().splitlines()] == [{"round": 0}, {"round": 1}]
    assert tk.dated_heading("moerun vs llama.cpp", day="2026-12-05") == "## 2026-12-05 — moerun vs llama.cpp"
    journal = tmp_path / "issue-37.md"
    journal.write_text("# journal\n")
    tk.publish("## a section\n", append=False, path=journal)
    assert journal.read_text() == "# journal\n"
    tk.publish("## a section\n", append=True, path=journal)
    assert journal.read_text() == "# journal\n\n## a section\n"
    out = capsys.readouterr()
    assert out.out == "## a section\n\n" * 2 and f"appended to {journal}" in out.err


# ------------------------------------------------------------------------------------------------ machine


def test_cpuinfo_is_read_for_its_first_processor():
    f = tk.parse_cpuinfo(CPUINFO)
    assert f["model name"] == "AMD EPYC 9R14 96-Core Processor" and f["cpu family"] == "25" and f["model"] == "17"
    assert tk.cpu_model(f) == "AMD EPYC 9R14 96-Core Processor"
    assert tk.cpu_ids(f) == "AuthenticAMD family 25 model 17"
    assert tk.simd(f) == "avx2, avx512f, avx512_bf16"


def test_lscpu_fields_are_named_as_cpuinfo_names_them():
    f = tk.parse_lscpu(LSCPU)
    assert f["model name"] == "Intel(R) Xeon(R) Platinum 8488C" and f["Socket(s)"] == "1" and f["CPU(s)"] == "2"
    assert tk.cpu_ids(f) == "GenuineIntel family 6 model 143"
    assert tk.simd(f) == "avx2, avx512f, amx_tile" and tk.simd({}) == "no AVX2"


def test_machine_header():
    line = tk.machine_header(2, ["bench/x.py", "m.gguf", "-t", "2"], fields=tk.parse_lscpu(LSCPU), commit="abc1234",
                             day="2026-12-05")
    assert line.startswith("Machine: Intel(R) Xeon(R) Platinum 8488C (GenuineIntel family 6 model 143; ")
    assert "), 2 threads; moerun commit abc1234; 2026-12-05. Run: `python bench/x.py m.gguf -t 2`." in line
    assert tk.cpu_model({}) and tk.machine().endswith(" GiB RAM")  # this machine's own, whatever it is


# ---------------------------------------------------------------------------------------------- arguments


def test_common_arguments_in_order_with_overrides():
    p = tk.add(tk.parser("First line.\n\nMore."), "model", "threads", "--rounds", "append", "output",
               threads={"type": str, "default": "1"}, rounds=5)
    a = p.parse_args(["m.gguf"])
    assert (a.model, a.threads, a.rounds, a.append, a.output) == ("m.gguf", "1", 5, False, "md")
    assert p.description == "First line."
    usage = p.format_usage()
    assert usage.index("-t THREADS") < usage.index("--rounds ROUNDS") < usage.index("--append") < usage.index("-o")
    assert "-r ROUNDS" not in usage
    a = tk.add(tk.parser(None), "models", "rounds").parse_args(["a", "b", "-r", "2"])
    assert (a.models, a.rounds) == (["a", "b"], 2)
    assert tk.parser("Title.\n\nBody.", "paragraph").description == "Title."
    assert tk.parser("Title.\n\nBody.", "all").description == "Title.\n\nBody."
    assert tk.ints("1, 2,4") == [1, 2, 4]


# ------------------------------------------------------------------------------------------------- server

# A stand-in for `moerun serve`: /health answers 503 twice, then 200; writes its argv to stdout (the log).
STANDIN = textwrap.dedent("""
    import http.server, json, sys
    print(sys.argv[1:], flush=True)
    port = int(sys.argv[sys.argv.index("--port") + 1])
    seen = []
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get("Authorization"))
            ok = len(seen) > 2
            body = json.dumps({"status": "ok"} if ok else {"error": {"code": 503}}).encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def test_server_process_waits_for_health_and_stops_by_pid(tmp_path):
    s = tk.ServerProcess(["-c", "256"], tmp_path / "serve.log", key="sk-x", launcher=("-c", STANDIN), wait=60,
                         poll=0.01)
    try:
        assert [st for st, _ in s.health] == [503, 503, 200] and s.health[-1][1] == {"status": "ok"}
        assert s.cmd[-6:] == ["--port", str(s.port), "--api-key", "sk-x", "-c", "256"]
        assert s.url == f"http://127.0.0.1:{s.port}"
        r = s.request("GET", "/anything")
        assert r.status == 200 and r.json() == {"status": "ok"} and "Content-Length" in r.headers
    finally:
        rc = s.stop()
    assert rc != 0 and s.proc.poll() is not None  # SIGTERM ended it
    assert "'--api-key', 'sk-x'" in (tmp_path / "serve.log").read_text()


def test_a_server_that_exits_is_reported_with_its_log(tmp_path):
    with pytest.raises(RuntimeError, match="did not start(.|\n)*boom"):
        tk.ServerProcess([], tmp_path / "serve.log", launcher=("-c", "print('boom')"), wait=60)


def test_compare_engines_sets_runs_against_each_other_within_a_memory_state():
    """compare_engines --probe: a median over rounds set one engine's fast-memory runs against the other's slow ones
    (issue 36); by_state compares within each state, a run fast when its probe reaches 80 % of the highest."""
    import compare_engines as ce

    got = {"moerun": [{"tg": 26.4, "probe": 54.3}, {"tg": 26.7, "probe": 55.0}, {"tg": 37.1, "probe": 84.1}],
           "ik_llama.cpp": [{"tg": 22.7, "probe": 54.2}, {"tg": 28.7, "probe": 83.8}, {"tg": 28.0, "probe": 84.7}]}
    got["moerun"][0]["pp"] = 140.0  # another test's number is not mixed in
    line = ce.by_state(got, "tg", "moerun", "ik_llama.cpp")
    assert line.startswith("fast ") and "; slow " in line
    fast, slow = line.split("; ")
    assert ce.ratio(37.1, (28.7 + 28.0) / 2) in fast and "(1 runs of moerun, 2 of ik_llama.cpp)" in fast
    assert ce.ratio(26.55, 22.7) in slow and "(2 runs of moerun, 1 of ik_llama.cpp)" in slow
    # the overall medians would say 26.7 / 28.0: moerun behind, though ahead in both states
    assert float(ce.ratio(26.7, 28.0).rstrip("x")) < 1 < float(fast.split()[1].rstrip("x"))
    # one state only: one part; no probes: nothing
    assert ce.by_state({"a": [{"tg": 2.0, "probe": 80.0}], "b": [{"tg": 1.0, "probe": 79.0}]}, "tg", "a", "b") \
        .startswith("fast 2.00")
    assert ce.by_state({"a": [{"tg": 2.0}], "b": [{"tg": 1.0}]}, "tg", "a", "b") == ""
