"""The track record in the morning: the text report's summary, the HTML page's section with a chart per instrument."""

from __future__ import annotations

import random
import re
from datetime import date
from pathlib import Path

import pytest
from track_helpers import DEMO_TICKERS, config_file, seed_nights, write_prices

from robot_llm.commands.main import main
from robot_llm.config import load_config
from robot_llm.report.summary import format_report, report_job
from robot_llm.report.track_record import build_view, report_as_of
from robot_llm.store.db import make_engine


def test_morning_text_and_page(tmp_path: Path, db_url: str) -> None:
    pytest.importorskip("plotly")
    from robot_llm.report.html import write_report

    rng = random.Random(9)
    write_prices(tmp_path / "prices", rng, DEMO_TICKERS, date(2026, 11, 1), 40)
    config = load_config(config_file(tmp_path, db_url, {"csv": "prices", "min_count": 5, "bootstrap": 50}))
    engine = make_engine(db_url)
    try:
        seed_nights(engine, rng, first=date(2026, 11, 2), nights=12, templates=("brief_en", "two_way"))
        assert main(["prices", "ingest", "-c", str(config.source)]) == 0
        day = date(2026, 11, 16)
        text = format_report(report_job(config, engine, day), config)
        assert "track record as of 2026-11-17 09:30 MSK:" in text
        assert re.search(r"brief_en \(gemma-3-270m\), horizon 1d:\n  all +all time: n \d+", text), text
        view = build_view(config, engine, day)
        assert view is not None and view.as_of == report_as_of(config, day)
        # The morning after the 16th knows nothing later: every outcome's exit is before its moment.
        assert all(o.exit_time <= view.as_of for outs in view.outcomes.values() for o in outs)
        assert all(t.available_at <= view.as_of for outs in view.outcomes.values() for t in (o.thesis for o in outs))
        page = write_report(config, engine, day, tmp_path / "morning.html").read_text(encoding="utf-8")
    finally:
        engine.dispose()
    section = page[page.index('<section id="track-record">') : page.index('<section id="health">')]
    assert section.count('class="chart" data-track=') == len(DEMO_TICKERS)
    for ticker in DEMO_TICKERS:
        assert f'id="track-{ticker}"' in section
    assert "stance vs 1d return" in section and "rolling IC (last 5 outcomes)" in section
    assert section.count("<tr>") == 1 + len(view.rows)


def test_no_prices_no_section(tmp_path: Path, db_url: str) -> None:
    config = load_config(config_file(tmp_path, db_url, {}))
    engine = make_engine(db_url)
    try:
        assert build_view(config, engine, date(2026, 11, 16)) is None
        assert "track record" not in format_report(report_job(config, engine, date(2026, 11, 16)), config)
    finally:
        engine.dispose()
