"""Helpers for the daemon tests: a config file on the tiny model, a local feed, waiting, processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, TypeVar

import yaml
from sqlalchemy import select
from sqlalchemy.engine import Engine

from robot_llm.store.db import Run, session_scope

REPO = Path(__file__).resolve().parent.parent.parent
TINY = REPO / "tests" / "fixtures" / "yalm-tiny"
VOCAB = TINY / "vocab" / "voc_tiny.sp"

# Small enough for the tiny model's 64-position window: no news, no signals, a few greedy tokens.
TINY_TEMPLATE = """---
name: tiny
version: "1"
language: en
news:
  max_items: 0
signals:
  include: false
generation:
  max_new_tokens: {max_new_tokens}
  greedy: true
---
Note on {{{{ instrument.ticker }}}}:
"""

RSS = """<?xml version="1.0" encoding="utf-8"?>
<rss version="2.0"><channel><title>wire</title><link>http://example.invalid/</link>
<description>test</description>
<item><title>Alpha Corp raises its dividend</title><guid>a-1</guid><description>ALFA up.</description></item>
</channel></rss>
"""

T = TypeVar("T")


def config_data(tmp_path: Path, db_url: str, *, tickers: int = 2, max_new_tokens: int = 4) -> dict[str, Any]:
    """A complete config (as data) on the tiny fixture model; tests change what they need."""
    prompts = tmp_path / "prompts"
    prompts.mkdir(exist_ok=True)
    (prompts / "tiny.j2").write_text(TINY_TEMPLATE.format(max_new_tokens=max_new_tokens), encoding="utf-8")
    feed = tmp_path / "wire.xml"
    feed.write_text(RSS, encoding="utf-8")
    # By default the last night was missed and is past its cut-off, so a daemon started by a
    # test records it as skipped instead of starting a generation child; tests that want the
    # night override "nightly" and "cutoff".
    night = nightly_around(datetime.now(timezone.utc), fired_ago=timedelta(minutes=10), cutoff_in=timedelta(minutes=-5))
    return {
        "database": {"url": db_url},
        "timezone": "UTC",
        "instruments": [{"ticker": f"T{i:02d}", "name": f"Company {i}"} for i in range(tickers)],
        "feeds": [{"name": "wire", "url": str(feed), "interval": "10s"}],
        "prompts": {"dir": str(prompts), "templates": ["tiny"]},
        "model": {
            "backend": "memory",
            "checkpoint": str(TINY),
            "vocab": str(VOCAB),
            "dtype": "fp32",
            "device": "cpu",
            "max_positions": 64,
            "max_batch_size": 1,
        },
        "schedule": {
            **night,
            "signals": "*/10 * * * *",
            "morning_report": "45 8 * * 1-5",
            "trading_days": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"],
        },
        "daemon": {"heartbeat": "1s", "lease_ttl": "30s", "shutdown_timeout": "30s"},
        "logging": {"level": "INFO"},
    }


def write_config(tmp_path: Path, data: dict[str, Any], name: str = "robot-llm.yaml") -> Path:
    """Write ``data`` as the YAML config file and return its path."""
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return path


def nightly_around(now: datetime, *, fired_ago: timedelta, cutoff_in: timedelta) -> dict[str, str]:
    """A daily ``schedule`` whose last nightly fire was ``fired_ago`` and whose cut-off is ``cutoff_in`` (UTC)."""
    fire = now - fired_ago
    cutoff = now + cutoff_in
    return {"nightly": f"{fire.minute} {fire.hour} * * *", "cutoff": f"{cutoff.hour:02d}:{cutoff.minute:02d}"}


def wait_for(probe: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
    """Poll ``probe`` until it returns something truthy; fail the test with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def runs(engine: Engine, kind: str | None = None) -> list[Run]:
    """All Run rows (of ``kind``), oldest first."""
    with session_scope(engine) as session:
        stmt = select(Run).order_by(Run.id)
        if kind is not None:
            stmt = stmt.where(Run.kind == kind)
        return list(session.scalars(stmt).all())


def start_daemon(config: Path, log_path: Path, *extra: str) -> subprocess.Popen[bytes]:
    """``robot-llm run -c CONFIG`` as a real process, its output going to ``log_path``."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    with log_path.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "robot_llm.commands.main", "run", "-c", str(config), *extra],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 60, *, signalled: bool = False) -> int:
    """SIGTERM a process we started and wait for its exit code (SIGKILL if it will not stop).

    ``signalled``: the test already sent the SIGTERM; only wait (a second one means "stop now").
    """
    if proc.poll() is None and not signalled:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"pid {proc.pid} did not stop within {timeout}s of SIGTERM") from None
