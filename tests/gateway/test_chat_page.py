"""The built-in chat page, driven in a real browser: Debian's headless chromium through
playwright, against the fast-tier gateway (scripted engine, real Serve app).

A missing chromium fails these tests (`make browser` installs it); it never skips them.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import openai
import pytest

from tests.conftest import API_KEY, ROOT

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# The README's picture, refreshed only when asked (GATEWAY_UPDATE_SCREENSHOT=1): a test run
# leaves the working tree as it found it.
SCREENSHOT = ROOT / "docs" / "chat-page.png"
EXPECTED_STATUS = re.compile(r"status of 40[01] ")


def hexed(text: str) -> str:
    return text.encode().hex()[::-1]  # the scripted engine's -hex twins read hex backwards


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make browser` (apt-get install -y chromium)", pytrace=False)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, gateway_url):
    """A fresh browser profile on the chat page, with the key entered. Every request the page
    makes is recorded, and so is any dialog (an `alert` run by model text would show up)."""
    context = browser.new_context(viewport={"width": 1100, "height": 720})
    page = context.new_page()
    page.requests, page.dialogs, page.console_errors = [], [], []
    page.on("request", lambda r: page.requests.append(r.url))
    page.on("dialog", lambda d: (page.dialogs.append(d.message), d.dismiss()))
    # Script errors and CSP violations. The browser also logs every 4xx as an error: the 401
    # of the model list sent before the key is entered, and the 400 of a refused message.
    page.on("pageerror", lambda e: page.console_errors.append(str(e)))
    page.on(
        "console",
        lambda m: m.type == "error" and not EXPECTED_STATUS.search(m.text) and page.console_errors.append(m.text),
    )
    page.goto(gateway_url + "/")
    assert page.url == gateway_url + "/chat"  # `/` redirects to the page
    # Auth is on in the fast tier: the page says so until a key is entered.
    page.wait_for_selector("#notice:has-text('needs an API key')")
    page.fill("#api-key", API_KEY)
    page.locator("#api-key").blur()
    page.wait_for_selector("#model option[value='scripted']", state="attached")
    yield page
    # The page talks to the gateway that served it, and nothing else; no script error or CSP
    # violation happened on the way.
    assert all(url.startswith(gateway_url + "/") for url in page.requests), page.requests
    assert page.console_errors == []
    context.close()


def ask(page, model: str, text: str, *, wait: bool = True) -> None:
    page.select_option("#model", model)
    page.fill("#prompt", text)
    page.click("#send")
    if wait:
        page.wait_for_selector("#send:enabled", timeout=30_000)


def last_answer(page):
    return page.locator("#conversation .message.assistant").last


def test_the_answer_streams_in_token_by_token(page):
    # Record every text the answer shows while it streams.
    page.evaluate(
        """() => {
            window.__seen = [];
            new MutationObserver(() => {
                const answer = document.querySelector('#conversation .message.assistant:last-child .content');
                if (answer && answer.textContent !== window.__seen.at(-1)) window.__seen.push(answer.textContent);
            }).observe(document.getElementById('conversation'), {subtree: true, childList: true, characterData: true});
        }"""
    )
    words = "one two three four five six seven eight"
    ask(page, "scripted", f"[[delay-ms:80]][[say:{words}]]")
    assert last_answer(page).locator(".content").inner_text() == words
    seen = [s for s in page.evaluate("window.__seen") if s]
    assert len(seen) >= 4, seen  # arrived in pieces, not at once
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:])), seen  # and only ever grew
    assert seen[-1] == words
    assert "completion tokens" in last_answer(page).locator(".usage").inner_text()  # stream_options.include_usage
    # The key stays in this tab's sessionStorage (not remembered), the conversation in localStorage.
    assert page.evaluate("sessionStorage.getItem('gateway-chat.api-key')") == API_KEY
    assert page.evaluate("localStorage.getItem('gateway-chat.api-key')") is None
    page.reload()
    page.wait_for_selector("#model option[value='scripted']", state="attached")
    assert last_answer(page).locator(".content").inner_text() == words  # kept across reloads
    page.click("#new-chat")
    assert page.locator("#conversation .message").count() == 0
    assert page.evaluate("localStorage.getItem('gateway-chat.conversation')") == "[]"


def test_an_input_rail_refusal_is_shown(page, engine_events):
    ask(page, "scripted-guarded", "My card is 4111 1111 1111 1111, can you store it?")
    refusal = page.locator("#conversation .message.user .refusal").last
    assert "Refused by the gateway [pii_blocked]" in refusal.inner_text()
    assert page.locator("#conversation .message.assistant").count() == 0
    assert engine_events("started") == []  # nothing reached the engine
    # The refused message is not sent again with the next one.
    ask(page, "scripted-guarded", "What is the capital of France?")
    assert last_answer(page).locator(".content").inner_text() == "echo: What is the capital of France?"
    assert "4111" not in json.dumps(engine_events())


def test_an_output_rail_cut_is_shown(page):
    # Prose beside the directive: alone, "[[say-hex:[encoded]]]" reads to the injection
    # classifier as a markup command (0.84 with the artifact of 2026-12-05).
    ask(
        page,
        "scripted-guarded",
        f"Tell me a story. [[say-hex:{hexed('This part is fine, and then FORBIDDEN-WORD comes.')}]]",
    )
    answer = last_answer(page)
    assert "content_filter" in answer.locator(".cut").inner_text()
    assert "FORBIDDEN-WORD" not in answer.inner_text()


def test_stop_cancels_the_engine_call(page, engine_events):
    ask(page, "scripted", "[[delay-ms:200]][[tokens:300]]", wait=False)
    page.wait_for_function(
        "() => (document.querySelector('#conversation .message.assistant:last-child .content')?.textContent || '').includes('t3')"
    )
    page.click("#stop")
    page.wait_for_selector("#send:enabled")
    assert last_answer(page).locator(".stopped").inner_text() == "Stopped."
    deadline = time.monotonic() + 15
    while not engine_events("cancelled") and time.monotonic() < deadline:
        time.sleep(0.2)
    cancelled = engine_events("cancelled")
    assert cancelled and cancelled[-1]["tokens"] < 300, engine_events()
    assert engine_events("finished") == []


def test_model_output_is_shown_as_text_never_run(page):
    page.evaluate("window.__pwned = false")
    payload = '<script>alert(1)</script> and <img src=x onerror="window.__pwned=true"> and **bold**'
    ask(page, "scripted", f"[[say-hex:{hexed(payload)}]]")
    content = last_answer(page).locator(".content")
    text = content.inner_text()
    assert "<script>alert(1)</script>" in text and '<img src=x onerror="window.__pwned=true">' in text
    assert content.locator("script, img").count() == 0
    assert content.locator("strong").inner_text() == "bold"  # Markdown still renders
    time.sleep(0.5)
    assert page.evaluate("window.__pwned") is False
    assert page.dialogs == []


@pytest.fixture
def handbook_store(gateway_url):
    """A store named like scripted-guarded's retrieval policy says (names resolve to the
    newest store); deleted afterwards, so other tests' stores of that name resolve again."""
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    store = client.vector_stores.create(name="handbook")
    docs = {
        "vacation-policy.md": "# Vacation policy\n\nEvery employee gets 27 paid vacation days per year. "
        "Requests go through the HR portal at least two weeks ahead.",
        "remote-work.md": "# Remote work\n\nEmployees may work remotely up to three days a week, agreed with their manager.",
    }
    for name, text in docs.items():
        uploaded = client.files.create(file=(name, text.encode()), purpose="assistants")
        assert client.vector_stores.files.create(vector_store_id=store.id, file_id=uploaded.id).status == "completed"
    yield store
    client.vector_stores.delete(store.id)


