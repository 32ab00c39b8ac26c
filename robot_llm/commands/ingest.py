"""``robot-llm ingest feeds|signals``, ``robot-llm news list`` and ``robot-llm signals list``."""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from robot_llm.errors import RobotLLMError

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from robot_llm.config import AppConfig


def _open(args: argparse.Namespace) -> tuple[AppConfig, Engine]:
    from sqlalchemy import inspect

    from robot_llm.commands.common import load_app_config, open_database

    config = load_app_config(args)
    engine = open_database(config)
    if not inspect(engine).has_table("news_items"):
        engine.dispose()
        raise RobotLLMError(
            f"the database {engine.url.render_as_string()} has no robot-llm tables; "
            f"run `robot-llm db upgrade -c {args.config}` first"
        )
    return config, engine


def _since(value: str) -> datetime:
    """``--since``: a duration back from now (``1d``, ``6h``) or an ISO 8601 time with a zone."""
    from robot_llm.config import parse_duration

    try:
        return datetime.now(timezone.utc) - parse_duration(value)
    except ValueError:
        pass
    try:
        stamp = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a duration like '1d' or a time like 2026-11-27T09:00:00+03:00, got {value!r}"
        ) from None
    if stamp.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{value!r} has no time zone (add +03:00 or Z)")
    return stamp.astimezone(timezone.utc)


def _local(value: str, config: AppConfig) -> str:
    """A stored UTC time as the config's local time, for the human-readable listings."""
    return datetime.fromisoformat(value).astimezone(config.tz).strftime("%Y-%m-%d %H:%M %Z")


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


# --------------------------------------------------------------------------- ingest


def _ingest_feeds(args: argparse.Namespace) -> int:
    from robot_llm.ingest.feeds import ingest_feeds

    config, engine = _open(args)
    try:
        results = ingest_feeds(config, engine, only=args.feed or None)
    finally:
        engine.dispose()
    if not results:
        print("no feeds to fetch (none configured or all disabled)")
        return 0
    for r in results:
        code = f" (HTTP {r.http_status})" if r.http_status is not None else ""
        if r.status == "error":
            print(f"{r.feed}: FAILED{code}: {r.error}")
        elif r.status == "not_modified":
            print(f"{r.feed}: not modified{code}")
        else:
            print(f"{r.feed}: {r.new} new, {r.duplicates} duplicate{code}")
        if r.warning:
            print(f"  warning: {r.warning}")
    failed = sum(not r.ok for r in results)
    if failed:
        print(f"{failed} of {len(results)} feeds failed")
    return 1 if failed else 0


def _ingest_signals(args: argparse.Namespace) -> int:
    from robot_llm.ingest.signals import ingest_signals

    config, engine = _open(args)
    if not config.signals.sources:
        engine.dispose()
        print("no signal sources configured (signals.sources)")
        return 0
    try:
        results = ingest_signals(config, engine)
    finally:
        engine.dispose()
    if not results:
        print("no new signal files")
    for r in results:
        if r.error:
            print(f"{r.source}: FAILED: {r.error}")
            continue
        line = f"{r.source}: {r.path.name}: {r.stored} stored, {r.duplicates} duplicate, {len(r.rejects)} rejected"
        print(line)
        if r.unknown_tickers:
            print(f"  unknown tickers: {', '.join(r.unknown_tickers)}")
        if r.rejects_path:
            print(f"  rejects: {r.rejects_path}")
    return 1 if any(r.error for r in results) else 0


# --------------------------------------------------------------------------- listing


def _news_list(args: argparse.Namespace) -> int:
    from sqlalchemy import select

    from robot_llm.store.db import NewsItem, NewsTicker, session_scope

    config, engine = _open(args)
    stmt = select(NewsItem).order_by(NewsItem.fetched_at.desc(), NewsItem.id.desc()).limit(args.limit)
    if args.ticker:
        stmt = stmt.where(NewsItem.id.in_(select(NewsTicker.news_id).where(NewsTicker.ticker == args.ticker)))
    if args.since:
        stmt = stmt.where(NewsItem.fetched_at >= args.since)
    try:
        with session_scope(engine) as session:
            items = [
                {
                    "id": n.id,
                    "feed": n.feed,
                    "title": n.title,
                    "summary": n.summary,
                    "link": n.link,
                    "guid": n.guid,
                    "language": n.language,
                    "published_at": _iso(n.published_at),
                    "fetched_at": _iso(n.fetched_at),
                    "tickers": sorted(t.ticker for t in n.tickers),
                }
                for n in session.scalars(stmt)
            ]
    finally:
        engine.dispose()
    if args.json:
        print(json.dumps(items, ensure_ascii=False, indent=2))
        return 0
    for item in items:
        when = _local(item["published_at"] or item["fetched_at"], config)
        tickers = ",".join(item["tickers"]) or "-"
        print(f"{item['id']:>6}  {when}  {tickers:<14} {item['feed']}: {item['title']}")
    if not items:
        print("no news" + (f" for {args.ticker}" if args.ticker else ""))
    return 0


