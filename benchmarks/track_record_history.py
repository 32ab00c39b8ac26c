"""The track record on real history: dated news headlines and daily closes, through the night and the ledger.

Data (public, licence-clean; what is bundled and what is not):

* **Closes**: the U.S. Energy Information Administration's daily Cushing WTI spot price
  (series RWTCD, https://www.eia.gov/dnav/pet/hist/RWTCD.htm), as republished by
  https://github.com/datasets/oil-prices (``data/wti-daily.csv``). U.S. government work, in the
  public domain ("Source: U.S. Energy Information Administration"). 2003 to March 2004 is
  bundled as ``benchmarks/data/eia-wti-daily-2003.csv``; ``--closes`` takes any other span in
  the same ``time,close`` (or ``Date,Price``) layout.
* **Headlines**: "A Million News Headlines" (ABC News, Australia; compiled by Rohit Kulkarni,
  Harvard Dataverse, https://doi.org/10.7910/DVN/SYBGZL, released under CC0 1.0): the file
  ``abcnews-date-text.csv`` (``publish_date,headline_text``). The headlines are the ABC's
  writing, so they are not bundled: download the file and pass ``--headlines``.

What it does, with the product's own code: a config with one instrument, WTI ("crude oil";
headlines are tagged by the ingest's tagger on the words oil, crude, OPEC), the ``brief_en``
template and the demo's Gemma 3 270M store (converted from the packaged GGUF on first use).
Each headline is stored as news fetched at the end of its (Sydney) publication day. For every
trading day with tagged news in the last ``news_lookback`` the night is planned with its
cut-off at 20:00 New York time, then the whole queue is generated in one run. This is a
replay: the database stamps ``available_at`` when a thesis is committed (today), so each
thesis is then given the ``available_at`` a nightly run would have given it (its cut-off plus
the generation time, here 10 minutes). The closes go in with ``robot-llm prices ingest`` (a
date is that day's 14:30 New York close, NYMEX's settlement), and ``robot-llm track-record``
prints the ledger as known at the end of the span, with the outcomes of every thesis.

    python benchmarks/track_record_history.py --headlines abcnews-date-text.csv \\
        [--start 2003-02-19 --end 2003-10-20] [--workdir track-history] [--max-nights N]
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from datetime import date, datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import yaml

REPO = Path(__file__).resolve().parents[1]
CLOSES = REPO / "benchmarks" / "data" / "eia-wti-daily-2003.csv"
NEW_YORK = ZoneInfo("America/New_York")
SYDNEY = ZoneInfo("Australia/Sydney")


def read_headlines(path: Path, start: date, end: date) -> list[tuple[date, str]]:
    """(publication day, headline) of the ABC file within [start, end]."""
    out = []
    with path.open(encoding="utf-8-sig", newline="") as f:
        for row in csv.DictReader(f):
            day = datetime.strptime(row["publish_date"], "%Y%m%d").date()
            if start <= day <= end:
                out.append((day, row["headline_text"].strip()))
    return out


def read_closes(path: Path) -> list[tuple[date, float]]:
    """(day, close) of an EIA-style CSV (``time,close`` or ``Date,Price``); empty prices skipped."""
    out = []
    with path.open(encoding="utf-8-sig", newline="") as f:
        for row in csv.DictReader(f):
            when = row.get("time") or row.get("Date")
            value = row.get("close") or row.get("Price")
            if when and value:
                out.append((date.fromisoformat(when), float(value)))
    return out


def write_config(workdir: Path, store: Path) -> Path:
    """The benchmark's config: WTI, brief_en, the Gemma store, the closes folder."""
    config = {
        "database": {"url": "sqlite:///history.sqlite"},
        "timezone": "America/New_York",
        "instruments": [
            {"ticker": "WTI", "name": "crude oil", "aliases": ["oil", "crude", "OPEC"], "exchange": "NYMEX"}
        ],
        # valid_for: the replay generates years later; replay_availability restores one day.
        "prompts": {"templates": ["brief_en"], "news_lookback": "2d", "max_news": 6, "valid_for": "36500d"},
        "model": {
            "id": "gemma-3-270m",
            "backend": "stream",
            "store": str(store),
            "vocab": str(store / "tokenizer.json"),
            "home": "ram",
            "dtype": "fp32",
            "device": "cpu",
            "max_batch_size": 16,
            "max_positions": 1024,
        },
        "schedule": {"cutoff": "09:30", "skip_non_trading_days": False},
        "prices": {"csv": "prices", "horizons": ["1d", "5d"], "market_close": "14:30", "min_count": 20},
    }
    path = workdir / "history.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def gemma_store(workdir: Path) -> Path:
    """The demo's Gemma 3 270M store (converted once from the packaged GGUF, as `robot-llm demo` does)."""
    from robot_llm.llm.store.demo_checkpoint import gemma_gguf
    from robot_llm.llm.store.importers import import_model
    from robot_llm.llm.store.reader import MANIFEST

    store = workdir / "model" / "gemma-3-270m"
    if not (store / MANIFEST).is_file():
        gguf = gemma_gguf()
        if gguf is None:
            raise SystemExit("the demo's model package is not installed: pip install 'robot-llm[demo]'")
        import_model(gguf, store, dtype="bf16")
    return store


