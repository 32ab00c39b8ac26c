"""Real worker processes under faults: SIGKILL, SIGTERM, two workers on one queue, a stall, the database going away."""

from __future__ import annotations

import re
import signal
import sqlite3
import subprocess
import uuid

import pytest
from batch_helpers import start_worker, wait_for
from sqlalchemy import text

from robot_llm.night.watchdog import WATCHDOG_EXIT_CODE
from robot_llm.night.worker import run_queue

pytestmark = pytest.mark.slow


def _assert_consistent(benv) -> None:
    """Every stored thesis belongs to a request marked done and vice versa; no request has two."""
    theses = benv.theses()
    ids = [t.request_id for t in theses]
    assert len(ids) == len(set(ids))
    done = {r.id for r in benv.requests() if r.status == "done"}
    assert set(ids) == done


def test_sigkill_mid_run_then_rerun_completes_without_duplicates_or_loss(benv, night):
    n = 60
    config_file = benv.write_config(model={"max_batch_size": 1})
    ids = benv.seed(n, night)
    proc = start_worker(config_file, "--skip-preflight")
    try:
        wait_for(lambda: benv.thesis_count() >= 1, proc)
    finally:
        proc.kill()
        proc.communicate()
    before = {t.request_id: (t.id, t.text, t.available_at) for t in benv.theses()}
    assert 1 <= len(before) < n
    _assert_consistent(benv)

    benv.wait_leases_expired()
    summary = run_queue(benv.config(model={"max_batch_size": 4}), benv.engine, progress=False, preflight=False)

    assert summary.done == n - len(before) and summary.failed == 0
    after = {t.request_id: (t.id, t.text, t.available_at) for t in benv.theses()}
    assert sorted(after) == ids
    assert {k: after[k] for k in before} == before  # what the killed worker stored is untouched
    _assert_consistent(benv)
    killed, rerun = benv.runs()
    assert killed.status == "aborted" and "vanished" in killed.error
    assert rerun.status == "ok"


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_sigterm_finishes_the_batch_in_flight_and_exits_0(benv, night):
    n = 200
    config_file = benv.write_config(model={"max_batch_size": 2})
    benv.seed(n, night)
    proc = start_worker(config_file)  # with the preflight
    try:
        wait_for(lambda: benv.thesis_count() >= 1, proc, timeout=120)
        proc.send_signal(signal.SIGTERM)
        proc_out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    counts = benv.status_counts()
    assert "running" not in counts  # the batch in flight was stored, not abandoned
    assert 0 < counts["done"] < n and counts["done"] == benv.thesis_count()
    (run,) = benv.runs()
    assert run.status == "aborted" and "stopped on request" in run.error and run.done == counts["done"]
    assert "SIGTERM" in err and "stopped on request" in proc_out


