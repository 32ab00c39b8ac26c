"""Helpers of the batch tests: a config on the tiny fixture model, a tiny template, seeded queues.

Everything is real: the yalm-tiny release checkpoint run by the in-memory engine, its
SentencePiece vocabulary, SQLite files and PostgreSQL schemas from the root conftest,
and worker processes started as ``python -m robot_llm.commands.main batch run``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from robot_llm.config import AppConfig, load_config
from robot_llm.store.db import GenerationRequest, NewsItem, NewsTicker, Run, Thesis, session_scope, utcnow

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "fixtures" / "yalm-tiny"
VOCAB = TINY / "vocab" / "voc_tiny.sp"

# Short enough that prompt + thesis + cue + label fit the tiny model's 64 positions.
TINY_TEMPLATE = """---
name: tiny
version: "1"
language: en
news:
  max_items: 2
  fields: [title]
  max_chars: 40
signals:
  include: true
  max: 1
generation:
  max_new_tokens: 6
stop: ["\\n"]
stance:
  cue: " so"
  labels:
    " up": 1
    " down": -1
    " flat": 0
---
{{ instrument.ticker }}{% for item in news %} {{ item.text }}{% endfor %}:
"""

STANCE = {"cue": " so", "labels": {" up": 1.0, " down": -1.0, " flat": 0.0}}


def add_news(benv: BatchEnv, night: datetime, ticker: str, title: str, key: str, hours: int = 2) -> int:
    """A news item about ``ticker`` fetched ``hours`` before the night; returns its id."""
    with session_scope(benv.engine) as s:
        item = NewsItem(
            feed="wire",
            item_key=key,
            title=title,
            summary="",
            fetched_at=night - timedelta(hours=hours),
            content_hash=key,
        )
        item.tickers.append(NewsTicker(ticker=ticker))
        s.add(item)
        s.flush()
        return item.id


def contract_params(seed: int, max_new_tokens: int = 6) -> dict[str, Any]:
    """A request's params JSON in the batch contract's shape."""
    return {
        "max_new_tokens": max_new_tokens,
        "greedy": False,
        "temperature": 0.9,
        "top_k": 0,
        "top_p": 0.9,
        "seed": seed,
        "stop": ["\n"],
        "stance": STANCE,
    }


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@dataclass
class BatchEnv:
    """One test's database, folder and config file, with helpers to seed and inspect the queue."""

    tmp: Path
    db_url: str
    engine: Engine
    kind: str

    @property
    def prompts_dir(self) -> Path:
        return self.tmp / "prompts"

    def write_config(self, name: str = "robot-llm.yaml", *, instruments: int = 3, **sections: Any) -> Path:
        """Write a config file (tiny model, tiny template, short lease) with ``sections`` merged in."""
        base: dict[str, Any] = {
            "database": {"url": self.db_url},
            "timezone": "UTC",
            "instruments": [{"ticker": f"T{i:03d}", "name": f"Company {i}"} for i in range(instruments)],
            # The tiny prompts show no news: generate them all the same (the abstention has tests of its own).
            "prompts": {
                "dir": str(self.prompts_dir),
                "templates": ["tiny"],
                "generation": {"seed": 7},
                "abstain_without_inputs": False,
            },
            "model": {
                "id": "yalm-tiny",
                "backend": "memory",
                "checkpoint": str(TINY),
                "vocab": str(VOCAB),
                "dtype": "fp32",
                "device": "cpu",
                "max_batch_size": 4,
                "max_positions": 64,
            },
            "batch": {"lease": "2s", "max_attempts": 2, "stall_timeout": "10m"},
        }
        path = self.tmp / name
        path.write_text(yaml.safe_dump(_merge(base, sections), allow_unicode=True), encoding="utf-8")
        return path

    def config(self, **sections: Any) -> AppConfig:
        return load_config(self.write_config(**sections))

    def seed(self, n: int, as_of: datetime, *, prompt: Callable[[int], str] | None = None, start: int = 0) -> list[int]:
        """Store ``n`` pending requests for night ``as_of`` directly (as the planner would)."""
        from robot_llm.llm.tokenizer import YalmTokenizer

        tokenizer = YalmTokenizer(VOCAB)
        now = utcnow()
        ids = []
        with session_scope(self.engine) as s:
            for i in range(start, start + n):
                text = prompt(i) if prompt else f"T{i:03d} news {i}:"
                req = GenerationRequest(
                    as_of=as_of,
                    ticker=f"T{i:03d}",
                    template_name="tiny",
                    template_version="1",
                    prompt=text,
                    prompt_sha256=hashlib.sha256(text.encode()).hexdigest(),
                    prompt_tokens=len(tokenizer.encode(text)),
                    news_ids=[],
                    signal_ids=[],
                    params=contract_params(seed=1000 + i),
                    valid_until=as_of + timedelta(days=1),
                    status="pending",
                    attempts=0,
                    created_at=now,
                    updated_at=now,
                )
                s.add(req)
                s.flush()
                ids.append(req.id)
        return ids

    def status_counts(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(GenerationRequest.status, func.count()).group_by(GenerationRequest.status)).all()
        return {k: int(v) for k, v in rows}

    def thesis_count(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(Thesis)).scalar_one())

    def theses(self) -> list[Thesis]:
        with session_scope(self.engine) as s:
            return list(s.scalars(select(Thesis).order_by(Thesis.request_id)))

    def requests(self) -> list[GenerationRequest]:
        with session_scope(self.engine) as s:
            return list(s.scalars(select(GenerationRequest).order_by(GenerationRequest.id)))

    def runs(self, kind: str = "generate") -> list[Run]:
        with session_scope(self.engine) as s:
            return list(s.scalars(select(Run).where(Run.kind == kind).order_by(Run.id)))

    def wait_leases_expired(self, timeout: float = 30.0) -> None:
        """Block until no request holds a live lease (a dead worker's leases run out)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.engine.connect() as conn:
                latest = conn.execute(
                    select(func.max(GenerationRequest.lease_expires_at)).where(GenerationRequest.status == "running")
                ).scalar()
                beat = conn.execute(
                    select(func.max(Run.heartbeat_at)).where(Run.kind == "generate", Run.status == "running")
                ).scalar()
            lease = timedelta(seconds=2)
            now = utcnow()
            if (latest is None or latest < now) and (beat is None or beat < now - lease):
                return
            time.sleep(0.2)
        raise AssertionError("leases did not expire")


def sqlite_env_on(folder: Path, tmp: Path) -> BatchEnv:
    """A BatchEnv on a migrated SQLite database in ``folder`` (e.g. a small disk), the tiny template in ``tmp``."""
    from robot_llm.store.db import make_engine
    from robot_llm.store.migrate import upgrade

    url = f"sqlite:///{folder / 'robot-llm.sqlite'}"
    upgrade(url)
    (tmp / "prompts").mkdir()
    (tmp / "prompts" / "tiny.j2").write_text(TINY_TEMPLATE, encoding="utf-8")
    return BatchEnv(tmp=tmp, db_url=url, engine=make_engine(url), kind="sqlite")


def start_worker(config: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """A real ``robot-llm batch run`` process."""
    return subprocess.Popen(
        [sys.executable, "-m", "robot_llm.commands.main", "batch", "run", "-c", str(config), *extra],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(predicate: Callable[[], bool], proc: subprocess.Popen[str] | None = None, timeout: float = 60.0) -> None:
    """Poll ``predicate`` until true; fail early with the worker's output if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"worker exited {proc.returncode} before the condition held:\n{out}\n{err}")
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")
