"""A real daemon (in a thread, real APScheduler, real child processes) on real databases."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from daemon_helpers import config_data, nightly_around, runs, wait_for, write_config
from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from robot_llm.commands.daemon import format_status
from robot_llm.commands.main import main
from robot_llm.config import AppConfig, load_config
from robot_llm.daemon.lease import acquire_lease, read_lease
from robot_llm.daemon.scheduler import Daemon
from robot_llm.store.db import GenerationRequest, Run, Thesis, make_engine, session_scope
from robot_llm.store.runs import NIGHTLY_KIND


class Running:
    """A Daemon serving in a background thread; ``stop()`` returns its exit code."""

    def __init__(self, config: AppConfig, engine: Engine) -> None:
        self.daemon = Daemon(config, engine, feed_interval=timedelta(seconds=0.5), install_signals=False)
        self.code: int | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        wait_for(self.daemon.started.is_set, 60, "the daemon to start")

    def _serve(self) -> None:
        self.code = self.daemon.run()

    def stop(self) -> int | None:
        self.daemon.request_stop("test")
        self.thread.join(timeout=90)
        assert not self.thread.is_alive(), "the daemon did not stop"
        return self.code


@pytest.fixture
def daemon_engine(db_url: str) -> Iterator[Engine]:
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


def _count(engine: Engine, model: type) -> int:
    with session_scope(engine) as session:
        return int(session.scalar(select(func.count()).select_from(model)) or 0)


def _finished(engine: Engine, kind: str, at_least: int = 1) -> list[Run]:
    done = [r for r in runs(engine, kind) if r.status != "running"]
    return done if len(done) >= at_least else []


def test_jobs_fire_and_status_shows_them(
    tmp_path: Path, db_url: str, daemon_engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    data = config_data(tmp_path, db_url)
    drop = tmp_path / "drop"
    drop.mkdir()
    data["signals"] = {"sources": [{"name": "robot", "drop_dir": str(drop)}]}
    data["report"] = {"html_dir": "reports"}
    path = write_config(tmp_path, data)
    config = load_config(path)
    generated = (datetime.now(timezone.utc) - timedelta(minutes=5)).isoformat()
    record = {"ticker": "T00", "generated_at": generated, "horizon": "1d", "direction": "up", "model": "gbm"}
    (drop / "s1.jsonl").write_text(json.dumps(record) + "\n", encoding="utf-8")

    running = Running(config, daemon_engine)
    try:
        # The feed polls at start-up and then every (test) interval; the first poll stores the item.
        polls = wait_for(lambda: _finished(daemon_engine, "ingest_feeds", at_least=3), 60, "three feed polls")[:3]
        assert [p.status for p in polls] == ["ok", "ok", "ok"]
        assert polls[0].counts["new"] == 1 and polls[0].counts["feed"] == "wire"
        assert all(p.counts["new"] == 0 for p in polls[1:])

        running.daemon.fire_now("signals")
        sig = wait_for(lambda: _finished(daemon_engine, "ingest_signals"), 60, "the signal ingest")
        assert sig[0].status == "ok" and sig[0].counts["stored"] == 1
        assert (drop / "processed" / "s1.jsonl").exists()

        # The morning: the report run, then its page and the index of mornings.
        running.daemon.fire_now("morning_report")
        wait_for(lambda: _finished(daemon_engine, "report"), 60, "the morning report")
        pages = wait_for(lambda: list((tmp_path / "reports").glob("morning-*.html")), 60, "the morning page")
        index = wait_for(lambda: (tmp_path / "reports" / "index.html").is_file(), 60, "the index of mornings")
        assert index and len(pages) == 1 and 'id="chart-T00"' in pages[0].read_text(encoding="utf-8")

        text = format_status(config, daemon_engine, datetime.now(timezone.utc))
        assert f"pid {running.daemon.pid}" in text and f"host {running.daemon.host}" in text
        assert re.search(r"^  ingest_feeds +(ok|running) ", text, re.M), text
        assert re.search(r"^  ingest_signals +ok ", text, re.M), text
        assert "nightly" in text and "serves" in text
    finally:
        code = running.stop()
    assert code == 0
    lease = read_lease(daemon_engine)
    assert lease is not None and lease.released
    assert main(["status", "-c", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"daemon: not running (last one: host {running.daemon.host}, pid {running.daemon.pid}" in out
    assert re.search(r"^  nightly +skipped .*cut-off", out, re.M), out  # the default test night was missed


def test_a_stale_lease_is_taken_over_and_a_night_past_its_cutoff_is_recorded_not_run(
    tmp_path: Path, db_url: str, daemon_engine: Engine
) -> None:
    data = config_data(tmp_path, db_url)
    now = datetime.now(timezone.utc)
    data["schedule"].update(nightly_around(now, fired_ago=timedelta(minutes=10), cutoff_in=timedelta(minutes=-5)))
    config = load_config(write_config(tmp_path, data))
    # A daemon on another host died a day ago mid-night: its lease is stale, its run still 'running'.
    dead = now - timedelta(days=1)
    acquire_lease(daemon_engine, holder="dead", host="old-box", pid=999, ttl=timedelta(minutes=3), now=dead)
    with session_scope(daemon_engine) as session:
        session.add(Run(kind=NIGHTLY_KIND, status="running", as_of=dead, started_at=dead, host="old-box", pid=999))

    running = Running(config, daemon_engine)  # takes the stale lease over
    try:
        lease = read_lease(daemon_engine)
        assert lease is not None and (lease.host, lease.pid) == (running.daemon.host, running.daemon.pid)
        nights = wait_for(lambda: runs(daemon_engine, NIGHTLY_KIND)[1:], 30, "the missed night's record")
    finally:
        assert running.stop() == 0
    orphan = runs(daemon_engine, NIGHTLY_KIND)[0]
    assert orphan.status == "aborted" and orphan.finished_at is not None
    assert len(nights) == 1 and nights[0].status == "skipped"
    assert nights[0].error is not None and "cut-off" in nights[0].error
    assert _count(daemon_engine, GenerationRequest) == 0  # nothing was planned, nothing generated


@pytest.mark.parametrize("empty_db_url", ["postgresql"], indirect=True)
def test_a_killed_child_is_recorded_and_the_next_start_resumes_the_night(
    tmp_path: Path, db_url: str, daemon_engine: Engine
) -> None:
    data = config_data(tmp_path, db_url, tickers=3)
    now = datetime.now(timezone.utc)
    data["schedule"].update(nightly_around(now, fired_ago=timedelta(minutes=2), cutoff_in=timedelta(hours=2)))
    config = load_config(write_config(tmp_path, data))

    running = Running(config, daemon_engine)  # inside the window: the missed night starts at once
    try:
        child = wait_for(lambda: running.daemon.child_pid, 60, "the generation child")
        os.kill(child, signal.SIGKILL)  # what the kernel's OOM killer does
        failed = wait_for(
            lambda: [r for r in runs(daemon_engine, NIGHTLY_KIND) if r.status == "failed"], 60, "the failure record"
        )
        assert "SIGKILL" in (failed[0].error or "") and f"pid {child}" in (failed[0].error or "")
        assert failed[0].counts["child_returncode"] == -signal.SIGKILL
        # The daemon keeps serving feeds after losing its child.
        polls = len(runs(daemon_engine, "ingest_feeds"))
        wait_for(lambda: len(runs(daemon_engine, "ingest_feeds")) >= polls + 2, 30, "feed polls after the kill")
        assert running.daemon.child_pid is None
    finally:
        assert running.stop() == 0

    # A restart inside the window resumes the same night: same requests, no duplicates.
    running = Running(config, daemon_engine)
    try:
        ok = wait_for(
            lambda: [r for r in runs(daemon_engine, NIGHTLY_KIND) if r.status == "ok"], 120, "the resumed night"
        )
    finally:
        assert running.stop() == 0
    assert ok[0].as_of == failed[0].as_of
    assert ok[0].counts["planned_created"] == 0 and ok[0].counts["planned_existing"] == 3
    with session_scope(daemon_engine) as session:
        statuses = session.scalars(select(GenerationRequest.status)).all()
        theses = session.scalars(select(Thesis.request_id)).all()
    assert sorted(statuses) == ["done"] * 3
    assert len(theses) == 3 and len(set(theses)) == 3
