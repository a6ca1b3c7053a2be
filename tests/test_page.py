"""The server's own web page (`specdec serve`, then a browser at its root): served whole, small and
with nothing from elsewhere; the stream extension it reads (`stream_options.include_steps`); and
the page itself driven in a real headless Chromium (Debian's `chromium` and `chromium-driver`,
docs/development.md), skipped with the reason where none is installed. SmolLM2-135M in its exact
mode, drafting for itself, so greedy answers are identical to plain decoding's and most drafts
are accepted."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from helpers import Running

from specdec.server import ServeSettings, create_app
from specdec.server.page import FILES

KEY = "page-key"
REPEAT = "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"
WEIGHT = 200 * 1024  # the page's bytes: its html, script and style (issue 59's limit)
OUTSIDE = r"""(src|href)\s*=\s*["'](https?:)?//|url\(\s*["']?(https?:)?//|fetch\(\s*["'](https?:)?//"""

pytestmark = [pytest.mark.real, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(smollm2_exact):
    app = create_app(
        smollm2_exact, smollm2_exact, ServeSettings("smollm2-135m", "auto", {}, max_batch=4, api_keys=(KEY,))
    )
    running = Running(app)
    yield running
    running.close()


def _chat(server, stream: bool, **extra) -> httpx.Response:
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": REPEAT}],
        "max_tokens": 24,
        "temperature": 0,
        "stream": stream,
        **extra,
    }
    return httpx.post(
        server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
    )


def _chunks(resp: httpx.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in resp.text.split("\n\n") if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def test_the_page_is_served_whole_small_and_self_contained(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    total = 0
    paths = {"index.html": "/", "stats.html": "/stats"}
    for name in FILES:
        r = httpx.get(server.url + paths.get(name, f"/page/{name}"))
        assert r.status_code == 200 and r.headers["content-type"] == FILES[name], name
        total += len(r.content)
        # (nothing the browser would fetch from elsewhere: no absolute or scheme-relative URL)
        assert not re.search(OUTSIDE, r.text), name
    assert total <= WEIGHT, total
    assert httpx.get(server.url + "/page/nothing.js").status_code == 404
    assert httpx.get(server.url + "/page/index.html").status_code == 404  # (pages have their own paths)
    health = httpx.get(server.url + "/health").json()  # (open: the page asks for the key)
    assert health["keys"] is True and health["method"] == "auto" and "draft-model" in health["methods"]
    assert "none" in health["methods"] and "prediction" not in health["methods"]


def test_the_stream_says_which_pass_committed_each_piece_and_who_drafted_it(server):
    plain = _chat(server, False, speculative={"method": "none"}).json()["choices"][0]["message"]["content"]
    chunks = _chunks(_chat(server, True, stream_options={"include_usage": True, "include_steps": True}))
    usage = chunks[-1]["usage"]
    steps = [c["speculative"] for c in chunks if "speculative" in c]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == plain  # greedy: what plain decoding writes
    assert [s["pass"] for s in steps] == list(range(len(steps)))  # the prefill's token, then every pass
    assert sum(s["accepted"] for s in steps) == usage["speculative"]["accepted_tokens"] > 0
    assert sum(s["proposed"] for s in steps) == usage["speculative"]["draft_tokens"]
    assert sum(s["tokens"] for s in steps) == usage["completion_tokens"]
    assert len(steps) - 1 == usage["speculative"]["target_passes"]
    assert {s["by"] for s in steps if s["proposed"]} <= {"draft-model", "suffix", "prompt-lookup", "lookahead"}
    assert all(s["by"] is None for s in steps if not s["proposed"])
    for c in chunks:
        s = c.get("speculative")
        if s is not None:
            content = c["choices"][0]["delta"].get("content", "")
            assert s["drafted_chars"] <= len(content) and (s["drafted_chars"] > 0) == (s["accepted"] > 0), (s, content)
    # off unless asked for: an OpenAI client sees OpenAI's chunks
    assert not any("speculative" in c for c in _chunks(_chat(server, True)))


# -- the page in a real browser ---------------------------------------------------------------
def _browser(width: int):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip(
            "no Chromium here (the browser test drives Debian's chromium with its driver: "
            "`apt-get install chromium chromium-driver`, docs/development.md)"
        )
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},900"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL"})  # every request the browser makes
    return webdriver.Chrome(service=Service(driver), options=opts)


