"""``robot-llm run`` as a real process: one instance, signals, config reload, clean stop mid-batch."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from daemon_helpers import REPO, config_data, nightly_around, runs, start_daemon, stop_process, wait_for, write_config
from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from robot_llm.daemon.lease import read_lease
from robot_llm.store.db import GenerationRequest, Thesis, make_engine, session_scope
from robot_llm.store.runs import NIGHTLY_KIND


@pytest.fixture
def daemon_engine(db_url: str) -> Iterator[Engine]:
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _log_records(path: Path) -> list[dict[str, object]]:
    records = []
    # Complete lines only (bytes, so a cut character cannot fail the decoding): the daemon may be
    # writing the last one while we read.
    for line in path.read_bytes().split(b"\n")[:-1]:
        if line.startswith(b"{"):
            records.append(json.loads(line))
    return records


def _theses(engine: Engine) -> list[int]:
    with session_scope(engine) as session:
        return list(session.scalars(select(Thesis.request_id)).all())


@pytest.mark.parametrize("empty_db_url", ["postgresql"], indirect=True)
def test_a_second_daemon_is_refused_and_a_bad_reload_keeps_the_old_config(
    tmp_path: Path, db_url: str, daemon_engine: Engine
) -> None:
    config = write_config(tmp_path, config_data(tmp_path, db_url))
    good = config.read_text(encoding="utf-8")
    assert "interval: 10s" in good
    log_a = tmp_path / "a.log"
    first = start_daemon(config, log_a, "--log-format", "json")
    try:
        wait_for(
            lambda: (
                (lease := read_lease(daemon_engine)) is not None and lease.pid == first.pid and lease.is_live(_now())
            ),
            60,
            "the first daemon's lease",
        )
        second = subprocess.run(
            [sys.executable, "-m", "robot_llm.commands.main", "run", "-c", str(config)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert second.returncode == 2, second.stderr
        assert f"host {socket.gethostname()}" in second.stderr and f"pid {first.pid}" in second.stderr

        # An invalid config on SIGHUP: logged (as JSON), the old one stays, the daemon serves on.
        config.write_text(good.replace("interval: 10s", "interval: often"), encoding="utf-8")
        first.send_signal(signal.SIGHUP)
        refused = wait_for(
            lambda: [r for r in _log_records(log_a) if "keeping the old config" in str(r["msg"])], 30, "the refusal"
        )
        assert refused[0]["level"] == "ERROR" and "feeds[0].interval" in str(refused[0]["msg"])
        assert first.poll() is None
        polls = len(runs(daemon_engine, "ingest_feeds"))
        wait_for(lambda: len(runs(daemon_engine, "ingest_feeds")) > polls, 30, "a feed poll after the bad reload")

        # A valid one is applied.
        config.write_text(good.replace("interval: 10s", "interval: 20s"), encoding="utf-8")
        first.send_signal(signal.SIGHUP)
        wait_for(lambda: [r for r in _log_records(log_a) if "config reloaded" in str(r["msg"])], 30, "the reload")
    finally:
        code = stop_process(first)
    assert code == 0, log_a.read_text(encoding="utf-8")[-3000:]
    lease = read_lease(daemon_engine)
    assert lease is not None and lease.released and lease.pid == first.pid


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_sigterm_mid_batch_exits_0_and_a_restart_finishes_without_duplicates(
    tmp_path: Path, db_url: str, daemon_engine: Engine
) -> None:
    # Enough one-request batches of enough tokens (12 + 40 positions of the tiny model's 64) that
    # the queue cannot drain between the first stored thesis and the child's freeze below, however
    # fast the machine: 30 requests of 8 tokens (0.4 s) once drained in CI before the child got the
    # daemon's SIGTERM; these take seconds.
    requests = 120
    data = config_data(tmp_path, db_url, tickers=requests, max_new_tokens=40)
    data["schedule"].update(nightly_around(_now(), fired_ago=timedelta(minutes=2), cutoff_in=timedelta(hours=2)))
    config = write_config(tmp_path, data)

    first_log = tmp_path / "first.log"
    first = start_daemon(config, first_log)
    signalled = False
    try:
        wait_for(lambda: _theses(daemon_engine), 180, "the first stored thesis", interval=0.02)
        # Freeze the generation child at once, so it generates nothing while the daemon takes the
        # SIGTERM and forwards it (a 0.25 s supervision tick, much longer on a loaded machine), and
        # resume it once the daemon has sent its SIGTERM: it finishes the batch in flight and stops.
        workers = [r.pid for r in runs(daemon_engine, "generate") if r.status == "running"]
        assert len(workers) == 1, f"the generation child is not running (it drained the queue?): {workers}"
        child = workers[0]
        os.kill(child, signal.SIGSTOP)
        try:
            first.send_signal(signal.SIGTERM)
            signalled = True
            forwarded = f"sending SIGTERM to the generation child (pid {child})"
            # If the child was frozen inside a write, the daemon may wait on the database lock it holds
            # before it forwards the signal: then let the child go on after a while anyway.
            with contextlib.suppress(AssertionError):
                wait_for(lambda: forwarded in first_log.read_text(encoding="utf-8"), 20, "the forwarded SIGTERM")
        finally:
            os.kill(child, signal.SIGCONT)
    finally:
        code = stop_process(first, timeout=120, signalled=signalled)
    assert code == 0, first_log.read_text(encoding="utf-8")[-3000:]
    (night,) = runs(daemon_engine, NIGHTLY_KIND)
    assert night.status == "aborted", night.error
    stored_before = _theses(daemon_engine)
    assert 1 <= len(stored_before) < requests
    lease = read_lease(daemon_engine)
    assert lease is not None and lease.released

    second = start_daemon(config, tmp_path / "second.log")
    try:
        done = wait_for(
            lambda: [r for r in runs(daemon_engine, NIGHTLY_KIND) if r.status == "ok"], 240, "the finished night"
        )
    finally:
        assert stop_process(second) == 0
    assert done[0].as_of == night.as_of and done[0].counts["planned_existing"] == requests
    theses = _theses(daemon_engine)
    assert len(theses) == requests and len(set(theses)) == requests and set(stored_before) <= set(theses)
    with session_scope(daemon_engine) as session:
        left = session.scalar(
            select(func.count()).select_from(GenerationRequest).where(GenerationRequest.status != "done")
        )
    assert left == 0


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_a_daemon_restarted_right_after_a_sigkill_takes_over_its_lease_at_once(
    tmp_path: Path, db_url: str, daemon_engine: Engine
) -> None:
    data = config_data(tmp_path, db_url)
    data["daemon"] = {**data["daemon"], "lease_ttl": "10m"}  # waiting for it to expire would take 10 minutes
    config = write_config(tmp_path, data)
    killed = start_daemon(config, tmp_path / "a.log")
    wait_for(
        lambda: (lease := read_lease(daemon_engine)) is not None and lease.pid == killed.pid, 60, "the first lease"
    )
    killed.kill()
    killed.wait()
    second = start_daemon(config, tmp_path / "b.log")
    try:
        lease = wait_for(
            lambda: (lease := read_lease(daemon_engine)) is not None and lease.pid == second.pid and lease,
            60,
            "the restarted daemon's lease",
        )
        assert lease.is_live(_now()) and second.poll() is None
        # The takeover is logged after the lease row is committed: wait for the line, do not race it.
        wait_for(
            lambda: f"pid {killed.pid} (that process is gone" in (tmp_path / "b.log").read_text(encoding="utf-8"),
            60,
            "the takeover's log line",
        )
    finally:
        assert stop_process(second) == 0, (tmp_path / "b.log").read_text(encoding="utf-8")[-3000:]
