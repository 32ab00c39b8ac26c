"""The ingest CLI on the bundled sample feeds and signals: `ingest feeds|signals`, `news list`, `signals list`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from ingest_helpers import DEMO, write_config
from sqlalchemy.engine import Engine

from robot_llm.commands.main import main


def _url(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=False).replace("postgresql+psycopg://", "postgresql://")


def test_ingest_and_list_on_bundled_samples(engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    drop = tmp_path / "drop"
    drop.mkdir()
    for name in ("sample-signals.jsonl", "sample-signals.csv"):
        shutil.copy(DEMO / "signals" / name, drop / name)
    feeds = DEMO / "feeds"
    cfg = write_config(
        tmp_path,
        _url(engine),
        feeds=[
            {"name": "ru-1251", "url": str(feeds / "ru-news-windows-1251.rss")},
            {"name": "ru-atom", "url": (feeds / "ru-markets-utf8.atom").as_uri()},
            {"name": "en", "url": str(feeds / "en-markets.rss")},
        ],
        drop_dirs=[drop],
    )
    assert main(["ingest", "feeds", "-c", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "ru-1251: 6 new, 0 duplicate" in out
    assert "ru-atom: 3 new, 1 duplicate" in out
    assert "en: 5 new, 0 duplicate" in out

    # Local files unchanged since the last run count as not modified.
    assert main(["ingest", "feeds", "-c", str(cfg), "--feed", "en"]) == 0
    assert capsys.readouterr().out.strip() == "en: not modified"

    assert main(["news", "list", "-c", str(cfg), "--json", "--ticker", "SBER"]) == 0
    sber = json.loads(capsys.readouterr().out)
    assert {n["title"] for n in sber} == {
        "Набсовет Сбербанка рекомендовал дивиденды за девять месяцев",
        "ЦБ сохранил ключевую ставку на уровне 16%",
        "Sberbank and Gazprom lead Moscow blue chips higher",
    }
    assert all("SBER" in n["tickers"] and n["fetched_at"].endswith("+00:00") for n in sber)

    assert main(["news", "list", "-c", str(cfg), "--json", "--since", "1d"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 14
    assert main(["news", "list", "-c", str(cfg), "--since", "2000-01-01T00:00:00Z", "--ticker", "NVDA"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all("NVDA" in line for line in lines)

    assert main(["ingest", "signals", "-c", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "robot0: sample-signals.csv: 3 stored, 0 duplicate, 1 rejected" in out
    assert "unknown tickers: MSFT" in out
    assert main(["signals", "list", "-c", str(cfg), "--json", "--ticker", "NVDA"]) == 0
    nvda = json.loads(capsys.readouterr().out)
    assert sorted(s["horizon"] for s in nvda) == ["1d", "1w"]
    assert main(["signals", "list", "-c", str(cfg)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 7


def test_failed_feed_exits_nonzero_and_unknown_feed_is_an_error(
    engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write_config(
        tmp_path,
        _url(engine),
        feeds=[
            {"name": "gone", "url": str(tmp_path / "gone.xml")},
            {"name": "en", "url": str(DEMO / "feeds" / "en-markets.rss")},
        ],
    )
    assert main(["ingest", "feeds", "-c", str(cfg)]) == 1
    out = capsys.readouterr().out
    assert "gone: FAILED: " in out and "en: 5 new" in out and "1 of 2 feeds failed" in out
    assert main(["ingest", "feeds", "-c", str(cfg), "--feed", "nope"]) == 2
    assert "unknown feed 'nope'" in capsys.readouterr().err
