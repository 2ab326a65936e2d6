"""The web page at `moerun serve`'s root, in headless Chromium driven by Playwright, against real
`moerun serve` processes on the built-in model (with a 4-slot expert cache, so the live view has expert counts): streamed
text, stop, timings, regenerate, edit-and-resend, settings, reasoning and tool calls, Markdown without HTML,
the heat map after a reply, the per-layer hit rates against /metrics, a reload, and the API key. Every request
a page makes goes to its server (checked after each test). Debian's Chromium (/usr/bin/chromium) and the
`playwright` package: without either the browser tests are skipped (the size and host checks still run).
"""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from toolkit import ServerProcess

try:
    from playwright.sync_api import sync_playwright
except ImportError:
    sync_playwright = None

WEBUI = Path(__file__).resolve().parents[1] / "moerun" / "server" / "webui"
CHROMIUM = Path("/usr/bin/chromium")
KEY = "sk-page-9"
READY = "() => document.getElementById('status').textContent.startsWith('context')"  # /props answered
WAIT_MS = 60_000  # for what must happen: only a hang comes near it, however loaded the machine

browser_tests = pytest.mark.skipif(
    sync_playwright is None or not CHROMIUM.exists(),
    reason="the browser tests need playwright (pip install playwright) and Debian's Chromium at "
           "/usr/bin/chromium (apt-get install -y chromium); .ci/run installs both")


# -- without a browser -------------------------------------------------------------------------------------

def test_page_files_total_under_300_kb():
    files = [f for f in WEBUI.iterdir() if f.is_file()]
    assert sorted(f.name for f in files) == ["api.js", "chat.js", "index.html", "live.js", "markdown.js", "style.css"]
    total = sum(f.stat().st_size for f in files)
    assert total < 300 * 1024, f"{total} bytes"


def test_page_names_no_other_host():
    for f in WEBUI.iterdir():
        text = f.read_text()
        assert not re.search(r"\w+://", text), f.name  # no absolute URL: every file it loads is the server's
        assert not re.search(r"""(src|href)=["']//""", text), f.name


# -- in the browser ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(["-c", "2048", "-np", "2", "-t", "1", "--expert-cache-slots", "4",
                       "--log-interval", "0"], tmp_path_factory.mktemp("webui") / "serve.log", wait=120)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    if sync_playwright is None or not CHROMIUM.exists():
        pytest.skip("no playwright or no /usr/bin/chromium")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM))
        yield b
        b.close()


class Page:
    """A fresh browser context's page on a server, recording every request it makes and every script error."""

    def __init__(self, browser, server):
        self.server = server
        self.context = browser.new_context(viewport={"width": 1280, "height": 800})
        self.page = self.context.new_page()
        self.page.set_default_timeout(WAIT_MS)
        self.requests, self.errors, self.bodies = [], [], []
        self.page.on("request", self._request)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def _request(self, r):
        self.requests.append(r)
        if r.url.endswith("/v1/chat/completions") and r.post_data:
            self.bodies.append(json.loads(r.post_data))

    def open(self):
        self.page.goto(self.server.url + "/")
        self.page.wait_for_function(READY)
        return self

    def long_replies(self):
        """Replies that do not end at an end-of-sequence token (the built-in model's may end at once)."""
        def more(route):
            body = json.loads(route.request.post_data)
            route.continue_(post_data=json.dumps({**body, "ignore_eos": True}))
        self.page.route("**/v1/chat/completions", more)

    def setting(self, name: str, value: str):
        if self.page.is_hidden("#settings"):
            self.page.click("#settings-button")
        self.page.fill(f"#set-{name}", value)

    def send(self, text: str):
        self.page.fill("#input", text)
        self.page.click("#send")

    def wait_streaming(self):
        self.page.wait_for_function(
            "() => { const c = document.querySelector('.msg.assistant.pending .content');"
            " return c !== null && c.textContent.length > 0; }")

    def wait_replies(self, n: int):
        """Until the conversation has n finished replies."""
        self.page.wait_for_function("n => document.querySelectorAll('.msg.assistant:not(.pending)').length === n"
                                    " && !document.getElementById('send').hidden", arg=n)

    def state(self) -> dict:
        return self.server.request("GET", "/v1/moerun/state").json()


