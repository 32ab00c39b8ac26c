"""The single-instance lease, on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy.engine import Engine

from robot_llm.daemon.lease import LeaseHeldError, acquire_lease, read_lease, release_lease, renew_lease

T0 = datetime(2026, 11, 26, 20, 0, tzinfo=timezone.utc)
TTL = timedelta(minutes=3)


def test_a_live_lease_refuses_a_second_daemon_and_names_its_holder(engine: Engine) -> None:
    first = acquire_lease(engine, holder="a", host="gpu-box-1", pid=4242, ttl=TTL, now=T0)
    assert (first.holder, first.host, first.pid) == ("a", "gpu-box-1", 4242)
    with pytest.raises(LeaseHeldError) as err:
        acquire_lease(engine, holder="b", host="gpu-box-2", pid=77, ttl=TTL, now=T0 + timedelta(minutes=1))
    message = str(err.value)
    assert "host gpu-box-1" in message and "pid 4242" in message
    lease = read_lease(engine)
    assert lease is not None and lease.holder == "a" and lease.is_live(T0 + timedelta(minutes=1))


def test_heartbeats_keep_it_and_a_stale_lease_is_taken_over(engine: Engine) -> None:
    acquire_lease(engine, holder="a", host="h1", pid=1, ttl=TTL, now=T0)
    # Renewed at +2 min, so at +4 min it is still live (expires at +5).
    assert renew_lease(engine, "a", TTL, "running", now=T0 + timedelta(minutes=2))
    with pytest.raises(LeaseHeldError):
        acquire_lease(engine, holder="b", host="h2", pid=2, ttl=TTL, now=T0 + timedelta(minutes=4))
    # Holder 'a' died: no heartbeat after +2 min, so at +5 min the lease is stale.
    taken = acquire_lease(engine, holder="b", host="h2", pid=2, ttl=TTL, now=T0 + timedelta(minutes=5, seconds=1))
    assert (taken.holder, taken.host, taken.pid, taken.state) == ("b", "h2", 2, "starting")
    # The old holder finds out at its next heartbeat and must stop.
    assert not renew_lease(engine, "a", TTL, "running", now=T0 + timedelta(minutes=6))
    assert renew_lease(engine, "b", TTL, "idle", now=T0 + timedelta(minutes=6))


def test_release_lets_the_next_daemon_start_at_once(engine: Engine) -> None:
    acquire_lease(engine, holder="a", host="h1", pid=1, ttl=TTL, now=T0)
    release_lease(engine, "a", now=T0 + timedelta(seconds=10))
    lease = read_lease(engine)
    assert lease is not None and lease.released and not lease.is_live(T0 + timedelta(seconds=11))
    again = acquire_lease(engine, holder="c", host="h3", pid=3, ttl=TTL, now=T0 + timedelta(seconds=11))
    assert again.holder == "c" and not again.released


def test_simultaneous_starts_have_exactly_one_winner(engine: Engine) -> None:
    winners: list[str] = []
    refused: list[str] = []
    barrier = threading.Barrier(4)

    def start(name: str) -> None:
        barrier.wait()
        try:
            acquire_lease(engine, holder=name, host="h", pid=hash(name) % 10000, ttl=TTL)
            winners.append(name)
        except LeaseHeldError:
            refused.append(name)

    threads = [threading.Thread(target=start, args=(f"d{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1 and len(refused) == 3
    lease = read_lease(engine)
    assert lease is not None and lease.holder == winners[0]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid no longer exists
    return proc.pid


def test_a_dead_daemon_of_this_host_is_taken_over_at_once(engine: Engine) -> None:
    here = socket.gethostname()
    dead = _dead_pid()
    acquire_lease(engine, holder="killed", host=here, pid=dead, ttl=timedelta(hours=1), now=T0)
    # Its lease has an hour left, but its process is gone: no wait.
    taken = acquire_lease(engine, holder="new", host=here, pid=os.getpid(), ttl=TTL, now=T0 + timedelta(seconds=5))
    assert (taken.holder, taken.pid) == ("new", os.getpid())
    assert not renew_lease(engine, "killed", TTL, "running", now=T0 + timedelta(seconds=6))


def test_a_live_daemon_is_never_taken_over_and_its_lease_end_is_named(engine: Engine) -> None:
    here = socket.gethostname()
    acquire_lease(engine, holder="alive", host=here, pid=os.getpid(), ttl=TTL, now=T0)
    with pytest.raises(LeaseHeldError, match="at 2026-11-26 20:03:00Z"):
        acquire_lease(engine, holder="second", host=here, pid=os.getpid(), ttl=TTL, now=T0 + timedelta(seconds=5))
    # A dead pid number on *another* host proves nothing about that host: wait for the lease.
    acquire_lease(engine, holder="elsewhere", host="other-box", pid=_dead_pid(), ttl=TTL, now=T0 + timedelta(hours=1))
    with pytest.raises(LeaseHeldError, match="host other-box"):
        acquire_lease(
            engine, holder="third", host=here, pid=os.getpid(), ttl=TTL, now=T0 + timedelta(hours=1, seconds=5)
        )