@pytest.mark.parametrize("empty_db_url", ["postgresql"], indirect=True)
def test_two_workers_on_postgresql_share_the_queue_without_taking_the_same_request(benv, night):
    n = 60
    # A lease far longer than any stall of a loaded machine: this test is about SKIP LOCKED, not about
    # expired leases. With 2 s, a worker's first claim, blocked behind the lock below while the other
    # worker loaded its model, set a lease already expired (its clock was read before the wait), and
    # the other worker claimed that batch again (attempts 2); its slowed heartbeat (each renewal
    # waits on the lock too) also came near the 2 s after which a worker is taken for dead.
    config_file = benv.write_config(model={"max_batch_size": 2}, batch={"lease": "1m"})
    benv.seed(n, night)
    procs = []
    with benv.engine.connect() as conn:
        # Hold the queue until both workers are up, so they really compete for it.
        conn.exec_driver_sql("LOCK TABLE generation_requests IN EXCLUSIVE MODE")
        try:
            procs = [start_worker(config_file, "--skip-preflight", "--worker-id", f"w{i}") for i in range(2)]
            wait_for(lambda: len(benv.runs()) == 2, timeout=120)
        finally:
            conn.rollback()
    results = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results

    assert sorted(t.request_id for t in benv.theses()) == sorted(r.id for r in benv.requests())
    assert {r.attempts for r in benv.requests()} == {1}  # no request was ever claimed twice
    per_worker = {r.counts["worker_id"]: r.counts["theses"] for r in benv.runs()}
    assert set(per_worker) == {"w0", "w1"}
    assert sum(per_worker.values()) == n and min(per_worker.values()) > 0
    _assert_consistent(benv)


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_watchdog_records_an_aborted_run_when_a_batch_stalls(benv, night):
    n = 200
    config_file = benv.write_config(model={"max_batch_size": 1}, batch={"stall_timeout": "3s"})
    benv.seed(n, night)
    proc = start_worker(config_file, "--skip-preflight")
    try:
        wait_for(lambda: benv.thesis_count() >= 1, proc)
        # Another writer holds the SQLite write lock for longer than the stall timeout: the
        # worker's next write waits, its batch makes no progress, the watchdog must act.
        blocker = sqlite3.connect(benv.db_url.removeprefix("sqlite:///"), timeout=30)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=10)  # the worker cannot finish while the lock is held
        finally:
            blocker.rollback()
            blocker.close()
        _out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == WATCHDOG_EXIT_CODE, err
    assert "made no progress" in err and "recorded in the runs table" in err
    (run,) = benv.runs()
    assert run.status == "aborted" and "made no progress" in run.error
    assert 0 < benv.thesis_count() < n
    theses = benv.theses()
    assert len({t.request_id for t in theses}) == len(theses)


@pytest.mark.parametrize("empty_db_url", ["postgresql"], indirect=True)
def test_database_down_mid_run_keeps_stored_theses_and_fails_clearly(benv, night):
    n = 200
    role = f"w_{uuid.uuid4().hex[:12]}"
    schema = re.search(r"search_path%3D(\w+)", benv.db_url).group(1)
    with benv.engine.begin() as conn:
        conn.exec_driver_sql(f'CREATE ROLE "{role}" LOGIN')
        conn.exec_driver_sql(f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"')
        conn.exec_driver_sql(f'GRANT ALL ON ALL TABLES IN SCHEMA "{schema}" TO "{role}"')
        conn.exec_driver_sql(f'GRANT ALL ON ALL SEQUENCES IN SCHEMA "{schema}" TO "{role}"')
    worker_url = benv.db_url.replace("postgres@", f"{role}@", 1)
    config_file = benv.write_config("worker.yaml", database={"url": worker_url}, model={"max_batch_size": 1})
    benv.seed(n, night)
    proc = start_worker(config_file, "--skip-preflight")
    try:
        wait_for(lambda: benv.thesis_count() >= 1, proc)
        # The worker's database goes away and stays away. NOLOGIN is committed before its sessions
        # are ended: in one transaction, a worker that reconnected between the terminate and the
        # commit (its pool pings and reconnects at the next checkout) kept working to the end.
        with benv.engine.begin() as conn:
            conn.exec_driver_sql(f'ALTER ROLE "{role}" NOLOGIN')
        with benv.engine.begin() as conn:
            conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :r"), {"r": role})
        _out, err = proc.communicate(timeout=120)

        assert proc.returncode == 2, err
        assert "database error" in err and "intact" in err and "again to resume" in err
        stored = benv.thesis_count()
        assert 0 < stored < n
        _assert_consistent(benv)

        benv.wait_leases_expired()
        summary = run_queue(benv.config(model={"max_batch_size": 8}), benv.engine, progress=False, preflight=False)
        assert summary.done == n - stored and benv.thesis_count() == n
        _assert_consistent(benv)
    finally:
        proc.kill()
        with benv.engine.begin() as conn:
            conn.exec_driver_sql(f'DROP OWNED BY "{role}"')
            conn.exec_driver_sql(f'DROP ROLE "{role}"')