def shows_rate(text: str, hits: int, queries: int, lead: str = "") -> bool:
    """Whether text is `lead` + "P% (hits/queries)" with P the rate to one decimal (JavaScript rounds halves up)."""
    m = re.fullmatch(re.escape(lead) + r"([\d.]+)% \((\d+)/(\d+)\)", text)
    return (m is not None and (int(m[2]), int(m[3])) == (hits, queries)
            and abs(float(m[1]) - 100 * hits / queries) <= 0.05 + 1e-9)


@pytest.fixture
def page(browser, server):
    p = Page(browser, server)
    yield p
    p.context.close()
    assert not p.errors
    foreign = [r.url for r in p.requests if not r.url.startswith((server.url + "/", "data:"))]
    assert p.requests and not foreign


@browser_tests
def test_send_a_message_see_streamed_text_and_timings(page):
    page.open().long_replies()
    page.setting("max_tokens", "200")
    page.send("def fib(n):")
    page.wait_streaming()  # text on the page while the reply is still coming
    page.wait_replies(1)
    p = page.page
    assert p.inner_text(".msg.user .content") == "def fib(n):"
    assert len(p.inner_text(".msg.assistant .content")) > 20
    timings = p.locator(".msg.assistant .timings")
    assert re.fullmatch(r"TTFT \d+ ms", timings.locator(".ttft").inner_text())
    assert re.fullmatch(r"prompt \d+ tok \(\d+ cached\), [\d.]+ tok/s", timings.locator(".prompt").inner_text())
    assert re.fullmatch(r"generated 200 tok, [\d.]+ tok/s", timings.locator(".gen").inner_text())
    hits, queries = int(timings.get_attribute("data-hits")), int(timings.get_attribute("data-queries"))
    assert 0 < queries and 0 <= hits <= queries
    assert shows_rate(timings.locator(".hit").inner_text(), hits, queries, "expert cache ")
    assert page.bodies[-1]["stream"] is True and page.bodies[-1]["max_tokens"] == 200


@browser_tests
def test_stop_a_reply(page):
    page.open().long_replies()
    page.setting("max_tokens", "1900")
    page.send("import os")
    page.wait_streaming()
    page.page.click("#stop")
    page.page.wait_for_selector(".msg.assistant .note.stopped")
    page.wait_replies(1)
    text = page.page.inner_text(".msg.assistant .content")
    page.page.wait_for_timeout(500)
    assert page.page.inner_text(".msg.assistant .content") == text  # nothing more came
    for _ in range(100):  # the server dropped the request: its slot is idle, well short of 1900 tokens
        state = page.state()
        if state["running"] == 0:
            break
        page.page.wait_for_timeout(100)
    assert state["running"] == 0 and max(s["n_tokens"] for s in state["slots"]) < 1500


@browser_tests
def test_regenerate_edit_and_resend_and_settings(page):
    page.open().long_replies()
    for name, value in (("temperature", "0.3"), ("top_p", "0.9"), ("top_k", "20"), ("min_p", "0.05"),
                        ("max_tokens", "8"), ("system", "You write Python.")):
        page.setting(name, value)
    page.send("class A:")
    page.wait_replies(1)
    body = page.bodies[-1]
    assert [body[k] for k in ("temperature", "top_p", "top_k", "min_p", "max_tokens")] == [0.3, 0.9, 20, 0.05, 8]
    assert body["messages"] == [{"role": "system", "content": "You write Python."},
                                {"role": "user", "content": "class A:"}]
    page.page.click(".msg.assistant .regenerate")
    page.wait_replies(1)
    assert len(page.bodies) == 2 and page.bodies[-1]["messages"] == body["messages"]
    page.page.click(".msg.user .edit")
    page.page.fill(".edit-area", "class B:")
    page.page.click(".msg.user .resend")
    page.wait_replies(1)
    assert page.bodies[-1]["messages"][1:] == [{"role": "user", "content": "class B:"}]
    assert page.page.locator(".msg").count() == 2 and page.page.inner_text(".msg.user .content") == "class B:"