def _requests(browser) -> list[str]:
    urls = []
    for entry in browser.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            urls.append(msg["params"]["request"]["url"])
    return urls


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def _ttft(server) -> tuple[float, float]:
    """The server's time-to-first-token histogram: (sum of seconds, requests)."""
    name = "specdec_time_to_first_token_seconds"
    return _metric(server, name + "_sum"), _metric(server, name + "_count")


@pytest.fixture
def open_server(smollm2_exact):
    running = Running(create_app(smollm2_exact, None, ServeSettings("smollm2-135m")))
    yield running
    running.close()


def test_the_page_in_a_real_browser(server, open_server, smollm2_exact, tmp_path):
    """Load the page, a wrong key's clear message, a greedy answer streamed with its accepted
    drafts coloured (as many as the usage block counts), the comparison with plain, Stop with
    Esc, and the narrow layout; every request the browser made went to this server; screenshots
    kept (`SPECDEC_ARTIFACTS`, else the test's own folder)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select, WebDriverWait

    shots = Path(os.environ.get("SPECDEC_ARTIFACTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    browser = _browser(1280)
    try:
        wait = WebDriverWait(browser, 60)
        browser.get(server.url + "/")
        wait.until(lambda b: b.find_element(By.ID, "method").get_attribute("value") == "auto")
        assert browser.find_element(By.ID, "key-box").is_displayed()  # this server has keys

        def ask(text: str) -> None:
            box = browser.find_element(By.ID, "prompt")
            box.send_keys(text)
            box.send_keys(Keys.ENTER)  # (Enter sends)

        def idle(b) -> bool:
            return b.find_element(By.ID, "send").is_enabled() and not b.find_element(By.ID, "stop").is_enabled()

        # a wrong key: one clear line, nothing streamed
        browser.find_element(By.ID, "key").send_keys("wrong")
        ask(REPEAT)
        wait.until(lambda b: b.find_element(By.ID, "error").is_displayed())
        assert "API key" in browser.find_element(By.ID, "error").text
        browser.find_element(By.ID, "clear").click()

        # a greedy answer with auto: streamed, its accepted drafts coloured by who drafted them
        key = browser.find_element(By.ID, "key")
        key.clear()
        key.send_keys(KEY)
        # (what a request carries: the picked model, k, the sampling settings; blank k: the server's)
        browser.find_element(By.CSS_SELECTOR, "#more summary").click()  # (k and the rest of sampling)
        for field, value in (("k", "3"), ("top-p", "0.9"), ("top-k", "40"), ("seed", "7")):
            browser.find_element(By.ID, field).clear()
            browser.find_element(By.ID, field).send_keys(value)
        sent = browser.execute_script("return body(null, true, number('k'))")
        assert sent["model"] == "smollm2-135m" and sent["speculative"] == {"method": "auto", "k": 3}
        assert (sent["top_p"], sent["top_k"], sent["seed"], sent["temperature"]) == (0.9, 40, 7, 0)
        assert browser.execute_script("return body('none', false, 3)")["speculative"] == {"method": "none"}
        for field in ("k", "top-p", "top-k", "seed"):
            browser.find_element(By.ID, field).clear()
        browser.find_element(By.ID, "max-tokens").clear()
        browser.find_element(By.ID, "max-tokens").send_keys("24")
        before = _ttft(server)
        ask(REPEAT)
        wait.until(lambda b: b.find_element(By.ID, "f-accepted").get_attribute("data-usage") is not None)
        wait.until(idle)
        after = _ttft(server)
        assert after[1] == before[1] + 1
        server_ttft_ms = 1e3 * (after[0] - before[0])
        page_ttft_ms = float(browser.find_element(By.ID, "f-ttft").text.removesuffix(" ms"))
        assert page_ttft_ms <= server_ttft_ms + 100, (page_ttft_ms, server_ttft_ms)
        drafted = browser.find_elements(By.CSS_SELECTOR, "#log .msg.assistant .d")
        assert drafted, "no accepted draft was coloured"
        usage = int(browser.find_element(By.ID, "f-accepted").get_attribute("data-usage"))
        assert sum(int(s.get_attribute("data-accepted")) for s in drafted) == usage > 0
        assert {s.get_attribute("data-by") for s in drafted} <= {"draft-model", "suffix", "prompt-lookup", "lookahead"}
        assert all("by-" in s.get_attribute("class") and s.get_attribute("title").startswith("pass ") for s in drafted)
        drafted[0].click()  # (a tap shows a piece's pass, as a hover does)
        assert browser.find_element(By.ID, "step").text == drafted[0].get_attribute("title")
        answer = browser.find_element(By.CSS_SELECTOR, "#log .msg.assistant").text
        plain = _chat(server, False, speculative={"method": "none"}).json()["choices"][0]["message"]["content"]
        assert answer == plain
        # the picker lists what /v1/models lists, once the key lets the page ask
        models = Select(browser.find_element(By.ID, "model-pick")).options
        assert [o.get_attribute("value") for o in models] == ["smollm2-135m"]
        assert models[0].get_attribute("title") == f"context {smollm2_exact.model.args.max_seq_len} tokens"
        for fig in ("f-rate", "f-alpha", "f-tau"):
            assert browser.find_element(By.ID, fig).text != "–", fig

        # compare with plain: the same request again with method none, and the verdict
        browser.find_element(By.ID, "clear").click()
        browser.find_element(By.ID, "compare").click()
        ask(REPEAT)
        wait.until(lambda b: b.find_element(By.ID, "f-compare").get_attribute("data-identical") is not None)
        verdict = browser.find_element(By.ID, "f-compare")
        assert verdict.get_attribute("data-identical") == "true" and "identical" in verdict.text
        assert float(verdict.get_attribute("data-speedup")) > 0
        browser.save_screenshot(str(shots / "page-desktop.png"))

        # readable at 360 px: nothing wider than the screen
        browser.set_window_size(360, 800)
        time.sleep(0.3)
        assert browser.execute_script("return document.documentElement.scrollWidth") <= 360
        browser.save_screenshot(str(shots / "page-narrow.png"))
        browser.set_window_size(1280, 900)

        # Stop, by the keyboard (Esc), mid-answer
        browser.find_element(By.ID, "compare").click()
        Select(browser.find_element(By.ID, "method")).select_by_value("draft-model")
        browser.find_element(By.ID, "max-tokens").clear()
        browser.find_element(By.ID, "max-tokens").send_keys("400")
        browser.find_element(By.ID, "k").send_keys("3")
        ask("Write a long story about a lighthouse keeper.")
        wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#log .msg.assistant")) == 2)
        wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#log .msg.assistant")[-1].text) > 20)
        browser.find_element(By.TAG_NAME, "body").send_keys(Keys.ESCAPE)
        wait.until(idle)
        stopped = browser.find_elements(By.CSS_SELECTOR, "#log .msg.assistant")[-1]
        assert stopped.text.endswith("[stopped]")
        # (what was written before the stop stays in the conversation the next turn sends)
        last = browser.execute_script("return state.messages[state.messages.length - 1]")
        assert last["role"] == "assistant" and last["content"].strip() == stopped.text.removesuffix("[stopped]").strip()
        proposed = [
            int(m)
            for s in stopped.find_elements(By.CSS_SELECTOR, "span[title^='pass ']")
            for m in re.findall(r"(\d+) proposed", s.get_attribute("title"))
        ]
        assert proposed and max(proposed) <= 3  # (k 3, as the page asked)

        urls = _requests(browser)
        assert urls and all(u.startswith(server.url) or u.startswith("data:") for u in urls), urls
        browser.get(server.url + "/stats")
        wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#methods tbody tr")) > 0)
        assert "auto" in browser.find_element(By.ID, "methods").text

        # a server without keys: no key asked for
        browser.get(open_server.url + "/")
        wait.until(lambda b: b.find_element(By.ID, "method").get_attribute("value") == "none")
        assert not browser.find_element(By.ID, "key-box").is_displayed()
        assert Select(browser.find_element(By.ID, "model-pick")).first_selected_option.text == "smollm2-135m"
    finally:
        browser.quit()
    assert time.perf_counter() - t0 < 60
