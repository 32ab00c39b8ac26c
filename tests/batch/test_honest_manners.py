"""Honest nights, around the night: reports that tell the truth, the child's config by value, command-line manners."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from batch_helpers import REPO, BatchEnv
from sqlalchemy import select

from robot_llm.commands.main import main
from robot_llm.config import load_config
from robot_llm.store.db import GenerationRequest, Run, Thesis, session_scope, utcnow

SQLITE = pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)


def _cli(*args: str, stdout: int | None = subprocess.PIPE, env: dict[str, str] | None = None):
    return subprocess.run(
        [sys.executable, "-m", "robot_llm.commands.main", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )


# --------------------------------------------------------------------------- reports tell the truth


def _stuck_and_empty(benv: BatchEnv, night: datetime) -> None:
    """A night as today's main left it: 1 stuck request (lease gone), 1 empty thesis stored as a success."""
    stuck, empty, _ = benv.seed(3, night)
    now = utcnow()
    with session_scope(benv.engine) as s:
        for r in s.scalars(select(GenerationRequest)):
            if r.id == stuck:
                r.status, r.lease_owner, r.lease_expires_at = "running", "gone:1:x", now - timedelta(minutes=1)
            if r.id == empty:
                r.status = "done"
                s.add(
                    Thesis(
                        request_id=r.id,
                        ticker=r.ticker,
                        template_name=r.template_name,
                        template_version="1",
                        text="",
                        stance=None,
                        label_logprobs={" up": float("nan")},
                        model_id="m",
                        params={},
                        prompt_sha256=r.prompt_sha256,
                        prompt_tokens=1,
                        completion_tokens=0,
                        finish_reason="stop",
                        generation_seconds=0.1,
                        as_of=night,
                        available_at=now,
                        valid_until=night + timedelta(days=1),
                    )
                )


@SQLITE
def test_report_html_and_doctor_say_stuck_and_empty_on_their_first_line(benv, night, capsys, tmp_path):
    config_file = benv.write_config()
    _stuck_and_empty(benv, night)
    day = utcnow().date().isoformat()

    assert main(["report", "-c", str(config_file), "--date", day]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert "1 stuck, 0 failed, 1 empty, 1 non-finite" in first and "1 pending" in first

    from robot_llm.night.preflight import doctor

    queue = doctor(config_file)[0]
    assert queue.name == "queue" and queue.warning and "1 stuck" in queue.message and "1 empty" in queue.message

    pytest.importorskip("plotly")
    from robot_llm.report.html import write_report
    from robot_llm.report.summary import build_report

    config = load_config(config_file)
    page = write_report(
        config, benv.engine, build_report(config, benv.engine, utcnow().date()).day, tmp_path / "m.html"
    )
    html = Path(page).read_text(encoding="utf-8")
    assert html.index("1 stuck, 0 failed, 1 empty") < html.index("theses stored")


# --------------------------------------------------------------------------- the child runs the config it planned with


@SQLITE
def test_the_generation_child_takes_the_daemons_config_by_value_not_the_file(benv, night, caplog):
    from robot_llm.night.child import generate_command, start_child

    path = benv.write_config(instruments=2)
    config = load_config(path)
    benv.seed(2, night)
    path.write_text("database: [this is not what the daemon planned with\n", encoding="utf-8")  # a bad edit
    cmd = generate_command(config, night)
    assert "--config-stdin" in cmd
    proc = start_child(config, cmd)
    assert proc.wait(timeout=180) == 0
    assert benv.status_counts() == {"done": 2}


@pytest.mark.parametrize("example", ["config/demo.yaml", "config/robot-llm.example.yaml"])
def test_a_config_snapshot_round_trips_to_the_same_config(example, monkeypatch):
    from robot_llm.config import config_from_snapshot, config_snapshot

    monkeypatch.setenv("PG_PASSWORD", "secret")
    config = load_config(REPO / example)
    assert config_from_snapshot(config_snapshot(config)) == config


@SQLITE
def test_a_bad_snapshot_is_one_clear_line(benv, capsys, monkeypatch):
    import io

    path = benv.write_config()
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"source": null, "config": {"model": {"backend": "x"}}}'))
    assert main(["batch", "run", "-c", str(path), "--config-stdin"]) == 2
    err = capsys.readouterr().err
    assert "(the snapshot on stdin)" in err and "model" in err


