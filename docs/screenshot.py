"""Remake docs/playground.png: the playground page with a reply streamed from the shipped model, a token hovered.

Run from the repository root with `aftgen serve --port 8765` running in another shell:
    .venv/bin/python docs/screenshot.py
(Debian's Chromium at /usr/bin/chromium, driven by Playwright's client.)
"""

import tempfile

from playwright.sync_api import sync_playwright

URL = "http://127.0.0.1:8765/"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]  # fmt: skip

with sync_playwright() as playwright, tempfile.TemporaryDirectory() as profile:
    browser = playwright.chromium.launch_persistent_context(
        profile, executable_path="/usr/bin/chromium", headless=True, args=FLAGS, viewport={"width": 1200, "height": 840}
    )
    page = browser.new_page()
    page.goto(URL)
    page.click("#tab-completion")
    for name, value in {"session": "demo", "seed": "42", "max_tokens": "160", "temperature": "0.8"}.items():
        page.fill(f"#{name}", value)
    page.fill("#input", "ROMEO:\n")
    page.press("#input", "Enter")
    page.wait_for_function("() => document.querySelector('.reply').dataset.state === 'done'")
    page.fill("#input", "JULIET:")
    page.hover(".reply .token >> nth=45")  # a token's probability and its likeliest alternatives
    page.screenshot(path="docs/playground.png")
    browser.close()
