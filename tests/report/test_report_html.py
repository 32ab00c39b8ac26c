"""The HTML morning report: what it collects over 30 nights, the page, the CLI and the daemon's folder.

The page itself is opened in a real browser in ``test_report_browser.py``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine

from robot_llm.commands.main import main
from robot_llm.config import load_config
from robot_llm.report.html import (
    ReportExtraMissing,
    build_morning,
    render_html,
    write_index,
    write_morning,
)
from robot_llm.store.db import Thesis, session_scope
from tests.report.conftest import DAY, NIGHTS


def test_morning_collects_thirty_nights_inputs_and_health(engine: Engine, month) -> None:
    config_path, stored = month
    config = load_config(config_path)
    m = build_morning(config, engine, DAY)
    by_ticker = {s.ticker: s for s in m.instruments}
    assert list(by_ticker) == ["SBER", "GAZP", "LKOH"]
    for ticker, nights in stored.items():
        section = by_ticker[ticker]
        assert [(p.night, p.stance, p.direction) for p in section.history] == nights
        last_night, stance, direction = nights[-1]
        assert last_night == DAY
        assert section.thesis is not None and section.thesis.stance == stance
        assert section.forecast is not None and section.forecast.direction == direction
        verdict = "agrees" if stance * direction > 0 else "disagrees" if stance * direction < 0 else "neutral"
        assert section.agreement.startswith(verdict)
        # News newest first; a javascript: link is shown as text, never as a link.
        assert [n.link for n in section.news] == [f"https://news.example/{ticker}", None]
    assert by_ticker["LKOH"].thesis is None and by_ticker["LKOH"].history == ()
    assert [h.day for h in m.health] == [n for n, _, _ in stored["SBER"]]
    assert [h.tokens_per_s for h in m.health] == [pytest.approx((100 + i) / 10.0) for i in range(NIGHTS)]
    assert [h.seconds for h in m.health] == [60.0 + i for i in range(NIGHTS)]
    # A shorter window shows fewer nights.
    assert len(build_morning(config, engine, DAY, nights=7).instruments[0].history) == 7


def test_page_is_self_contained_and_escaped(engine: Engine, month) -> None:
    config_path, _ = month
    config = load_config(config_path)
    with session_scope(engine) as session:  # the night's SBER thesis scored each of its two news items
        last = session.scalars(select(Thesis).where(Thesis.ticker == "SBER").order_by(Thesis.as_of.desc())).first()
        assert last is not None
        last.item_stances = [{"news_id": 1, "stance": 0.4, "label": "рост"}, {"news_id": 2, "stance": None}]
        last.item_stance = 0.4
    html = render_html(build_morning(config, engine, DAY), config)
    assert "per-item stance: 1 of 2 items scored, mean +0.40" in html
    # No network: no external scripts, stylesheets or images; plotly.js is inline.
    assert not re.search(r"<(script|img|link)[^>]+(src|href)=\"(https?:)?//", html)
    assert "Plotly.newPlot" in html and len(html) > 1_000_000  # plotly.js itself is inside
    for div in ("chart-SBER", "chart-GAZP", "chart-LKOH", "chart-health"):
        assert f'id="{div}"' in html
    assert "SBER headline 0 &lt;b&gt;" in html and "<b>" not in html.split("<body>")[1].split("<script")[0]
    assert 'href="javascript:' not in html
    assert "(рост)" in html  # the label without its scoring space
    assert "no thesis for this night" in html  # LKOH


def test_report_html_command_and_daemon_folder(engine: Engine, month, tmp_path: Path, capsys) -> None:
    config_path, _ = month
    target = tmp_path / "out" / "morning.html"
    assert main(["report", "-c", str(config_path), "--date", DAY.isoformat(), "--html", str(target)]) == 0
    assert f"report for {DAY.isoformat()}" in capsys.readouterr().out
    assert target.is_file() and 'id="chart-SBER"' in target.read_text(encoding="utf-8")

    config = load_config(config_path)
    for day in (DAY - timedelta(days=1), DAY):
        page = write_morning(config, engine, day)
        assert page == tmp_path / "reports" / f"morning-{day.isoformat()}.html"
    index = (tmp_path / "reports" / "index.html").read_text(encoding="utf-8")
    links = re.findall(r'href="(morning-[^"]+)"', index)
    assert links == [f"morning-{DAY.isoformat()}.html", f"morning-{(DAY - timedelta(days=1)).isoformat()}.html"]
    assert "<td>2</td>" in index  # two theses stored per night (available the same local day)
    # --html FILE is a page of its own, not one of the daemon's mornings.
    assert "no mornings yet" in write_index(tmp_path / "out").read_text(encoding="utf-8")


def test_without_plotly_the_error_names_the_extra(engine: Engine, month, tmp_path: Path, monkeypatch, capsys) -> None:
    config_path, _ = month
    monkeypatch.setitem(sys.modules, "plotly", None)  # what an install without the extra sees
    with pytest.raises(ReportExtraMissing, match=re.escape("pip install 'robot-llm[report]'")):
        write_morning(load_config(config_path), engine, DAY)
    code = main(["report", "-c", str(config_path), "--html", str(tmp_path / "x.html")])
    assert code != 0 and "pip install 'robot-llm[report]'" in capsys.readouterr().err
    assert not (tmp_path / "x.html").exists()


def test_daemon_with_html_dir_refuses_to_start_without_plotly(engine: Engine, month, monkeypatch) -> None:
    from robot_llm.daemon.scheduler import Daemon

    config_path, _ = month
    config = load_config(config_path)
    monkeypatch.setitem(sys.modules, "plotly", None)
    with pytest.raises(ReportExtraMissing, match=re.escape("pip install 'robot-llm[report]'")):
        Daemon(config, engine, install_signals=False).build_scheduler(config)  # at start, not at 08:45


def test_index_reads_each_pages_counts(tmp_path: Path) -> None:
    meta = json.dumps({"day": "2026-11-20", "theses": 5, "failed": 1}).replace('"', "&#34;")
    (tmp_path / "morning-2026-11-20.html").write_text(
        f'<html><head><meta name="robot-llm-morning" content="{meta}"></head></html>', encoding="utf-8"
    )
    html = write_index(tmp_path).read_text(encoding="utf-8")
    assert '<a href="morning-2026-11-20.html">2026-11-20</a></td>\n<td>5</td><td>1</td>' in html


def test_the_report_does_not_import_torch() -> None:
    """The morning page is drawn on the daemon's side: neither torch nor DeepSpeed on its import path."""
    code = (
        "import sys, robot_llm.report.html, plotly.graph_objects, plotly.subplots, plotly.io, plotly.offline; "
        "bad = [m for m in ('torch', 'deepspeed') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
