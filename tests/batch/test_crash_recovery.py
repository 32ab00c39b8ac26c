"""An immediate rerun after a crash: a dead worker of this host is taken over at once; a live
worker elsewhere is reported with the moment it would be taken for dead, and the run exits non-zero."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
from batch_helpers import start_worker, wait_for

from robot_llm.commands.main import main
from robot_llm.errors import EXIT_BLOCKED
from robot_llm.night.worker import run_queue
from robot_llm.store.db import Run, session_scope, utcnow

pytestmark = pytest.mark.slow


def test_a_sigkilled_worker_is_taken_over_at_once_by_a_rerun_on_the_same_host(benv, night):
    n = 40
    # A long lease and heartbeat window: without the takeover, the rerun would wait an hour.
    config_file = benv.write_config(model={"max_batch_size": 1}, batch={"lease": "1h", "stall_timeout": "1h"})
    ids = benv.seed(n, night)
    proc = start_worker(config_file, "--skip-preflight")
    try:
        # Killed while it holds a request (its lease would block that request for an hour).
        wait_for(lambda: benv.thesis_count() >= 1 and "running" in benv.status_counts(), proc)
    finally:
        proc.kill()
        proc.communicate()
    stored = benv.thesis_count()
    assert 1 <= stored < n

    rerun = start_worker(config_file, "--skip-preflight")
    out, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err
    assert sorted(t.request_id for t in benv.theses()) == ids
    assert "another worker" not in out + err
    killed, second = benv.runs()
    assert killed.status == "aborted" and f"pid {proc.pid}) is gone" in killed.error
    assert second.status == "ok" and second.done == n - stored


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_a_live_worker_elsewhere_is_reported_with_its_deadline_and_the_run_exits_non_zero(benv, night, capsys):
    config_file = benv.write_config(batch={"lease": "1h"})
    benv.seed(3, night)
    now = utcnow()
    with session_scope(benv.engine) as s:
        s.add(
            Run(
                kind="generate",
                status="running",
                started_at=now,
                heartbeat_at=now,
                host="another-host",
                pid=4242,
                counts={"worker_id": "another-host:4242:x"},
            )
        )
    assert main(["batch", "run", "-c", str(config_file), "--skip-preflight"]) == EXIT_BLOCKED
    err = capsys.readouterr().err
    assert "host another-host, pid 4242" in err and "taken for dead if its heartbeat stops" in err
    assert (now + timedelta(seconds=1)).strftime("%Y-%m-%d") in err
    assert benv.thesis_count() == 0 and benv.status_counts() == {"pending": 3}


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_a_live_worker_of_this_host_is_not_taken_over(benv, night):
    benv.seed(2, night)
    now = utcnow()
    with session_scope(benv.engine) as s:  # this very process: alive
        s.add(
            Run(
                kind="generate",
                status="running",
                started_at=now,
                heartbeat_at=now,
                host=socket.gethostname(),
                pid=os.getpid(),
                counts={"worker_id": "me"},
            )
        )
    summary = run_queue(benv.config(), benv.engine, progress=False, preflight=False)
    assert summary.exit_code == EXIT_BLOCKED and summary.done == 0 and summary.blocked_by is not None
