"""Crafted text cannot make the rails slow, on the way in or out, and the gateway keeps
answering while the rails work.

With Python's backtracking ``re``, 32 KB of `` +`` followed by 40 digits cost the phone rule
3.2 s of CPU, and 32 KB of "god mode enabled " cost the mode-switch heuristic 2 s, growing with
the square of the length; RE2 takes about 2 ms (tests/guardrails/test_regex_linear_time.py has
the per-pattern figures). Here the same texts go through the real app.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx

MODEL = "scripted-guarded"
PAYLOADS = {
    "phone": (" +" + "1" * 40) * 700,
    "phone_groups": "+1111 " * 5000,
    "mode_switch": "god mode enabled " * 1800,
    "card": "4111 " * 6000,
    "email": "a." * 14000 + "@",
    "iban": "DE00 " * 6000,
    "api_key": "sk-" + "a-" * 14000,
}


def _while_polling_health(gateway_url: str, work):
    """Run ``work`` while /health is asked every 50 ms; returns (work's result, slowest health)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(work)
        slowest = 0.0
        while not future.done():
            started = time.monotonic()
            assert httpx.get(gateway_url + "/health", timeout=10).status_code == 200
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.05)
        return future.result(), slowest


def test_crafted_input_is_checked_in_bounded_time(gateway_url, http):
    assert_crafted_input_is_checked_in_bounded_time(gateway_url, http)


def assert_crafted_input_is_checked_in_bounded_time(gateway_url: str, http: httpx.Client) -> None:
    """Each payload through the guarded model's input rails (``http``: a client with a key, based
    at ``gateway_url``), while /health is polled."""

    def send_all():
        out = {}
        for name, text in PAYLOADS.items():
            started = time.monotonic()
            r = http.post(
                "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": text}]}
            )
            out[name] = (r.status_code, r.json(), time.monotonic() - started)
        return out

    results, slowest_health = _while_polling_health(gateway_url, send_all)
    for name, (status, body, seconds) in results.items():
        assert status in (200, 400), (name, body)
        # The rails finished on their own (30 KB also means ~30 classifier embeddings, ~2 s
        # on this CPU), rather than running out of their time budget.
        assert status == 200 or body["error"]["code"] != "rail_error", (name, body)
        assert seconds < 8, f"{name}: {seconds:.2f}s"
    assert slowest_health < 1.0


def test_crafted_output_does_not_stall_the_ingress(gateway_url, http):
    """The output rails run in the ingress, on its event loop: a non-streamed answer is
    scanned whole. 15 KB of the phone rule's worst case cost ``re`` about 1.5 s there."""
    crafted = (" +" + "1" * 40) * 350
    script = f"[[say-hex:{crafted.encode().hex()[::-1]}]]"  # reversed hex: engines/scripted_engine.py

    def send():
        started = time.monotonic()
        r = http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "system", "content": script}, {"role": "user", "content": "go"}],
            },
        )
        return r, time.monotonic() - started

    (reply, seconds), slowest_health = _while_polling_health(gateway_url, send)
    assert reply.status_code == 200, reply.text
    assert seconds < 5 and slowest_health < 1.0, (seconds, slowest_health)
