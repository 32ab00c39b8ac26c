"""Disk full, for real: the SQLite database of a night on a small tmpfs.

The error is one clear line, nothing half-written is taken as valid, and freeing space then
rerunning completes. The ``small_disk`` fixture mounts the tmpfs (root only; skipped, saying so, otherwise).
"""

from __future__ import annotations

import subprocess

import pytest
from batch_helpers import TINY_TEMPLATE, BatchEnv
from sqlalchemy import select

from robot_llm.config import load_config
from robot_llm.night.worker import BatchError, run_queue
from robot_llm.store.db import GenerationRequest, Thesis, make_engine, session_scope, utcnow
from robot_llm.store.migrate import upgrade
from tests.conftest import fill_disk

pytestmark = pytest.mark.slow


def _consistent(engine) -> tuple[int, int]:
    with session_scope(engine) as s:
        theses = [t.request_id for t in s.scalars(select(Thesis))]
        done = {r.id for r in s.scalars(select(GenerationRequest)) if r.status == "done"}
    assert len(theses) == len(set(theses)) and set(theses) == done  # no thesis without its request done
    return len(theses), len(done)


def test_sqlite_disk_full_mid_night_fails_clearly_and_a_rerun_after_freeing_space_completes(small_disk, tmp_path):
    url = f"sqlite:///{small_disk / 'robot-llm.sqlite'}"
    upgrade(url)
    engine = make_engine(url)
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "tiny.j2").write_text(TINY_TEMPLATE, encoding="utf-8")
    benv = BatchEnv(tmp=tmp_path, db_url=url, engine=engine, kind="sqlite")
    n = 120
    night = utcnow().replace(microsecond=0)
    benv.seed(n, night, prompt=lambda i: f"T{i:03d} " + "news " * 8 + ":")
    config = load_config(benv.write_config(model={"max_batch_size": 2}, batch={"lease": "10m"}))
    filler = fill_disk(small_disk, leave=96 << 10)

    with pytest.raises(BatchError) as info:
        run_queue(config, engine, progress=False, preflight=False)
    message = str(info.value)
    assert "\n" not in message and "database or disk is full" in message and "intact" in message
    stored, _ = _consistent(engine)
    assert 0 < stored < n  # it failed mid-night, with theses already stored

    filler.unlink()  # space is back
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    benv.wait_leases_expired()
    summary = run_queue(config, engine, progress=False, preflight=False)
    assert summary.failed == 0
    assert _consistent(engine) == (n, n)
    engine.dispose()
