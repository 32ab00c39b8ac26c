"""The queue's leases on PostgreSQL: a claim that waited on another worker's lock still gets a whole lease."""

from __future__ import annotations

import threading
import time

import pytest

from robot_llm.night.queue import ClaimedRequest, RequestQueue
from robot_llm.store.db import utcnow


@pytest.mark.parametrize("empty_db_url", ["postgresql"], indirect=True)
def test_a_claim_that_waited_on_a_lock_longer_than_a_lease_is_not_born_expired(benv, night):
    benv.seed(4, night)
    config = benv.config(model={"max_batch_size": 2})  # a 2 s lease
    lease = config.batch.lease.total_seconds()
    first = RequestQueue(config, benv.engine, "w0", None)
    claimed: list[list[ClaimedRequest]] = []
    with benv.engine.connect() as conn:
        # Another worker's transaction holds the queue for longer than a lease while this one claims.
        conn.exec_driver_sql("LOCK TABLE generation_requests IN EXCLUSIVE MODE")
        claimer = threading.Thread(target=lambda: claimed.append(first.claim(2)[0]))
        claimer.start()
        time.sleep(lease + 1)
        conn.rollback()
        released = utcnow()
    claimer.join(timeout=60)
    assert len(claimed) == 1 and len(claimed[0]) == 2
    running = [r for r in benv.requests() if r.status == "running"]
    assert {r.id for r in running} == {c.id for c in claimed[0]}
    assert all((r.lease_expires_at - released).total_seconds() > lease / 2 for r in running)
    # So a second worker right after it finds nothing of the first's to take.
    second, _ = RequestQueue(config, benv.engine, "w1", None).claim(4)
    assert {c.id for c in second}.isdisjoint(r.id for r in running)