def _signals_list(args: argparse.Namespace) -> int:
    from sqlalchemy import select

    from robot_llm.store.db import Signal, session_scope

    config, engine = _open(args)
    stmt = select(Signal).order_by(Signal.generated_at.desc(), Signal.id.desc()).limit(args.limit)
    if args.ticker:
        stmt = stmt.where(Signal.ticker == args.ticker)
    if args.since:
        stmt = stmt.where(Signal.generated_at >= args.since)
    try:
        with session_scope(engine) as session:
            rows: list[dict[str, Any]] = [
                {
                    "id": s.id,
                    "ticker": s.ticker,
                    "generated_at": _iso(s.generated_at),
                    "received_at": _iso(s.received_at),
                    "horizon": s.horizon,
                    "direction": s.direction,
                    "target": s.target,
                    "confidence": s.confidence,
                    "model": s.model,
                    "extras": s.extras,
                    "source": s.source,
                }
                for s in session.scalars(stmt)
            ]
    finally:
        engine.dispose()
    if args.json:
        print(json.dumps(rows, ensure_ascii=False, indent=2))
        return 0
    arrows = {1: "up", -1: "down", 0: "flat", None: "-"}
    for r in rows:
        target = f"{r['target']:g}" if r["target"] is not None else "-"
        conf = f"{r['confidence']:.2f}" if r["confidence"] is not None else "-"
        print(
            f"{r['id']:>6}  {_local(r['generated_at'], config)}  {r['ticker']:<8} {r['horizon']:<4} "
            f"{arrows[r['direction']]:<5} target={target:<10} conf={conf:<5} {r['model']}"
        )
    if not rows:
        print("no signals" + (f" for {args.ticker}" if args.ticker else ""))
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``ingest feeds|signals``, ``news list`` and ``signals list``."""
    ingest = sub.add_parser("ingest", help="fetch news feeds and take in the robot's signal files")
    ingest_sub = ingest.add_subparsers(dest="ingest_command", metavar="WHAT", required=True)
    feeds = ingest_sub.add_parser("feeds", parents=[common], help="fetch every enabled feed now")
    feeds.add_argument(
        "--feed", action="append", metavar="NAME", help="only this feed (repeatable; runs it even if disabled)"
    )
    feeds.set_defaults(handler=_ingest_feeds)
    signals = ingest_sub.add_parser("signals", parents=[common], help="store complete files from the drop folders")
    signals.set_defaults(handler=_ingest_signals)

    news = sub.add_parser("news", help="stored news")
    news_sub = news.add_subparsers(dest="news_command", metavar="ACTION", required=True)
    news_list = news_sub.add_parser("list", parents=[common], help="list stored news, newest first")
    news_list.add_argument("--ticker", help="only news tagged with this ticker")
    news_list.add_argument("--since", type=_since, help="fetched since: a duration back from now (1d) or a time")
    news_list.add_argument("--limit", type=int, default=50, help="at most this many (default: %(default)s)")
    news_list.add_argument("--json", action="store_true", help="print JSON")
    news_list.set_defaults(handler=_news_list)

    sigs = sub.add_parser("signals", help="stored robot signals")
    sigs_sub = sigs.add_subparsers(dest="signals_command", metavar="ACTION", required=True)
    sigs_list = sigs_sub.add_parser("list", parents=[common], help="list stored signals, newest first")
    sigs_list.add_argument("--ticker", help="only this ticker")
    sigs_list.add_argument("--since", type=_since, help="generated since: a duration back from now (1d) or a time")
    sigs_list.add_argument("--limit", type=int, default=50, help="at most this many (default: %(default)s)")
    sigs_list.add_argument("--json", action="store_true", help="print JSON")
    sigs_list.set_defaults(handler=_signals_list)
