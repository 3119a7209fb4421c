"""The playground page in a real browser: Debian's Chromium driven by Playwright (the system
browser through executable_path; nothing downloaded), against a server on the tiny fixture with
n-gram speculation. It sends a prompt and checks that the coloured tokens and the charts appear
and agree with the API: the same request through /v1/completions (token by token, origin by
origin) and the engine's counters (/stats before and after the page's request).

Skips when no Chromium is installed (scripts/test.sh installs Debian's as root) or Playwright is
missing.
"""

from __future__ import annotations

import shutil

import pytest
import requests

pytest.importorskip("fastapi")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium on PATH: apt-get install chromium (scripts/test.sh does as root)"
)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")

from server_helpers import MODEL_NAME, counter_deltas, wait_until_idle  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
# Background of each kind as style.css paints it (accepted: by draft position)
ACCEPTED_SHADES = ["rgb(220, 237, 249)", "rgb(195, 224, 244)", "rgb(170, 211, 239)"]
CORRECTED, BONUS, NONE = "rgb(246, 199, 166)", "rgb(240, 228, 66)", "rgba(0, 0, 0, 0)"


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    """A fresh page that records console errors and uncaught exceptions (a CSP violation, a
    script error): every test ends by checking there were none. The page's CSP forbids eval, so
    waits use locator assertions (sync_api.expect), not wait_for_function."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.errors = []
    page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.set_default_timeout(60_000)
    yield page
    context.close()


def stats(srv) -> dict:
    wait_until_idle(srv)
    return requests.get(srv.url + "/stats", timeout=5).json()["stats"]


def page_tokens(page, selector: str) -> list[dict]:
    return page.eval_on_selector_all(selector + " .tok", """els => els.map(e => ({
        origin: e.dataset.origin, position: Number(e.dataset.position), step: Number(e.dataset.step),
        text: e.textContent, background: getComputedStyle(e).backgroundColor}))""")


def expected_background(origin: str, position: int) -> str:
    return {"accepted": ACCEPTED_SHADES[min(position, 2)], "corrected": CORRECTED, "bonus": BONUS}.get(origin, NONE)


def test_playground_colours_tokens_and_charts_agree_with_the_api(spec_server, page):
    page.goto(spec_server.url + "/")
    page.wait_for_selector("#legend .tok.o-accepted")
    assert "drafter ngram, k = 3" in page.text_content("#server-line")
    page.fill("#prompt", PROMPT)
    page.fill("#max-tokens", "40")
    page.check("#ignore-eos")
    before = stats(spec_server)
    page.click("#run")
    page.wait_for_selector("#output[data-done='true']")
    after = stats(spec_server)

    tokens = page_tokens(page, "#output")
    assert len(tokens) == 40 == int(page.get_attribute("#output", "data-completion-tokens"))
    for t in tokens:
        assert t["background"] == expected_background(t["origin"], t["position"]), t
    assert {"accepted", "target"} <= {t["origin"] for t in tokens}

    # the same request through the API: the same tokens with the same origins
    api = requests.post(spec_server.url + "/v1/completions", json={
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
        "return_token_origins": True}, timeout=60).json()["choices"][0]["token_origins"]
    assert [(t["origin"], t["step"], t["position"], t["text"]) for t in tokens] == [
        (o["origin"], o["step"], o["position"], o["token"] or "∅") for o in api]

    # the charts show what the engine counted for the page's request
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = counter_deltas(before["accepted_per_position"], after["accepted_per_position"])
    histogram = counter_deltas(before["accepted_count_histogram"], after["accepted_count_histogram"])
    assert drafts > 0
    # The page charts its own request (k positions); the server's lists may be longer (a shared
    # server's grammar-forced verifies past k), with nothing added there by this request.
    bars = page.eval_on_selector_all("#chart-position rect.bar", "els => els.map(e => Number(e.dataset.value))")
    assert bars == pytest.approx([a / drafts for a in accepted[: len(bars)]]) and not any(accepted[len(bars):])
    hist = page.eval_on_selector_all("#chart-histogram rect.bar", "els => els.map(e => Number(e.dataset.value))")
    assert hist == histogram[: len(hist)] and not any(histogram[len(hist):])
    mean_length = 1 + sum(accepted) / drafts
    assert page.text_content("[data-key='mean-acceptance-length']") == f"{mean_length:.2f}"
    assert page.text_content("[data-key='verifies']") == str(drafts)
    assert float(page.text_content("[data-key='tokens-per-second']")) > 0
    assert page.get_attribute("#chart-timeline polyline", "points").count(",") >= 2
    # the server panel polls /stats
    sync_api.expect(page.locator("#server-running")).to_have_text("0")
    assert page.text_content("#kv-text").endswith("%")
    assert not page.errors


def test_tokens_are_reachable_by_keyboard_and_explain_themselves(spec_server, page):
    page.goto(spec_server.url + "/")
    page.wait_for_selector("#legend .tok")
    page.fill("#prompt", PROMPT)
    page.fill("#max-tokens", "24")
    page.focus("#prompt")
    page.keyboard.press("Control+Enter")  # runs from the keyboard
    page.wait_for_selector("#output[data-done='true']")
    page.focus("#output")
    page.keyboard.press("ArrowRight")
    assert page.evaluate("document.activeElement === document.querySelector('#output .tok')")
    tooltip = page.locator("#tooltip")
    assert tooltip.is_visible() and "step 0" in tooltip.text_content()
    assert page.get_attribute("#output .tok", "aria-describedby") == "tooltip"
    page.keyboard.press("End")
    assert page.evaluate("document.activeElement === [...document.querySelectorAll('#output .tok')].pop()")
    corrected = page.locator("#output .o-corrected").first
    if corrected.count():
        corrected.hover()
        assert "the draft said" in tooltip.text_content()
    page.keyboard.press("Escape")
    assert tooltip.is_hidden()
    assert not page.errors


def test_chat_turn_and_stop(spec_server, page):
    page.goto(spec_server.url + "/")
    page.wait_for_selector("#legend .tok")
    page.check("input[name='mode'][value='chat']")
    page.fill("#prompt", "Tell me about foxes.")
    page.fill("#max-tokens", "12")
    page.click("#run")
    page.wait_for_selector("#output[data-done='true']")
    tokens = page_tokens(page, "#output")
    assert 0 < len(tokens) == int(page.get_attribute("#output", "data-completion-tokens"))
    # a long run stopped from the page: the stream closes and the server aborts the request
    page.fill("#max-tokens", "400")
    page.check("#ignore-eos")
    page.click("#run")
    page.wait_for_selector("#output .tok")
    page.click("#stop")
    sync_api.expect(page.locator("#play-status")).to_have_text("Stopped.")
    assert len(page_tokens(page, "#output")) < 400
    idle = wait_until_idle(spec_server)
    assert idle["num_requests_running"] == 0 and idle["num_free_kv_blocks"] == idle["num_kv_blocks"]
    assert not page.errors


def test_compare_view_runs_with_and_without_speculation(spec_server, page):
    page.goto(spec_server.url + "/")
    page.wait_for_selector("#legend .tok")
    page.focus("#tab-play")
    page.keyboard.press("ArrowRight")  # tabs follow the arrow keys
    assert page.get_attribute("#tab-compare", "aria-selected") == "true"
    assert page.is_visible("#view-compare") and page.is_hidden("#view-play")
    page.fill("#compare-prompt", PROMPT)
    page.fill("#compare-max-tokens", "24")
    page.check("#compare-ignore-eos")
    before = stats(spec_server)
    page.click("#compare-run")
    page.wait_for_selector("#compare-summary[data-same]")
    after = stats(spec_server)
    assert page.get_attribute("#compare-summary", "data-same") == "true"
    with_spec, without = page_tokens(page, "#pane-a"), page_tokens(page, "#pane-b")
    assert len(with_spec) == len(without) == 24
    assert [t["text"] for t in with_spec] == [t["text"] for t in without]
    assert {t["origin"] for t in without} == {"target"}
    assert "accepted" in {t["origin"] for t in with_spec}
    verifies = len({t["step"] for t in with_spec if t["origin"] != "target"})
    assert after["num_drafts"] - before["num_drafts"] == verifies  # the plain run drafted nothing
    assert "Same tokens both ways" in page.text_content("#compare-summary")
    assert not page.errors


def test_the_page_asks_for_the_api_key_and_sends_it(qwen3_checkpoint, server_factory, page):
    srv = server_factory(qwen3_checkpoint, api_key="sekret",
                         speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    page.goto(srv.url + "/")
    page.wait_for_selector("#key-form:not([hidden])")
    page.fill("#prompt", PROMPT)
    page.fill("#max-tokens", "8")
    page.click("#run")
    sync_api.expect(page.locator("#play-status")).to_contain_text("API key")
    page.fill("#api-key", "wrong")
    page.click("#key-form button")
    sync_api.expect(page.locator("#key-status")).to_contain_text("refused")
    page.fill("#api-key", "sekret")
    page.click("#key-form button")
    page.wait_for_selector("#key-form", state="hidden")
    page.click("#run")
    page.wait_for_selector("#output[data-done='true']")
    assert len(page_tokens(page, "#output")) == int(page.get_attribute("#output", "data-completion-tokens"))
    # the two refused requests were logged as 401s by the browser; nothing else went wrong
    assert all("401" in e for e in page.errors), page.errors
