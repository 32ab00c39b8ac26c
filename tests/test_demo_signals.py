"""Ctrl-C and SIGTERM during `robot-llm demo`: it stops cleanly, says how to go on, and a rerun completes the night."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DemoRun, link_tree

pytestmark = pytest.mark.slow


def _start(workdir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "robot_llm.commands.main", "demo", "--workdir", str(workdir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
    )


def _interrupt_while_generating(workdir: Path, signum: int) -> tuple[int, str, str]:
    """Start the demo, send ``signum`` once the night is planned (generation starts), wait for the end."""
    proc = _start(workdir)
    assert proc.stdout is not None
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("[4/5] planned the night"):
                proc.send_signal(signum)
                break
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    return proc.returncode, "".join(seen) + out, err


def _counts(db: Path) -> dict[str, int]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT status, count(*) FROM generation_requests GROUP BY status").fetchall()
        theses = conn.execute("SELECT count(*) FROM theses").fetchone()[0]
    return {**dict(rows), "theses": theses}


def test_interrupted_demo_stops_cleanly_and_a_rerun_completes_the_night(tmp_path: Path, demo_run: DemoRun) -> None:
    workdir = tmp_path / "demo"
    # A fresh folder but for the converted weights, linked from the suite's demo run (test_demo checks
    # the conversion): what is interrupted here is the night.
    (workdir / "model").mkdir(parents=True)
    for store in (demo_run.workdir / "model").iterdir():
        link_tree(store, workdir / "model" / store.name, link=".")
    for signum in (signal.SIGINT, signal.SIGTERM):
        code, out, err = _interrupt_while_generating(workdir, signum)
        name = signal.Signals(signum).name
        assert code == 128 + signum, out[-2000:] + err[-2000:]
        assert f"{name}: storing the batch in flight, then stopping" in err
        assert f"stopped by {name}" in out and "again to finish the night" in out
        assert "Traceback" not in err and "=== The morning ===" not in out
        counts = _counts(workdir / "demo.sqlite")
        assert counts.get("running", 0) == 0  # nothing left leased to a process that is gone
        assert counts.get("done", 0) == counts["theses"] < 6

    rerun = subprocess.run(
        [sys.executable, "-m", "robot_llm.commands.main", "demo", "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "no thesis (abstain)" not in rerun.stdout and "another worker" not in rerun.stdout
    assert _counts(workdir / "demo.sqlite") == {"done": 6, "theses": 6}
