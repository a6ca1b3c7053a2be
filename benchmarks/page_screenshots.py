"""The server page's screenshots in docs/ (docs/serving.md, "The page"), taken as a person sees it:
`specdec serve` (a subprocess) with the default pair and auto, the page in headless Chromium
(Debian's `chromium` and `chromium-driver`, as the browser test), a greedy answer with "compare
with plain" on; then the same page at 360 px. Prints what the page showed (accepted drafts by
member against the usage block, tokens per pass, first token, the comparison) as JSON.

    python benchmarks/page_screenshots.py --out docs [--prompt "..."] [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

PROMPT = "Write a Python function that checks whether a string is a palindrome."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--method", default="auto")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--out", type=Path, default=Path("docs"))
    a = ap.parse_args()
    chromium, driver = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        print("no Chromium here: apt-get install chromium chromium-driver", file=sys.stderr)
        return 2
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    port = free_port()
    cmd = [
        str(Path(sys.executable).parent / "specdec"),
        "serve",
        "--target",
        a.target,
        "--draft",
        a.draft,
        "--drafter",
        a.method,
    ]
    server = subprocess.Popen([*cmd, "--port", str(port)], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        opts.add_argument(arg)
    browser = None
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise SystemExit("the server ended before it listened")
            time.sleep(1)
        browser = webdriver.Chrome(service=Service(driver), options=opts)
        wait = WebDriverWait(browser, 600)
        browser.get(url + "/")
        wait.until(lambda b: b.find_element(By.ID, "method").get_attribute("value"))
        box = browser.find_element(By.ID, "max-tokens")
        box.clear()
        box.send_keys(str(a.max_tokens))
        browser.find_element(By.ID, "compare").click()
        prompt = browser.find_element(By.ID, "prompt")
        prompt.send_keys(a.prompt)
        prompt.send_keys(Keys.ENTER)
        wait.until(lambda b: b.find_element(By.ID, "f-compare").get_attribute("data-identical") is not None)
        drafted = browser.find_elements(By.CSS_SELECTOR, "#log .msg.assistant .d")
        shown = {
            "drafted_by": dict(Counter(s.get_attribute("data-by") for s in drafted)),
            "accepted_coloured": sum(int(s.get_attribute("data-accepted")) for s in drafted),
            "accepted_usage": int(browser.find_element(By.ID, "f-accepted").get_attribute("data-usage")),
            **{f: browser.find_element(By.ID, f).text for f in ("f-rate", "f-alpha", "f-tau", "f-ttft", "f-compare")},
        }
        a.out.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(a.out / "page-desktop.png"))
        browser.set_window_size(360, 900)
        time.sleep(0.5)
        browser.save_screenshot(str(a.out / "page-narrow.png"))
        print(json.dumps(shown, indent=1, ensure_ascii=False))
    finally:
        if browser is not None:
            browser.quit()
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
