"""The web console in a real browser (Debian's chromium driven by Playwright) against a real
`meshnet up` mesh with an API key: no console errors, the Coverage Map, a streamed chat equal to
the API's greedy answer, a killed node turning red and back, the key prompt, and regressions a
browser found (connections held by idle tabs, New chat, Stop, a phone's width, empty fields)."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from artifacts.bundled import resolve_model
from artifacts.gguf_header import read_header
from artifacts.layout import shard_layout
from bus.runinfo import RUN_FILE_ENV
from meshnet.up import free_port

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
KEY = "console-key"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
UP_START_S = 300.0  # other engineers share these two cores
SHOTS_ENV = "MESHNET_CONSOLE_SHOTS"  # a directory: the tests save their screenshots there too
# the ranges `meshnet up --nodes 2` cuts the bundled model into (node-0's, node-1's)
(HEAD_START, HEAD_END), (TAIL_START, TAIL_END) = shard_layout(read_header(resolve_model(None)), 2)


@dataclass
class UpMesh:
    """A `meshnet up --nodes 2 --api-key KEY` subprocess and the lines it printed."""

    proc: subprocess.Popen[str]
    base: str
    lines: list[str] = field(default_factory=list)
    news: queue.Queue[str] = field(default_factory=queue.Queue)

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            self.news.put(line.rstrip())

    def pids(self, node_id: str) -> list[int]:
        """Every pid `meshnet up` started the process serving `node_id` with, in order (a
        composite node process is named by its node ids: node-0+node-1)."""
        pat = re.compile(r"\[up\] (?:started (\S+) \(pid|(\S+) restarted \(pid) (\d+)\)")
        return [int(m.group(3)) for line in self.lines
                if (m := pat.search(line)) and node_id in (m.group(1) or m.group(2)).split("+")]


@pytest.fixture(scope="module")
def up_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpMesh]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHNET_NATS_")}
    env |= {"PYTHONUNBUFFERED": "1", RUN_FILE_ENV: str(tmp_path_factory.mktemp("up") / "meshnet-up.json")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshnet.cli", "up", "--nodes", "2", "--port", str(port), "--nats-port", "0",
         "--quiet", "--validator", "off", "--api-key", KEY],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    mesh = UpMesh(proc, f"http://127.0.0.1:{port}")
    threading.Thread(target=mesh.read, daemon=True).start()
    try:
        deadline = time.monotonic() + UP_START_S
        while not any("Meshnet is up" in line for line in mesh.lines):
            assert proc.poll() is None, "meshnet up exited:\n" + "\n".join(mesh.lines[-40:])
            assert time.monotonic() < deadline, "meshnet up not ready:\n" + "\n".join(mesh.lines[-40:])
            time.sleep(0.2)
        yield mesh
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    assert CHROMIUM.exists(), "chromium is missing: scripts/setup.sh installs it (apt-get install chromium)"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@dataclass
class Console:
    """One browser page on the console with what it logged and requested."""

    page: object
    errors: list[str]
    requests: list[str]


def open_console(browser, mesh: UpMesh, *, key: str | None = KEY, width: int = 1280, height: int = 900,  # type: ignore[no-untyped-def]
                 init: str = "") -> Console:
    """A fresh context (fresh storage) on the console; `key` preset in session storage, `init`
    run before the page's scripts (HIDE_HOOK)."""
    context = browser.new_context(viewport={"width": width, "height": height})
    if key is not None:
        init = f"sessionStorage.setItem('meshnet-api-key', {json.dumps(key)})" + init
    if init:
        context.add_init_script(init)
    page = context.new_page()
    out = Console(page, [], [])
    page.on("console", lambda m: m.type == "error" and out.errors.append(m.text))
    page.on("pageerror", lambda exc: out.errors.append(str(exc)))
    page.on("request", lambda r: out.requests.append(r.url))
    page.goto(mesh.base + "/")
    return out


