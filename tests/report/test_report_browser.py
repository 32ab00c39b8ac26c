"""The morning page in a real browser: Debian's chromium driven by Playwright, the page opened from disk.

No browser is downloaded: Playwright drives the system chromium (``apt-get install chromium``;
``.ci/run`` installs it). Without it the test is skipped, except in CI (``CI=true``), where
it fails. The screenshot is left in ``test-artifacts/`` (or ``$ROBOT_LLM_TEST_ARTIFACTS``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

from robot_llm.config import load_config
from robot_llm.report.html import write_morning
from tests.report.conftest import DAY

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("ROBOT_LLM_CHROMIUM", "/usr/bin/chromium")
# Headless, and nothing that phones home: the page must render with no network at all.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
HANG_MS = 180_000


def _sync_playwright():
    missing = None
    try:
        from playwright.sync_api import sync_playwright
    except ModuleNotFoundError:
        missing = "playwright is not installed (pip install playwright)"
    if missing is None and not (shutil.which(CHROMIUM) or Path(CHROMIUM).is_file()):
        missing = f"{CHROMIUM} is not installed (apt-get install -y chromium)"
    if missing is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the browser check must run in CI: {missing}")
        pytest.skip(missing)
    return sync_playwright


@pytest.mark.slow
@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_morning_page_renders_in_chromium(engine: Engine, month) -> None:
    sync_playwright = _sync_playwright()
    config_path, stored = month
    config = load_config(config_path)
    page_path = write_morning(config, engine, DAY)
    artifacts = Path(os.environ.get("ROBOT_LLM_TEST_ARTIFACTS", REPO / "test-artifacts")) / "report"
    artifacts.mkdir(parents=True, exist_ok=True)

    problems: list[str] = []
    requests: list[str] = []
    with sync_playwright() as p:
        # Playwright's 30 s default bounds every step; on a loaded 2-core CI machine chromium's start
        # and the page's 4 MB of inlined plotly may take long: a timeout here only bounds a hang.
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=HANG_MS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(HANG_MS)
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_path.as_uri(), wait_until="load")
            tickers = [i.ticker for i in config.instruments]
            # Every chart drawn: plotly replaces each chart div's content with its SVG.
            page.wait_for_function(
                "n => document.querySelectorAll('.js-plotly-plot .main-svg').length >= n", arg=len(tickers) + 1
            )
            for ticker in tickers:
                section = page.locator(f'section[data-ticker="{ticker}"]')
                assert section.count() == 1, ticker
                assert section.locator("h2").inner_text().startswith(ticker)
                assert section.locator(".js-plotly-plot .main-svg").count() >= 1, f"{ticker}: no chart drawn"
            for ticker, nights in stored.items():
                # One stance marker per night in the instrument's chart (plotly draws each point).
                points = page.locator(f"#chart-{ticker} .scatterlayer .trace").first.locator(".point")
                assert points.count() == len(nights), ticker
            assert page.locator("#chart-health .main-svg").count() >= 1
            assert page.locator("#LKOH").inner_text().count("no thesis for this night") == 1
            page.screenshot(path=str(artifacts / "morning.png"), full_page=True)
        finally:
            browser.close()
    assert problems == []
    assert [u for u in requests if not u.startswith(("file:", "data:", "blob:"))] == []
    assert (artifacts / "morning.png").stat().st_size > 10_000