def sse(*chunks) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def chunk(delta=None, finish=None, **extra) -> dict:
    return {"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}], **extra}


@browser_tests
def test_reasoning_folded_tool_calls_as_cards_and_no_html_from_the_model(page):
    """The server's stream shapes (reasoning_content, tool_calls, the final timings), answered here so that
    the built-in model need not produce them."""
    timings = {"cache_n": 3, "prompt_n": 9, "prompt_ms": 5.0, "prompt_per_second": 1800.0, "predicted_n": 7,
               "predicted_ms": 10.0, "predicted_per_second": 700.0, "expert_cache_hits": 3,
               "expert_cache_queries": 4}
    body = sse(chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "First, the "}),
               chunk({"reasoning_content": "weather."}),
               chunk({"content": "Calling **the tool** <img src=x onerror=\"window.pwned=1\">"
                                 "<script>window.pwned=2</script> [x](javascript:alert(1))"}),
               chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                      "function": {"name": "get_weather", "arguments": "{\"city\":"}}]}),
               chunk({"tool_calls": [{"index": 0, "function": {"arguments": " \"Paris\"}"}}]}),
               chunk(finish="tool_calls", timings=timings))
    page.page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=body))
    page.open().send("weather in Paris?")
    page.wait_replies(1)
    p = page.page
    assert p.locator("details.reasoning").count() == 1
    assert not p.eval_on_selector("details.reasoning", "d => d.open")
    assert p.inner_text("details.reasoning summary") == "Reasoning (19 characters)"
    assert p.inner_text(".tool-call .tool-name") == "tool call: get_weather"
    assert json.loads(p.inner_text(".tool-call pre")) == {"city": "Paris"}
    assert p.inner_text(".msg.assistant .content strong") == "the tool"
    assert "<img src=x" in p.inner_text(".msg.assistant > .content")  # shown as text
    assert p.locator(".msg img, .msg script, .msg a[href^=javascript]").count() == 0
    assert p.evaluate("window.pwned") is None
    assert p.inner_text(".msg.assistant .timings .hit") == "expert cache 75.0% (3/4)"
    assert p.inner_text(".msg.assistant .timings .finish") == "finish: tool_calls"
    made = p.evaluate("""() => {
        const d = document.createElement('div');
        d.innerHTML = MoerunMarkdown.render('```html\\n<b onclick=x>\\n```\\n# <i>t</i>\\n- a<br>\\n\\n'
            + '| <u> | b |\\n|---|---|\\n| c | <s style=x> |\\n\\n[ok](https://example.org/?a=1&b="2") [no](javascript:x)');
        return {tags: [...d.querySelectorAll('*')].map((e) => e.tagName.toLowerCase()),
                attrs: [...d.querySelectorAll('*')].flatMap((e) => [...e.attributes].map((a) => a.name)),
                text: d.textContent, href: [...d.querySelectorAll('a')].map((a) => a.getAttribute('href'))};
    }""")
    assert set(made["tags"]) == {"div", "span", "button", "pre", "code", "h1", "ul", "li", "table", "thead",
                                 "tbody", "tr", "th", "td", "p", "a"}
    assert set(made["attrs"]) == {"class", "type", "href", "target", "rel"}
    assert made["href"] == ['https://example.org/?a=1&b="2"']
    for written in ("<b onclick=x>", "<i>t</i>", "a<br>", "<u>", "<s style=x>", "[no](javascript:x)"):
        assert written in made["text"]


@browser_tests
def test_heat_map_changes_after_a_reply(page):
    page.open().long_replies()
    p = page.page
    p.click("#tab-live")
    p.wait_for_function("() => document.getElementById('heatmap').dataset.steps !== undefined")
    steps = int(p.get_attribute("#heatmap", "data-steps"))
    before = p.eval_on_selector("#heatmap", "c => c.toDataURL()")
    p.click("#tab-chat")
    page.setting("max_tokens", "48")
    page.send("for i in range(")
    page.wait_replies(1)
    p.click("#tab-live")
    p.wait_for_function("n => Number(document.getElementById('heatmap').dataset.steps) >= n", arg=steps + 4 * 48)
    assert p.eval_on_selector("#heatmap", "c => c.toDataURL()") != before