def store_news(config_path: Path, headlines: list[tuple[date, str]]) -> list[datetime]:
    """Headlines into news_items, tagged by the ingest's tagger; returns when each tagged one was fetched."""
    import hashlib

    from robot_llm.config import load_config
    from robot_llm.ingest.tagging import Tagger
    from robot_llm.store.db import NewsItem, NewsTicker, make_engine, session_scope

    config = load_config(config_path)
    tagger = Tagger.from_instruments(config.instruments)
    engine = make_engine(config.database.url)
    tagged: list[datetime] = []
    try:
        with session_scope(engine) as s:
            for i, (day, title) in enumerate(headlines):
                tickers = tagger.tag(title)
                if not tickers:
                    continue
                # Known at the end of its publication day in Sydney: nothing of it leaks earlier.
                fetched = datetime.combine(day + timedelta(days=1), datetime.min.time(), SYDNEY)
                digest = hashlib.sha256(f"{day}|{title}".encode()).hexdigest()
                item = NewsItem(
                    feed="abc-headlines",
                    item_key=f"{day.isoformat()}-{i}",
                    title=title,
                    summary="",
                    language="en",
                    published_at=datetime.combine(day, datetime.min.time(), SYDNEY),
                    fetched_at=fetched.astimezone(timezone.utc),
                    content_hash=digest,
                )
                item.tickers = [NewsTicker(ticker=t) for t in tickers]
                s.add(item)
                tagged.append(item.fetched_at)
    finally:
        engine.dispose()
    return tagged


def cutoff(day: date) -> datetime:
    """A trading day's night: its cut-off at 20:00 New York time, after the close."""
    return datetime.combine(day, datetime.min.time().replace(hour=20), NEW_YORK).astimezone(timezone.utc)


def plan_nights(config_path: Path, days: list[date], max_nights: int | None) -> list[datetime]:
    """Plan the nights of ``days`` (as each night would have planned itself); returns the cut-offs planned."""
    from robot_llm.config import load_config
    from robot_llm.night.plan import plan_night
    from robot_llm.store.db import make_engine

    config = load_config(config_path)
    engine = make_engine(config.database.url)
    planned = []
    try:
        for day in days:
            as_of = cutoff(day)
            result = plan_night(config, engine, as_of, now=as_of)  # planned as that night did
            if result.created:
                planned.append(as_of)
            if max_nights is not None and len(planned) >= max_nights:
                break
    finally:
        engine.dispose()
    return planned


