"""The ``robot-llm`` command line, run as a real subprocess: exit codes, one-line errors, db commands."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from robot_llm import __version__
from robot_llm.logs import setup_logging
from robot_llm.store import migrate

REPO = Path(__file__).resolve().parent.parent

CONFIG = """\
database:
  url: "{url}"
instruments:
  - ticker: "SBER"
    name: "Сбербанк"
model:
  store: "store"
  vocab: "voc_100b.sp"
"""


def robot_llm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "robot_llm.commands.main", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=120,
        check=False,
    )


def write_config(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "robot-llm.yaml"
    path.write_text(CONFIG.format(url=url), encoding="utf-8")
    return path


def test_version() -> None:
    proc = robot_llm("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"robot-llm {__version__}"


def test_error_is_one_line_without_traceback(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    proc = robot_llm("config", "check", "-c", str(missing))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {missing}: config file not found"
    assert proc.stdout == ""


def test_traceback_only_with_vv(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.yaml")
    # -vv works before the subcommand and after it.
    for args in (["-vv", "config", "check", "-c", missing], ["config", "check", "-c", missing, "-vv"]):
        proc = robot_llm(*args)
        assert proc.returncode == 2
        assert "Traceback (most recent call last)" in proc.stderr
        assert proc.stderr.rstrip().splitlines()[-1] == f"error: {missing}: config file not found"


def test_postgres_server_down(tmp_path: Path) -> None:
    config = write_config(tmp_path, "postgresql://robot:s3cret@127.0.0.1:1/test")
    proc = robot_llm("db", "current", "-c", str(config))
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: cannot connect to the database postgresql+psycopg://robot:***@127.0.0.1:1/test")
    assert "s3cret" not in proc.stderr
    assert "Traceback" not in proc.stderr


def test_db_upgrade_current_downgrade(tmp_path: Path) -> None:
    config = str(write_config(tmp_path, "sqlite:///robot-llm.sqlite"))
    head = migrate.head()

    proc = robot_llm("db", "current", "-c", config)
    assert proc.returncode == 1
    assert proc.stdout.startswith("none (never migrated) (out of date")
    assert f"robot-llm db upgrade -c {config}" in proc.stdout

    proc = robot_llm("db", "upgrade", "-c", config)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"upgraded base -> {head}"
    assert (tmp_path / "robot-llm.sqlite").is_file()  # relative to the config, not the cwd

    proc = robot_llm("db", "current", "-c", config)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"{head} (up to date)")

    proc = robot_llm("db", "downgrade", "base", "-c", config)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"downgraded {head} -> base"
    assert migrate.current(f"sqlite:///{tmp_path / 'robot-llm.sqlite'}") is None


def test_json_log_format(tmp_path: Path) -> None:
    config = str(write_config(tmp_path, "sqlite:///robot-llm.sqlite"))
    proc = robot_llm("db", "upgrade", "-c", config, "-v", "--log-format", "json")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stderr.splitlines()]
    assert records, "expected INFO log lines from the migration"
    assert all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    assert any("Running upgrade" in r["msg"] for r in records)
    assert all(r["ts"].endswith("+00:00") for r in records)


def test_config_check_masks_secrets(tmp_path: Path) -> None:
    config = write_config(tmp_path, "postgresql://robot:${PG_PASSWORD}@db.lan/robot")
    proc = robot_llm("config", "check", "-c", str(config), env={"PG_PASSWORD": "s3cret-pw"})
    assert proc.returncode == 0, proc.stderr
    assert "s3cret-pw" not in proc.stdout
    assert "postgresql://robot:***@db.lan/robot" in proc.stdout


def test_example_config_checks() -> None:
    proc = robot_llm("config", "check", "-c", str(REPO / "config" / "robot-llm.example.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"# {REPO / 'config' / 'robot-llm.example.yaml'}: OK")


def test_setup_logging_json_and_idempotent(tmp_path: Path) -> None:
    log_file = tmp_path / "logs" / "robot-llm.log"
    root = logging.getLogger()
    level = root.level

    def ours() -> list[logging.Handler]:
        # Other tests may have run main() in-process and left one of ours; count only ours.
        return [h for h in root.handlers if getattr(h, "_robot_llm_handler", False)]

    try:
        setup_logging("INFO", "json", log_file)
        setup_logging("INFO", "json", log_file)  # replaces, does not stack
        assert len(ours()) == 1
        logging.getLogger("robot_llm.test").info("stored %d theses", 3, extra={"run_id": 7})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("robot_llm.test").exception("failed")
        setup_logging("WARNING", "text")
        assert len(ours()) == 1
        assert isinstance(ours()[0], logging.StreamHandler) and not isinstance(ours()[0], logging.FileHandler)
    finally:
        for h in ours():
            root.removeHandler(h)
            h.close()
        root.setLevel(level)
    first, second = (json.loads(line) for line in log_file.read_text(encoding="utf-8").splitlines())
    assert (first["level"], first["logger"], first["msg"], first["run_id"]) == (
        "INFO",
        "robot_llm.test",
        "stored 3 theses",
        7,
    )
    assert "RuntimeError: boom" in second["exc"]
    with pytest.raises(ValueError):
        setup_logging("INFO", "xml")  # type: ignore[arg-type]


def test_missing_extra_is_named(tmp_path: Path) -> None:
    """Without the model extra, a command that needs torch says which extra to install, in one line."""
    blocked = (
        "import sys; sys.modules['torch'] = None; "  # what an install without robot-llm[model] sees
        "from robot_llm.commands.main import main; sys.exit(main(sys.argv[1:]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", blocked, "demo", "--workdir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: this command needs torch, which is not installed: pip install 'robot-llm[model]'"
    )


def test_logging_section_applies_to_every_command_in_the_config_zone(tmp_path: Path) -> None:
    config = tmp_path / "robot-llm.yaml"
    config.write_text(
        CONFIG.format(url="sqlite:///robot-llm.sqlite")
        + 'timezone: "Europe/Moscow"\nlogging:\n  level: "INFO"\n  format: "json"\n  file: "logs/robot-llm.log"\n',
        encoding="utf-8",
    )
    proc = robot_llm("db", "upgrade", "-c", str(config))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # the terminal keeps the command line's verbosity
    records = [json.loads(line) for line in (tmp_path / "logs" / "robot-llm.log").read_text().splitlines()]
    assert any("Running upgrade" in r["msg"] for r in records)
    assert all(r["ts"].endswith("+03:00") for r in records)  # Moscow, like every other time printed

    proc = robot_llm("db", "current", "-c", str(config), "-v")
    text_lines = [line for line in proc.stderr.splitlines() if " INFO " in line]
    assert text_lines and all(line.split()[0].endswith("+03:00") for line in text_lines)


def test_config_check_prints_durations_as_written(tmp_path: Path) -> None:
    proc = robot_llm("config", "check", "-c", str(REPO / "config" / "robot-llm.example.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert "  interval: 15m\n" in proc.stdout and "lookback: 3d\n" in proc.stdout
    assert "PT" not in proc.stdout


@pytest.mark.parametrize("command", [["status"], ["batch", "status"], ["batch", "plan"]])
def test_an_unmigrated_database_says_to_upgrade_not_a_raw_sql_error(tmp_path: Path, command: list[str]) -> None:
    config = str(write_config(tmp_path, "sqlite:///robot-llm.sqlite"))
    proc = robot_llm(*command, "-c", config)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"run `robot-llm db upgrade -c {config}`" in proc.stderr
    assert "OperationalError" not in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