def shot(page, name: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    page.screenshot(path=str(tmp_path / name), full_page=True)
    if target := os.environ.get(SHOTS_ENV):
        page.screenshot(path=str(Path(target) / name), full_page=True)


def state_of(page, node_id: str) -> str | None:  # type: ignore[no-untyped-def]
    row = page.query_selector(f'#nodes tr[data-node="{node_id}"]')
    return row.get_attribute("data-state") if row else None


def test_console_loads_and_draws_both_ranges(up_mesh: UpMesh, browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    c = open_console(browser, up_mesh)
    page = c.page
    page.click("#tab-mesh")
    for node in ("node-0", "node-1"):
        page.wait_for_selector(f'#nodes tr[data-node="{node}"][data-state="serving"]', timeout=60_000)
    assert page.locator('.cell.on[data-node="node-0"]').count() == HEAD_END - HEAD_START
    assert page.locator('.cell.on[data-node="node-1"]').count() == TAIL_END - TAIL_START
    assert page.locator(".cell.n0").count() == 0  # no gap
    assert page.locator("#coverage .badge").first.inner_text() == "covered"
    assert page.locator("#key-panel").is_hidden()
    shot(page, "console-mesh.png", tmp_path)
    page.set_viewport_size({"width": 390, "height": 844})  # a phone: nothing wider than the screen
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
    assert c.errors == []
    assert all(u.startswith(up_mesh.base + "/") for u in c.requests), c.requests
    page.context.close()


def test_chat_streams_the_apis_greedy_answer(up_mesh: UpMesh, browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    c = open_console(browser, up_mesh)
    page = c.page
    page.wait_for_selector("#model option[value='smollm2-135m-instruct']", state="attached", timeout=60_000)
    prompt = "Name three colours of the rainbow."
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "24")
    page.fill("#prompt", prompt)
    page.keyboard.press("Shift+Enter")  # a new line, nothing sent
    assert page.input_value("#prompt") == prompt + "\n" and page.locator("#transcript li").count() == 0
    page.keyboard.press("Backspace")
    page.keyboard.press("Enter")  # the keyboard sends
    page.wait_for_selector("#transcript li[data-state='streaming']", timeout=30_000)
    page.wait_for_selector("#transcript li[data-state='done'] .stats", timeout=180_000)
    shown = page.inner_text("#transcript li.assistant .answer")
    stats = page.inner_text("#transcript li.assistant .stats")
    body = {"model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": 24,
            "messages": [{"role": "user", "content": prompt}]}
    req = urllib.request.Request(up_mesh.base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=180) as resp:
        expected = json.loads(resp.read())["choices"][0]["message"]["content"]
    assert shown == expected
    assert "tok/s" in stats and "first token" in stats
    assert f"node-0 [{HEAD_START}, {HEAD_END}) → node-1 [{TAIL_START}, {TAIL_END})" in stats, stats
    assert "tokens" in page.inner_text("#strip")
    shot(page, "console-chat.png", tmp_path)
    page.fill("#allow-nodes", "node\u20110, node-1")  # a non-breaking hyphen: no header carries it
    page.fill("#prompt", "Say hi")
    page.click("#send")  # named under the fields, not sent (fetch threw, read as an unreachable gateway)
    page.wait_for_selector("#form-error:has-text('Private route')", timeout=10_000)
    assert "Node ids are letters, digits, _ and -" in page.inner_text("#form-error")
    assert page.locator("#transcript li").count() == 2
    page.fill("#allow-nodes", "node-0, node-1")  # a private route: marked under its answer
    page.fill("#max-tokens", "4")
    page.fill("#prompt", "Say hi")
    page.click("#send")
    page.wait_for_selector("#transcript li.assistant:nth-of-type(4)[data-state='done'] .stats", timeout=180_000)
    assert "private route" in page.inner_text("#transcript li.assistant:nth-of-type(4) .stats")
    assert "private route" not in stats
    page.set_viewport_size({"width": 390, "height": 844})
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
    assert c.errors == []
    page.context.close()


def test_a_killed_node_turns_red_and_back(up_mesh: UpMesh, browser) -> None:  # type: ignore[no-untyped-def]
    c = open_console(browser, up_mesh)
    page = c.page
    page.click("#tab-mesh")
    page.wait_for_selector('#nodes tr[data-node="node-1"][data-state="serving"]', timeout=60_000)
    killed: set[int] = set()
    deadline = time.monotonic() + 120
    # meshnet up restarts a dead node (1 s, 2 s, 4 s ... back-off): kill each new process until
    # the console has shown the node lost, so a quick restart cannot hide the red. Its process
    # is the composite node that serves node-0 too: the whole model goes red
    while state_of(page, "node-1") != "lost":
        for pid in up_mesh.pids("node-1"):
            if pid not in killed:
                killed.add(pid)
                os.kill(pid, signal.SIGKILL)
        assert time.monotonic() < deadline, f"node-1 never showed lost (state {state_of(page, 'node-1')})"
        page.wait_for_timeout(200)
    assert page.locator('.cell.on.s-lost[data-node="node-1"]').count() == TAIL_END - TAIL_START
    page.wait_for_function("document.querySelectorAll('.cell.n0').length === 30", timeout=60_000)  # the gap
    for node_id in ("node-0", "node-1"):
        page.wait_for_selector(f'#nodes tr[data-node="{node_id}"][data-state="serving"]', timeout=300_000)
    page.wait_for_function("document.querySelectorAll('.cell.n0').length === 0", timeout=60_000)
    assert c.errors == []
    page.context.close()


def test_the_console_asks_for_the_key_and_names_a_wrong_one(up_mesh: UpMesh, browser) -> None:  # type: ignore[no-untyped-def]
    c = open_console(browser, up_mesh, key=None)
    page = c.page
    page.wait_for_selector("#key-panel", state="visible", timeout=30_000)
    assert page.locator("#nodes tbody tr").count() == 0  # nothing shown without a key
    page.fill("#key-input", "not-the-key")
    page.press("#key-input", "Enter")
    page.wait_for_selector("#key-panel", state="visible", timeout=30_000)
    page.wait_for_function("document.getElementById('key-error').textContent.length > 0", timeout=30_000)
    assert "refused this key: Incorrect API key provided" in page.inner_text("#key-error")
    page.fill("#key-input", KEY)
    page.press("#key-input", "Enter")
    page.click("#tab-mesh")
    page.wait_for_selector('#nodes tr[data-node="node-0"]', timeout=60_000)
    assert page.locator("#key-panel").is_hidden()
    assert all("console-key" not in u for u in c.requests)  # the key never goes in a URL
    page.context.close()


def test_a_key_no_header_can_carry_is_named_not_kept(up_mesh: UpMesh, browser) -> None:  # type: ignore[no-untyped-def]
    # fetch throws on a header character beyond Latin-1 before any request leaves: kept, such a
    # key read as "gateway unreachable" on every request and, in session storage, after a reload
    c = open_console(browser, up_mesh, key=None)
    page = c.page
    page.wait_for_selector("#key-panel", state="visible", timeout=30_000)
    page.fill("#key-input", KEY + "\u2019")  # a curly quote pasted with the key
    page.press("#key-input", "Enter")
    assert "cannot carry" in page.inner_text("#key-error")
    assert page.locator("#key-panel").is_visible()
    assert page.evaluate("sessionStorage.getItem('meshnet-api-key')") is None
    page.fill("#key-input", KEY)
    page.press("#key-input", "Enter")
    page.click("#tab-mesh")
    page.wait_for_selector('#nodes tr[data-node="node-0"]', timeout=60_000)
    assert page.inner_text("#link") == "live"
    assert all("401" in e for e in c.errors), c.errors  # the first request's 401 only
    page.context.close()


# ---------- regressions found with a real browser ----------

LONG_PROMPT = "Write a long story about a dragon who learns to sail, with many chapters."


# headless Chromium shows every page as visible: a test hides a tab the way a browser does, with
# the document's visibilityState and a visibilitychange event
HIDE_HOOK = """
Object.defineProperty(document, "visibilityState", {get: () => window.testHidden ? "hidden" : "visible"});
Object.defineProperty(document, "hidden", {get: () => Boolean(window.testHidden)});
"""


def set_hidden(page, hidden: bool) -> None:  # type: ignore[no-untyped-def]
    page.evaluate("(h) => { window.testHidden = h; document.dispatchEvent(new Event('visibilitychange')); }", hidden)


def session(mesh: UpMesh, sid: str) -> dict[str, object]:
    """GET /v1/sessions/{sid}: the session's latest telemetry."""
    req = urllib.request.Request(f"{mesh.base}/v1/sessions/{sid}", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def session_over(mesh: UpMesh, sid: str, timeout: float = 120.0) -> dict[str, object]:
    """The session's telemetry once it is completed or failed."""
    deadline = time.monotonic() + timeout
    while (t := session(mesh, sid))["phase"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, f"session {sid} still {t['phase']} after {timeout} s"
        time.sleep(0.2)
    return t


def chat_requests(page) -> list[tuple[str, dict[str, object]]]:  # type: ignore[no-untyped-def]
    """Each chat completion the page sends from now on: its session id and its body."""
    sent: list[tuple[str, dict[str, object]]] = []
    page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and sent.append(
        (r.headers["x-route-session-id"], json.loads(r.post_data or "{}"))))
    return sent


def chat(page, prompt: str, *, max_tokens: str = "4", temperature: str | None = "0") -> None:  # type: ignore[no-untyped-def]
    """Send `prompt` from the chat form (temperature None: the field as it is)."""
    page.wait_for_selector("#model option[value='smollm2-135m-instruct']", state="attached", timeout=60_000)
    if temperature is not None:
        page.fill("#temperature", temperature)
    page.fill("#max-tokens", max_tokens)
    page.fill("#prompt", prompt)
    page.click("#send")


def wait_answer_text(page, chars: int = 20) -> None:  # type: ignore[no-untyped-def]
    page.wait_for_function("""(chars) => { const a = document.querySelectorAll('#transcript li.assistant');
        const last = a[a.length - 1];
        return last && last.querySelector('.answer').textContent.length >= chars; }""", arg=chars, timeout=120_000)


def test_hidden_tabs_and_chat_tabs_hold_no_connection(up_mesh: UpMesh, browser) -> None:  # type: ignore[no-untyped-def]
    # a browser opens at most 6 connections to the gateway across all its tabs (HTTP/1.1): the
    # mesh stream is open only while the Mesh view is on screen, so a 7th tab loads and chats
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.add_init_script(f"sessionStorage.setItem('meshnet-api-key', {json.dumps(KEY)})" + HIDE_HOOK)
    errors: list[str] = []

    def new_tab():  # type: ignore[no-untyped-def]
        page = context.new_page()
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        return page

    tabs = []
    for _ in range(6):
        page = new_tab()
        page.goto(up_mesh.base + "/")
        page.click("#tab-mesh")
        page.wait_for_selector('#nodes tr[data-node="node-0"]', timeout=60_000)
        set_hidden(page, True)  # a background tab, still on the Mesh view
        tabs.append(page)
    seventh = new_tab()
    seventh.goto(up_mesh.base + "/", timeout=30_000)
    chat(seventh, "Say hi")
    seventh.wait_for_selector("#transcript li.assistant[data-state='done'] .stats", timeout=120_000)
    for page in tabs:  # back in front, on the Chat view: still no mesh stream
        page.click("#tab-chat")
        set_hidden(page, False)
    chat(seventh, "Say hello")
    seventh.wait_for_selector("#transcript li.assistant:nth-of-type(4)[data-state='done'] .stats", timeout=120_000)
    with tabs[0].expect_response("**/v1/mesh/events", timeout=30_000):  # the Mesh view again: a fresh stream
        tabs[0].click("#tab-mesh")
    tabs[0].wait_for_function("() => document.getElementById('link').textContent === 'live'", timeout=30_000)
    set_hidden(tabs[0], True)
    tabs[0].wait_for_function("() => document.getElementById('link').textContent === 'connected'", timeout=30_000)
    with tabs[0].expect_response("**/v1/mesh/events", timeout=30_000):  # in front again: reopened
        set_hidden(tabs[0], False)
    assert errors == []
    context.close()


def test_a_hidden_tab_lets_go_of_its_running_answers_telemetry(up_mesh: UpMesh, browser) -> None:  # type: ignore[no-untyped-def]
    # a hidden tab keeps only the answer's own stream; shown again mid-answer, the telemetry
    # stream reopens and the answer ends with its stats as usual
    c = open_console(browser, up_mesh, init=HIDE_HOOK)
    page = c.page

    def telemetry(r) -> bool:  # type: ignore[no-untyped-def]
        return "/v1/sessions/" in r.url and r.url.endswith("/events")

    with page.expect_request(telemetry, timeout=60_000):
        chat(page, LONG_PROMPT, max_tokens="300")
    wait_answer_text(page)
    with page.expect_event("requestfailed", predicate=telemetry, timeout=30_000):  # aborted by the page
        set_hidden(page, True)
    assert page.get_attribute("#transcript li.assistant", "data-state") == "streaming"
    with page.expect_request(telemetry, timeout=30_000):
        set_hidden(page, False)
    page.wait_for_selector("#transcript li.assistant[data-state='done'] .stats", timeout=120_000)
    assert " tokens · route " in page.inner_text("#transcript li.assistant .stats")
    assert c.errors == []
    page.context.close()


def test_new_chat_stops_the_running_answer_and_keeps_nothing_of_it(up_mesh: UpMesh, browser) -> None:  # type: ignore[no-untyped-def]
    c = open_console(browser, up_mesh)
    page = c.page
    sent = chat_requests(page)
    chat(page, LONG_PROMPT, max_tokens="300")
    wait_answer_text(page)
    page.click("#clear")
    assert page.locator("#transcript li").count() == 0
    assert page.is_enabled("#send") and page.is_disabled("#stop")
    old = session_over(up_mesh, sent[0][0])
    assert old["phase"] == "failed", old  # aborted, not run to its end
    page.wait_for_timeout(1000)  # the old request's last steps had their chance to touch the new chat
    assert page.inner_text("#strip") == "idle"
    assert page.locator("#transcript li").count() == 0
    chat(page, "Say hi")
    page.wait_for_selector("#transcript li.assistant[data-state='done'] .stats", timeout=120_000)
    assert sent[1][1]["messages"] == [{"role": "user", "content": "Say hi"}]
    assert c.errors == []
    page.context.close()


def test_stop_shows_the_sessions_final_state(up_mesh: UpMesh, browser) -> None:  # type: ignore[no-untyped-def]
    c = open_console(browser, up_mesh)
    page = c.page
    sent = chat_requests(page)
    chat(page, LONG_PROMPT, max_tokens="300")
    wait_answer_text(page)
    # the route's process (one for node-0 and node-1) pauses around the Stop: no token comes for
    # the gateway to notice the closed stream by, so it notices late (its client poll), as on a
    # slow route, and a read right after the Stop still finds the session decoding
    route = up_mesh.pids("node-1")[-1]
    os.kill(route, signal.SIGSTOP)
    try:
        page.click("#stop")
        page.wait_for_selector("#transcript li.assistant[data-state='failed'] .stats", timeout=60_000)
    finally:
        os.kill(route, signal.SIGCONT)
    final = session_over(up_mesh, sent[0][0])
    assert final["phase"] == "failed" and int(final["generated_tokens"]) > 0, final  # type: ignore[call-overload]
    strip = page.inner_text("#strip")
    assert strip.startswith("failed · ") and f" · {final['generated_tokens']} tokens · " in strip, (strip, final)
    stats = page.inner_text("#transcript li.assistant .stats")
    assert f" · {final['generated_tokens']} tokens · " in stats, (stats, final)
    assert "stopped" in page.inner_text("#transcript li.assistant .error")
    page.context.close()


def test_a_phone_wraps_long_words_and_keeps_newlines(up_mesh: UpMesh, browser) -> None:  # type: ignore[no-untyped-def]
    c = open_console(browser, up_mesh, width=360, height=740)
    page = c.page
    prompt = "line one\nline two\n" + "0123456789" * 40
    chat(page, prompt)
    page.wait_for_selector("#transcript li.assistant[data-state='done'] .stats", timeout=120_000)
    assert page.evaluate("document.documentElement.scrollWidth") <= 361
    assert page.inner_text("#transcript li.user .text") == prompt
    assert c.errors == []
    page.context.close()


def test_empty_number_fields_are_left_out_and_bad_ones_named(up_mesh: UpMesh, browser) -> None:  # type: ignore[no-untyped-def]
    c = open_console(browser, up_mesh)
    page = c.page
    sent = chat_requests(page)
    chat(page, "Say hi", temperature="", max_tokens="")  # not set: the gateway's defaults
    page.wait_for_function("""() => { const a = document.querySelector('#transcript li.assistant');
        return a.dataset.state !== 'streaming' || a.querySelector('.answer').textContent.length > 0; }""",
                           timeout=120_000)
    page.locator("#stop").click(force=True)  # unless it already ended
    assert "temperature" not in sent[0][1] and "max_tokens" not in sent[0][1], sent[0][1]
    assert page.locator("#transcript li.assistant .answer").inner_text() != ""
    page.wait_for_selector("#send:enabled", timeout=30_000)
    page.fill("#temperature", "")
    page.type("#temperature", "1e")  # not a number (the field's value reads as empty)
    chat(page, "Say hi", temperature=None, max_tokens="0")  # and one out of range: named under the fields, not sent
    page.wait_for_selector("#form-error:has-text('Max tokens')", timeout=10_000)
    error = page.inner_text("#form-error")
    assert "Temperature" in error, error
    assert page.get_attribute("#max-tokens", "aria-invalid") == "true"
    page.wait_for_timeout(500)
    assert len(sent) == 1 and page.locator("#transcript li").count() == 2
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "4000")  # more than the model's context (2048 tokens for the bundled model)
    page.click("#send")
    page.wait_for_selector("#form-error:has-text('less than or equal to')", timeout=10_000)
    n_ctx = json.loads(urllib.request.urlopen(urllib.request.Request(
        up_mesh.base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}), timeout=30).read())["data"][0]["context_length"]
    assert f"Max tokens: Value must be less than or equal to {n_ctx}." in page.inner_text("#form-error")
    page.wait_for_timeout(500)
    assert len(sent) == 1
    page.fill("#max-tokens", "4")
    assert page.inner_text("#form-error") == ""
    page.click("#send")
    page.wait_for_selector("#transcript li.assistant:nth-of-type(4)[data-state='done'] .stats", timeout=120_000)
    assert sent[1][1]["max_tokens"] == 4 and sent[1][1]["temperature"] == 0, sent[1][1]
    assert c.errors == []
    page.context.close()


def test_a_page_loaded_without_a_route_reads_the_models_again_before_sending(up_mesh: UpMesh, browser) -> None:  # type: ignore[no-untyped-def]
    # /v1/models lists only a model the mesh can route: a page loaded while a node was down had
    # "(no routable model yet)" until a reload, and sent `"model": ""` (a 400 about a string length)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.add_init_script(f"sessionStorage.setItem('meshnet-api-key', {json.dumps(KEY)})")
    empty = {"left": 2}  # the page's first two reads find no route

    def models(route, _request) -> None:  # type: ignore[no-untyped-def]
        if empty["left"]:
            empty["left"] -= 1
            route.fulfill(status=200, content_type="application/json", body='{"object": "list", "data": []}')
        else:
            route.continue_()

    context.route("**/v1/models", models)
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    sent = chat_requests(page)
    page.goto(up_mesh.base + "/")
    page.wait_for_selector("#model option[value='']", state="attached", timeout=30_000)
    page.fill("#max-tokens", "4")
    page.fill("#prompt", "Say hi")
    page.click("#send")  # read again: still none, named and not sent
    page.wait_for_selector("#form-error:has-text('No routable model')", timeout=10_000)
    assert sent == [] and page.locator("#transcript li").count() == 0
    assert page.input_value("#prompt") == "Say hi"
    page.click("#send")  # the route is back: read again and sent
    page.wait_for_selector("#transcript li.assistant[data-state='done'] .stats", timeout=120_000)
    assert sent[0][1]["model"] == "smollm2-135m-instruct", sent
    assert page.inner_text("#form-error") == ""
    assert errors == []
    context.close()


def test_an_unreachable_gateway_is_named_and_the_strip_does_not_keep_the_old_phase(up_mesh: UpMesh, browser) -> None:  # type: ignore[no-untyped-def]
    # fetch's bare TypeError read "error: Failed to fetch" ("network error" when the gateway died
    # mid-answer), the strip kept the last phase it heard ("decode ...") and the header "connected"
    c = open_console(browser, up_mesh)
    page = c.page
    chat(page, "Say hi")
    page.wait_for_selector("#transcript li.assistant[data-state='done'] .stats", timeout=120_000)
    assert page.inner_text("#strip").startswith("completed · ")
    page.route("**/v1/chat/completions", lambda route, _request: route.abort("connectionrefused"))
    chat(page, "Say hello")
    page.wait_for_selector("#transcript li.assistant:nth-of-type(4)[data-state='failed'] .error", timeout=30_000)
    error = page.inner_text("#transcript li.assistant:nth-of-type(4) .error")
    assert error.startswith("error: the gateway could not be reached ("), error
    assert page.inner_text("#link") == "gateway unreachable"
    page.wait_for_timeout(500)
    assert page.inner_text("#strip") == "failed · the gateway did not answer"
    page.unroute("**/v1/chat/completions")
    chat(page, "Say hi")  # reached again: the header says so
    page.wait_for_selector("#transcript li.assistant:nth-of-type(6)[data-state='done'] .stats", timeout=120_000)
    assert page.inner_text("#link") == "connected"
    assert all("ERR_CONNECTION_REFUSED" in e for e in c.errors), c.errors  # the refused request only
    page.context.close()


def test_a_refused_request_leaves_no_stale_strip_and_reads_no_session(up_mesh: UpMesh, browser) -> None:  # type: ignore[no-untyped-def]
    # a request the gateway refuses (here more tokens than the context holds) never ran: the page
    # read its session anyway (a 404 in the browser's console) and the strip kept the previous
    # answer's "completed · ..." as if this one had completed
    c = open_console(browser, up_mesh)
    page = c.page
    sent = chat_requests(page)
    chat(page, "Say hi")
    page.wait_for_selector("#transcript li.assistant[data-state='done'] .stats", timeout=120_000)
    assert page.inner_text("#strip").startswith("completed · ")
    reads: list[str] = []
    page.on("request", lambda r: "/v1/sessions/" in r.url and not r.url.endswith("/events") and reads.append(r.url))
    chat(page, "Say hello", max_tokens="2040")  # within the field's bound (the context), not with the prompt
    page.wait_for_selector("#transcript li.assistant:nth-of-type(4)[data-state='failed'] .error", timeout=30_000)
    assert "maximum context length" in page.inner_text("#transcript li.assistant:nth-of-type(4) .error")
    page.wait_for_function("() => document.getElementById('strip').textContent.startsWith('failed · refused (HTTP 400')",
                           timeout=10_000)
    page.wait_for_timeout(500)
    assert reads == [] and len(sent) == 2
    assert all("400" in e for e in c.errors), c.errors  # the refused request's own status only
    page.context.close()


def ledger_events(mesh: UpMesh) -> int:
    req = urllib.request.Request(mesh.base + "/v1/ledger", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return int(json.loads(resp.read())["events"])


def test_the_work_ledger_shows_a_sessions_work_once_the_tracker_stored_it(up_mesh: UpMesh, browser) -> None:  # type: ignore[no-untyped-def]
    # the page read the ledger the moment a session left the Mesh State, before the tracker had
    # stored the session's audit events (a batch about a second later): the Mesh view kept the
    # ledger of one session before, until it was opened again
    c = open_console(browser, up_mesh)
    page = c.page
    page.click("#tab-mesh")
    page.wait_for_function("() => / events · /.test(document.getElementById('ledger-note').textContent)", timeout=60_000)
    before = ledger_events(up_mesh)
    # long enough to be on screen: the Mesh State stream sends at most every 0.5 s, and a short
    # answer (48 tokens, drafted on a fast hour) could start and end between two of its reads
    body = {"model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": 256, "speculative": False,
            "messages": [{"role": "user", "content": "Tell me a long story about the sea and a sailor."}]}
    req = urllib.request.Request(up_mesh.base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
                                          "x-route-session-id": "ledger-live"})
    done = threading.Thread(target=lambda: urllib.request.urlopen(req, timeout=180).read())
    done.start()
    page.wait_for_selector("#sessions td:has-text('ledger-live')", timeout=60_000)  # the page saw it live
    done.join()
    deadline = time.monotonic() + 30
    while (after := ledger_events(up_mesh)) == before:  # stored by the tracker
        assert time.monotonic() < deadline, "the ledger never counted the session"
        time.sleep(0.2)
    time.sleep(2)
    after = ledger_events(up_mesh)
    page.wait_for_function("(n) => document.getElementById('ledger-note').textContent.startsWith(n + ' events')",
                           arg=after, timeout=15_000)
    assert c.errors == []
    page.context.close()
