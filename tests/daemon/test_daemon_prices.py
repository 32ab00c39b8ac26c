"""The daemon takes in closes on the ``prices.schedule`` cron, like feeds and signals (real APScheduler)."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

from daemon_helpers import config_data, runs, wait_for, write_config
from sqlalchemy import func, select

from robot_llm.clock import upcoming_fires
from robot_llm.config import load_config
from robot_llm.daemon.scheduler import Daemon
from robot_llm.store.db import Price, make_engine, session_scope, utcnow


def _prices(engine) -> int:
    with session_scope(engine) as s:
        return int(s.scalar(select(func.count()).select_from(Price)) or 0)


def test_prices_are_ingested_on_schedule(tmp_path: Path, db_url: str) -> None:
    folder = tmp_path / "closes"
    folder.mkdir()
    (folder / "T00.csv").write_text("time,close\n2026-11-30,10\n2026-12-01,11\n", encoding="utf-8")
    data = config_data(tmp_path, db_url)
    data["feeds"] = []
    data["prices"] = {"csv": str(folder), "schedule": "0 0 1 1 *"}  # once a year: only start-up and fire_now
    config = load_config(write_config(tmp_path, data))
    assert [f.job for f in upcoming_fires(config, utcnow())].count("prices") == 1
    engine = make_engine(db_url)
    daemon = Daemon(config, engine, feed_interval=timedelta(seconds=1), install_signals=False)
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    try:
        wait_for(daemon.started.is_set, 60, "the daemon to start")
        first = wait_for(lambda: [r for r in runs(engine, "ingest_prices") if r.status != "running"], 60, "ingest")
        assert first[0].status == "ok" and first[0].counts["stored"] == 2 and _prices(engine) == 2
        (folder / "T01.csv").write_text("time,close\n2026-12-01,5\n2026-12-02,bad\n", encoding="utf-8")
        daemon.fire_now("prices")
        done = wait_for(lambda: [r for r in runs(engine, "ingest_prices") if r.status != "running"][1:], 60, "again")
        assert done[0].counts == {
            "files": 2,
            "stored": 1,
            "duplicates": 2,
            "rejected": 1,
            "conflicts": 0,
            "errors": 0,
        }
    finally:
        daemon.request_stop("test")
        thread.join(timeout=90)
        engine.dispose()
    assert not thread.is_alive()