def replay_availability(config_path: Path, delay: timedelta) -> int:
    """Give each thesis the available_at its own night would have given it: cut-off + ``delay``."""
    from sqlalchemy import select

    from robot_llm.config import load_config
    from robot_llm.store.db import Thesis, make_engine, session_scope

    config = load_config(config_path)
    engine = make_engine(config.database.url)
    try:
        with session_scope(engine) as s:
            theses = s.scalars(select(Thesis)).all()
            for t in theses:
                t.available_at = t.as_of + delay
                t.valid_until = t.available_at + timedelta(days=1)
            return len(theses)
    finally:
        engine.dispose()


def cli(*args: str) -> str:
    """Run ``robot-llm ARGS`` in a fresh process; return its output."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "robot_llm.commands.main", *args]
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"robot-llm {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--headlines", type=Path, required=True, help="abcnews-date-text.csv (see the docstring)")
    parser.add_argument(
        "--closes", type=Path, default=CLOSES, help="daily closes, time,close (default: bundled EIA WTI)"
    )
    parser.add_argument("--start", type=date.fromisoformat, default=date(2003, 2, 19))
    parser.add_argument("--end", type=date.fromisoformat, default=date(2003, 10, 20))
    parser.add_argument("--workdir", type=Path, default=Path("track-history"))
    parser.add_argument("--max-nights", type=int, default=None, help="stop planning after this many nights")
    args = parser.parse_args()
    if not args.headlines.is_file():
        raise SystemExit(
            f"{args.headlines}: no such file; download abcnews-date-text.csv from https://doi.org/10.7910/DVN/SYBGZL"
        )
    workdir = args.workdir.resolve()
    if (workdir / "history.sqlite").exists():
        raise SystemExit(f"{workdir} already holds a run; remove it or pass another --workdir")
    (workdir / "prices").mkdir(parents=True, exist_ok=True)
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (a shared machine)", flush=True)

    store = gemma_store(workdir)
    config = write_config(workdir, store)
    cli("db", "upgrade", "-c", str(config))
    headlines = read_headlines(args.headlines, args.start, args.end)
    tagged = store_news(config, headlines)
    print(f"headlines {args.start}..{args.end}: {len(headlines)}, tagged WTI (oil, crude, OPEC): {len(tagged)}")

    closes = [(d, c) for d, c in read_closes(args.closes) if args.start <= d <= args.end + timedelta(days=30)]
    with (workdir / "prices" / "WTI.csv").open("w", encoding="utf-8") as f:
        f.write("time,close\n" + "".join(f"{d.isoformat()},{c}\n" for d, c in closes))
    trading_days = [d for d, _ in closes if d <= args.end]
    # A night without any tagged news in its lookback would be a thesis from nothing: not planned.
    lookback = timedelta(days=2)
    with_news = [d for d in trading_days if any(cutoff(d) - lookback < t <= cutoff(d) for t in tagged)]
    nights = plan_nights(config, with_news, args.max_nights)
    print(f"nights planned: {len(nights)}; trading days {len(trading_days)}, with tagged news {len(with_news)}")

    started = time.perf_counter()
    print(cli("batch", "run", "-c", str(config)).strip().splitlines()[-1], flush=True)
    print(f"generation took {time.perf_counter() - started:.0f} s")
    replayed = replay_availability(config, timedelta(minutes=10))
    print(f"theses: {replayed} (available_at replayed as cut-off + 10 min)")
    print(cli("prices", "ingest", "-c", str(config)).strip())

    as_of = (args.end + timedelta(days=30)).isoformat()
    print(cli("track-record", "-c", str(config), "--as-of", as_of).rstrip())
    (workdir / "ledger.json").write_text(cli("track-record", "-c", str(config), "--as-of", as_of, "--json"))
    (workdir / "outcomes.jsonl").write_text(cli("track-record", "-c", str(config), "--as-of", as_of, "--outcomes"))
    print(f"JSON: {workdir / 'ledger.json'}, every outcome: {workdir / 'outcomes.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