def test_config_check_refuses_deepspeed_for_a_gemma_store(tmp_path, capsys):
    import torch

    from robot_llm.llm.families.config import module_plan
    from robot_llm.llm.families.gemma3 import Gemma3Config
    from robot_llm.llm.store.writer import write_store

    cfg = Gemma3Config(
        num_layers=1,
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=64,
        vocab_size=64,
        layer_types=("full_attention",),
        query_pre_attn_scalar=32,
    )
    modules = [(k, i, {n: torch.zeros(s) for n, s in shapes.items()}) for k, i, shapes in module_plan(cfg)]
    write_store(tmp_path / "gemma", cfg, modules, dtype="fp32")
    path = tmp_path / "robot-llm.yaml"
    lines = [
        "database:",
        f"  url: sqlite:///{tmp_path / 'db.sqlite'}",
        "instruments:",
        "  - {ticker: SBER, name: Sber}",
        "model:",
        "  id: gemma",
        "  backend: deepspeed",
        f"  store: {tmp_path / 'gemma'}",
        f"  vocab: {tmp_path / 'gemma' / 'tokenizer.json'}",
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["config", "check", "-c", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:7: model.backend:" in err and "gemma3" in err and "stream" in err


# --------------------------------------------------------------------------- command-line manners


@SQLITE
@pytest.mark.parametrize("command", [["config", "check"], ["batch", "status"]])
def test_a_closed_pipe_ends_quietly(benv, command):
    path = benv.write_config()
    read, write = os.pipe()
    os.close(read)  # `| head` that has already gone: every write meets EPIPE
    try:
        done = _cli(*command, "-c", str(path), stdout=write)
    finally:
        os.close(write)
    assert done.returncode == 0, done.stderr
    assert "BrokenPipe" not in done.stderr and "Exception ignored" not in done.stderr


@SQLITE
def test_the_adapter_names_a_missing_extra_in_one_line(benv, tmp_path):
    fake = tmp_path / "no-pandas" / "pandas"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'pandas'\", name='pandas')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), str(REPO)])}
    done = subprocess.run(
        [sys.executable, "-m", "robot_llm.strategies.freqtrade_adapter", "-c", str(benv.write_config())],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "error: this command needs pandas, which is not installed: pip install 'robot-llm[pandas]'"
    )


@SQLITE
def test_alembic_info_stays_out_of_the_log_file(benv, tmp_path, capsys):
    log = tmp_path / "robot-llm.log"
    path = benv.write_config(logging={"file": str(log), "level": "INFO"})
    for _ in range(2):
        assert main(["batch", "status", "-c", str(path)]) == 0
    logging.shutdown()
    text = log.read_text(encoding="utf-8") if log.exists() else ""
    assert "alembic" not in text  # no "setup plugin", "Context impl", "Will assume" on every command
    assert main(["-vv", "batch", "status", "-c", str(path)]) == 0
    logging.shutdown()
    assert "Context impl" in log.read_text(encoding="utf-8")  # -vv shows everything


def _afternoon_zone() -> str:
    """An Etc/GMT zone where it is mid-afternoon now: the night at 01:00 and its 09:30 cut-off are both past."""
    offset = (14 - datetime.now(timezone.utc).hour) % 24
    offset = offset - 24 if offset > 12 else offset
    return "UTC" if offset == 0 else f"Etc/GMT{-offset:+d}"


@SQLITE
def test_no_missed_night_warning_for_a_schedule_that_did_not_exist_then(benv, caplog):
    from robot_llm.daemon.scheduler import Daemon

    schedule = {
        "nightly": "0 1 * * *",
        "cutoff": "09:30",
        "trading_days": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"],
        "skip_non_trading_days": False,
    }
    config = benv.config(timezone=_afternoon_zone(), schedule=schedule)
    daemon = Daemon(config, benv.engine, install_signals=False)
    scheduler = daemon.build_scheduler(config)
    with caplog.at_level(logging.INFO, logger="robot_llm.daemon.scheduler"):
        daemon._served_since = daemon._first_served()  # a fresh database: no daemon ever served it
        daemon._catch_up(scheduler, config)
    lines = [r for r in caplog.records if "was not run" in r.getMessage()]
    assert lines and all(r.levelno == logging.INFO for r in lines)
    assert "before the first daemon" in lines[0].getMessage()

    # A daemon that ran before that night and was down during it: that one was missed, and says so.
    with session_scope(benv.engine) as s:
        s.query(Run).delete()
        s.add(Run(kind="nightly", status="ok", started_at=utcnow() - timedelta(days=3), counts={}))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="robot_llm.daemon.scheduler"):
        daemon._served_since = daemon._first_served()
        daemon._catch_up(scheduler, config)
    lines = [r for r in caplog.records if "was not run" in r.getMessage()]
    assert lines and lines[0].levelno == logging.WARNING and "missed while the daemon was down" in lines[0].getMessage()


# --------------------------------------------------------------------------- the migration


def test_migration_0002_keeps_every_row_and_numbers_it_redo_0(empty_db_url):
    from sqlalchemy import text

    from robot_llm.store import migrate
    from robot_llm.store.db import make_engine

    migrate.upgrade(empty_db_url, "0001")
    engine = make_engine(empty_db_url)
    try:
        now = utcnow()
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO generation_requests (as_of, ticker, template_name, template_version, prompt, "
                    "prompt_sha256, prompt_tokens, news_ids, signal_ids, params, valid_until, status, attempts, "
                    "created_at, updated_at) VALUES (:t, 'SBER', 'tiny', '1', 'p', 'h', 1, '[]', '[]', '{}', :t, "
                    "'done', 1, :t, :t)"
                ),
                {"t": now.replace(tzinfo=None) if engine.dialect.name == "sqlite" else now},
            )
        migrate.upgrade(empty_db_url)
        with session_scope(engine) as s:
            (row,) = s.scalars(select(GenerationRequest))
            assert (row.ticker, row.redo, row.status) == ("SBER", 0, "done")
            s.add(
                GenerationRequest(
                    **{
                        c: getattr(row, c)
                        for c in ("as_of", "ticker", "template_name", "template_version", "prompt", "prompt_sha256")
                    },
                    prompt_tokens=1,
                    valid_until=row.valid_until,
                    created_at=now,
                    updated_at=now,
                    redo=1,
                )
            )
        migrate.downgrade(empty_db_url, "0001")  # a redone night keeps its original rows only
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM generation_requests")).scalar_one() == 1
        migrate.upgrade(empty_db_url)
        assert migrate.schema_diff(empty_db_url) == []
    finally:
        engine.dispose()


@SQLITE
def test_a_stop_that_comes_with_the_last_batch_leaves_the_night_complete_not_aborted(benv, night, monkeypatch):
    import threading

    from robot_llm.night import worker
    from robot_llm.night.model import open_configured_model
    from robot_llm.night.worker import run_queue

    config = benv.config(model={"max_batch_size": 8})
    benv.seed(3, night)
    stop = threading.Event()
    model = open_configured_model(config)
    generate = model.generate

    def generate_then_ctrl_c(*args, **kwargs):  # Ctrl-C lands while the night's only batch runs
        out = generate(*args, **kwargs)
        stop.set()
        return out

    model.generate = generate_then_ctrl_c  # type: ignore[method-assign]
    monkeypatch.setattr(worker, "open_configured_model", lambda *_args, **_kwargs: model)
    try:
        summary = run_queue(config, benv.engine, stop=stop, progress=False, preflight=False)
    finally:
        model.close()
    assert stop.is_set() and summary.done == 3
    assert summary.status == "ok" and not summary.stopped and summary.exit_code == 0
    (run,) = benv.runs()
    assert run.status == "ok" and run.error is None