@browser_tests
def test_hit_rates_equal_metrics(page, server):
    from prometheus_client.parser import text_string_to_metric_families

    page.open().long_replies()
    page.setting("max_tokens", "24")
    page.send("x = [")
    page.wait_replies(1)
    p = page.page
    p.click("#tab-live")
    polls = int(p.get_attribute("#view-live", "data-polls") or 0)
    p.wait_for_function("n => Number(document.getElementById('view-live').dataset.polls) >= n", arg=polls + 2)
    shown = {}
    for cell in p.locator("td.hit").all():
        hits, queries = int(cell.get_attribute("data-hits")), int(cell.get_attribute("data-queries"))
        shown[(int(cell.get_attribute("data-layer")), cell.get_attribute("data-phase"))] = (hits, queries)
        assert shows_rate(cell.locator(".figure").inner_text(), hits, queries) if queries else (
            cell.locator(".figure").inner_text() == "—")
    metrics = {}
    for fam in text_string_to_metric_families(server.request("GET", "/metrics").text):
        for s in fam.samples:
            if s.name in ("moerun:expert_cache_hits_total", "moerun:expert_cache_queries_total"):
                key = (int(s.labels["layer"]), s.labels["phase"])
                metrics.setdefault(key, [0, 0])[s.name.endswith("queries_total")] = int(s.value)
    assert shown == {k: tuple(v) for k, v in metrics.items()} and len(shown) == 8
    assert any(q for _, q in shown.values())


@browser_tests
def test_reload_finds_the_conversation(page):
    page.open().long_replies()
    page.setting("max_tokens", "12")
    page.send("while True:")
    page.wait_replies(1)
    p = page.page
    reply = p.inner_text(".msg.assistant .content")
    p.reload()
    p.wait_for_function(READY)
    assert p.inner_text(".msg.user .content") == "while True:" and p.inner_text(".msg.assistant .content") == reply
    assert p.inner_text("#conversations li.active .title") == "while True:"
    assert p.locator(".msg.assistant .timings .gen").inner_text().startswith("generated 12 tok")


@browser_tests
def test_api_key_asked_once_then_used(browser, tmp_path):
    keyed = ServerProcess(["-c", "512", "-np", "1", "-t", "1", "--expert-cache-slots", "4",
                           "--log-interval", "0"], tmp_path / "serve.log", key=KEY, wait=120)
    page = Page(browser, keyed)
    try:
        statuses = []
        page.page.on("response", lambda r: statuses.append((r.url.removeprefix(keyed.url), r.status)))
        page.page.goto(keyed.url + "/")
        page.page.wait_for_function("() => document.getElementById('key-dialog').open")
        assert ("/props", 401) in statuses and ("/", 200) in statuses  # the page is open, the API is not
        page.page.fill("#key-input", KEY)
        page.page.click("#key-save")
        page.page.wait_for_function(READY)
        page.long_replies()
        page.setting("max_tokens", "6")
        page.send("def")
        page.wait_replies(1)
        assert ("/props", 200) in statuses and ("/v1/chat/completions", 200) in statuses
        assert page.page.locator(".msg.assistant .note.error").count() == 0
        sent = [r for r in page.requests if r.url.endswith("/v1/chat/completions")]
        assert sent and all(r.headers.get("authorization") == f"Bearer {KEY}" for r in sent)
        assert not any(KEY in r.url for r in page.requests)  # never in a URL
        page.page.reload()  # kept for the tab (sessionStorage): not asked again
        page.page.wait_for_function(READY)
        assert not page.page.evaluate("document.getElementById('key-dialog').open")
        assert not page.errors and all(r.url.startswith(keyed.url + "/") for r in page.requests)
    finally:
        page.context.close()
        keyed.stop()


def test_chromium_is_where_the_tests_look():
    """A note in the test log when the browser tests cannot run here."""
    if sync_playwright is None or not CHROMIUM.exists():
        have = "missing" if sync_playwright is None else "found"
        pytest.skip(f"browser tests skipped: playwright {have}, {CHROMIUM} "
                    f"{'found' if CHROMIUM.exists() else 'missing'} (which chromium: {shutil.which('chromium')})")