def test_sources_and_a_screenshot_of_the_page_answering(page, handbook_store, engine_events, tmp_path):
    # What the scripted engine says comes from a system message the test adds on the way out,
    # so the page shows an ordinary conversation.
    answer = (
        "You get **27 paid vacation days** per year.\n\n"
        "To take them:\n"
        "1. Open the *HR portal*.\n"
        "2. Submit the request at least **two weeks** ahead.\n\n"
        "Your manager approves it there; check the balance with `GET /v1/vacation/balance`."
    )

    def add_script(route):
        body = json.loads(route.request.post_data)
        body["messages"].insert(0, {"role": "system", "content": f"[[delay-ms:20]][[say-hex:{hexed(answer)}]]"})
        route.continue_(post_data=json.dumps(body))

    page.route("**/v1/chat/completions", add_script)
    ask(page, "scripted-guarded", "How many vacation days do I get, and how do I request them?")
    reply = last_answer(page)
    assert reply.locator(".content strong").first.inner_text() == "27 paid vacation days"
    assert reply.locator(".content ol li").count() == 2
    sources = reply.locator(".sources li").all_inner_texts()
    assert sources and sources[0].startswith("vacation-policy.md (chunk 0"), sources
    prompt = engine_events("started")[-1]["prompt"]
    assert "27 paid vacation days" in prompt  # the passage the sources name reached the model
    shot = SCREENSHOT if os.environ.get("GATEWAY_UPDATE_SCREENSHOT") == "1" else tmp_path / SCREENSHOT.name
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000  # a picture of the page, not an empty one
