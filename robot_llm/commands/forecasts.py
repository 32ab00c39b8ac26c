"""``robot-llm forecasts show|export``, ``prices ingest`` and ``track-record``: what a night stored, read
from the shell, and the same theses scored against the closes that came after them.

Times on the command line (``--as-of``, ``--since``, ``--until``) accept ISO 8601 with a
zone (``2026-11-30T09:30+03:00``), a date (``2026-11-30``: midnight in the config's time
zone), ``now``, or a relative time ago (``90m``, ``2h``, ``1d``). A time without a zone is
refused. The resolved moments are printed, so there is no guessing what was asked.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, is_dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from robot_llm.errors import RobotLLMError
from robot_llm.forecasts import THESIS_FIELDS, Forecasts, ThesisRecord, parse_moment

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from robot_llm.config import AppConfig
    from robot_llm.track.ledger import LedgerSettings

TIME_HELP = "ISO 8601 with zone, a date (midnight in the config's zone), 'now', or a relative time like '1d' (ago)"


def _plain(record: ThesisRecord) -> dict[str, Any]:
    """A record as JSON-ready data: ISO UTC times, id lists as lists."""
    data = asdict(record)
    for key, value in data.items():
        if isinstance(value, datetime):
            data[key] = value.isoformat()
        elif isinstance(value, tuple):
            data[key] = list(value)
    return data


def _show(args: argparse.Namespace) -> int:
    with Forecasts.from_config(args.config) as forecasts:
        zone = forecasts.timezone
        as_of = parse_moment(args.as_of, tz=zone)
        tickers = args.ticker or list(forecasts.tickers)
        found = forecasts.latest_many(tickers, as_of, template=args.template, include_stale=args.include_stale)
    if args.json:
        payload = {
            "as_of": as_of.isoformat(),
            "theses": [
                {"ticker": ticker, "thesis": None if rec is None else _plain(rec)} for ticker, rec in found.items()
            ],
        }
        print(json.dumps(payload, ensure_ascii=False, indent=2))
        return 0
    local = as_of.astimezone(zone)
    print(f"theses available as of {local.isoformat()} ({zone})")
    for ticker, rec in found.items():
        if rec is None:
            print(f"\n{ticker}: no valid thesis (abstains)")
            continue
        stale = " STALE" if rec.valid_until <= as_of else ""
        stance = "n/a" if rec.stance is None else f"{rec.stance:+.2f}"
        score = "n/a" if rec.score is None else f"{rec.score:.2f}"
        print(f"\n{ticker}: {rec.stance_label or '-'} (stance {stance}, score {score}){stale}  [thesis {rec.id}]")
        as_of_local, available, valid = (t.astimezone(zone).isoformat() for t in _times(rec))
        print(f"  data as of {as_of_local}, available {available}, valid until {valid}")
        print(f"  model {rec.model_id}, template {rec.template_name}@{rec.template_version}")
        print(f"  inputs: news {list(rec.news_ids)}, signals {list(rec.signal_ids)}{_items_line(rec)}")
        for line in rec.text.strip().splitlines() or [""]:
            print(f"  | {line}")
    return 0


def _items_line(rec: ThesisRecord) -> str:
    """``; item stances placed/asked, mean`` for a thesis whose template scored each news item ("" otherwise)."""
    if not rec.item_stances:
        return ""
    placed = sum(i.stance is not None for i in rec.item_stances)
    mean = "n/a" if rec.item_stance is None else f"{rec.item_stance:+.2f}"
    return f"; item stances {placed}/{len(rec.item_stances)}, mean {mean}"


def _times(rec: ThesisRecord) -> tuple[datetime, datetime, datetime]:
    """A record's time contract: (as_of, available_at, valid_until)."""
    return rec.as_of, rec.available_at, rec.valid_until


def _csv_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, tuple):  # id lists, and the item stances (dataclasses)
        return json.dumps([asdict(v) if is_dataclass(v) else v for v in value], ensure_ascii=False)
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return "" if value is None else value


def _write(records: Iterable[ThesisRecord], fmt: str, out: io.TextIOBase | Any) -> int:
    count = 0
    if fmt == "csv":
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(THESIS_FIELDS)
        for rec in records:
            writer.writerow([_csv_value(getattr(rec, name)) for name in THESIS_FIELDS])
            count += 1
    else:
        for rec in records:
            out.write(json.dumps(_plain(rec), ensure_ascii=False) + "\n")
            count += 1
    return count


def _export(args: argparse.Namespace) -> int:
    with Forecasts.from_config(args.config) as forecasts:
        since = parse_moment(args.since, tz=forecasts.timezone)
        until = parse_moment(args.until, tz=forecasts.timezone)
        records = forecasts.history(args.ticker, since, until, template=args.template)
    if args.output is None:
        _write(records, args.format, sys.stdout)
        return 0
    target = Path(args.output)
    # Write next to the target and rename: an interrupted export never leaves half a file.
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or Path("."))
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as out:
            count = _write(records, args.format, out)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    print(
        f"exported {count} theses available from {since.isoformat()} to {until.isoformat()} to {target}",
        file=sys.stderr,
    )
    return 0


# --------------------------------------------------------------------------- prices in, the ledger out


def _open(config: AppConfig, config_path: str) -> Engine:
    from sqlalchemy import inspect

    from robot_llm.commands.common import open_database

    engine = open_database(config)
    if not inspect(engine).has_table("prices"):
        engine.dispose()
        raise RobotLLMError(
            f"the database {engine.url.render_as_string()} has no prices table; "
            f"run `robot-llm db upgrade -c {config_path}` first"
        )
    return engine


def _ingest(args: argparse.Namespace) -> int:
    from robot_llm.commands.common import load_app_config
    from robot_llm.ingest.prices import ingest_prices

    config = load_app_config(args)
    if not config.prices.enabled:
        print("no price sources configured (prices.csv, prices.freqtrade or prices.signal_price)")
        return 0
    engine = _open(config, args.config)
    try:
        results = ingest_prices(config, engine)
    finally:
        engine.dispose()
    if not results:
        print("no price files found")
    for r in results:
        if r.error:
            print(f"{r.path}: FAILED: {r.error}")
            continue
        print(
            f"{r.path}: {r.read} read, {r.stored} stored, {r.duplicates} already stored, "
            f"{len(r.conflicts)} conflicting, {len(r.rejects)} rejected"
        )
        for line in r.rejects + r.conflicts:
            print(f"  {line}")
    return 1 if any(r.error for r in results) else 0


def _horizons(args: argparse.Namespace) -> tuple[Any, ...] | None:
    from robot_llm.config import parse_duration

    if not args.horizon:
        return None
    try:
        return tuple(parse_duration(h) for h in args.horizon)
    except ValueError as exc:
        raise RobotLLMError(f"--horizon: {exc}") from None


def _track_record(args: argparse.Namespace) -> int:
    from robot_llm.commands.common import load_app_config
    from robot_llm.track.ledger import LedgerSettings, compute_outcomes, format_ledger, ledger, load_closes, load_theses

    config = load_app_config(args)
    settings = LedgerSettings.from_config(config.prices)
    as_of = parse_moment(args.as_of, tz=config.tz)
    horizons = _horizons(args) or settings.horizons
    engine = _open(config, args.config)
    try:
        if args.ab or args.ab_config:
            return _ab(args, config, engine, settings, as_of, horizons)
        theses = load_theses(engine, as_of, ticker=args.ticker, template=args.template, model=args.model)
        wanted = {t.ticker for t in theses} | ({settings.benchmark} if settings.benchmark else set())
        closes = load_closes(engine, wanted, as_of)
    finally:
        engine.dispose()
    if args.outcomes:
        benchmark = closes.get(settings.benchmark) if settings.benchmark else None
        for horizon in horizons:
            for o in compute_outcomes(theses, closes, horizon, benchmark=benchmark)[0]:
                print(json.dumps(o.to_json(), ensure_ascii=False))
        return 0
    rows = ledger(theses, closes, as_of, settings, horizons=horizons)
    if args.json:
        print(json.dumps([r.to_json() for r in rows], ensure_ascii=False, indent=2))
        return 0
    print(f"track record as of {as_of.astimezone(config.tz).isoformat()} ({config.timezone})")
    print(_method_line(settings))
    if not config.prices.enabled:
        print("no price sources configured (prices.csv, prices.freqtrade, prices.signal_price): every thesis pending")
    if not rows:
        print("no theses yet")
    print("\n".join(format_ledger(rows)))
    return 0


def _method_line(settings: LedgerSettings) -> str:
    bench = f", minus {settings.benchmark}'s return over the same span" if settings.benchmark else ""
    return (
        "entry: first close at or after the thesis's available_at; exit: first close at or after entry + horizon; "
        f"return = exit/entry - 1{bench}. Intervals: 95% bootstrap over nights "
        f"({settings.bootstrap} resamples, seed {settings.seed}); below {settings.min_count} theses: not enough data."
    )


def _ab(
    args: argparse.Namespace,
    config: AppConfig,
    engine: Engine,
    settings: LedgerSettings,
    as_of: Any,
    horizons: tuple[Any, ...],
) -> int:
    from robot_llm.config import load_config
    from robot_llm.track.ledger import Side, compare, format_compare, load_closes, load_theses

    if args.ab:
        name_a, name_b = args.ab
        a = Side(name_a, load_theses(engine, as_of, ticker=args.ticker, template=name_a, model=args.model))
        b = Side(name_b, load_theses(engine, as_of, ticker=args.ticker, template=name_b, model=args.model))
    else:
        other = load_config(args.ab_config)
        name_a, name_b = str(args.config), str(args.ab_config)
        a = Side(name_a, load_theses(engine, as_of, ticker=args.ticker, template=args.template, model=args.model))
        other_engine = _open(other, args.ab_config)
        try:
            b = Side(name_b, load_theses(other_engine, as_of, ticker=args.ticker, template=args.template))
        finally:
            other_engine.dispose()
    wanted = {t.ticker for t in [*a.theses, *b.theses]} | ({settings.benchmark} if settings.benchmark else set())
    closes = load_closes(engine, wanted, as_of)
    rows = compare(a, b, closes, settings, horizons=horizons)
    if args.json:
        print(json.dumps({"a": name_a, "b": name_b, "rows": [r.to_json() for r in rows]}, ensure_ascii=False, indent=2))
        return 0
    print(
        f"A/B as of {as_of.astimezone(config.tz).isoformat()}: A = {name_a}, B = {name_b}, "
        "paired by instrument and night"
    )
    print(_method_line(settings))
    print("\n".join(format_compare(rows, name_a, name_b)) or "no (instrument, night) scored by both sides")
    return 0


def _register_track_record(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``prices ingest`` and ``track-record``."""
    prices = sub.add_parser("prices", help="closing prices for the track record")
    actions = prices.add_subparsers(dest="prices_command", metavar="ACTION", required=True)
    ingest = actions.add_parser(
        "ingest", parents=[common], help="store new closes from the CSV folder, freqtrade's data and the signals"
    )
    ingest.set_defaults(handler=_ingest)

    tr = sub.add_parser(
        "track-record", parents=[common], help="every thesis scored against what the market did next, point-in-time"
    )
    tr.add_argument("--horizon", action="append", help="horizon like 1d or 5d (repeatable; default: prices.horizons)")
    tr.add_argument("--as-of", default="now", help=f"what was known at this moment (default: now): {TIME_HELP}")
    tr.add_argument("--ticker", help="only this instrument")
    tr.add_argument("--template", help="only theses of this template")
    tr.add_argument("--model", help="only theses of this model id")
    tr.add_argument("--json", action="store_true", help="print JSON: a list with one object per group")
    tr.add_argument("--outcomes", action="store_true", help="print every scored thesis as JSON lines instead")
    tr.add_argument("--ab", nargs=2, metavar=("TEMPLATE_A", "TEMPLATE_B"), help="compare two templates, same nights")
    tr.add_argument("--ab-config", metavar="OTHER_CFG", help="compare with the theses in another config's database (B)")
    tr.set_defaults(handler=_track_record)


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``forecasts show``, ``forecasts export``, ``prices ingest`` and ``track-record``."""
    forecasts = sub.add_parser("forecasts", help="read theses point-in-time (what strategies see)")
    actions = forecasts.add_subparsers(dest="forecasts_command", metavar="ACTION", required=True)

    show = actions.add_parser("show", parents=[common], help="the latest valid thesis per instrument at a moment")
    show.add_argument("--ticker", action="append", help="instrument (repeatable; default: all configured)")
    show.add_argument("--as-of", default="now", help=f"the moment to look from (default: now): {TIME_HELP}")
    show.add_argument("--template", help="only theses of this template")
    show.add_argument("--include-stale", action="store_true", help="show the latest thesis even past valid_until")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(handler=_show)

    export = actions.add_parser(
        "export", parents=[common], help="every thesis that became available in a time range (for backtests)"
    )
    export.add_argument("--since", required=True, help=f"from this moment, included: {TIME_HELP}")
    export.add_argument("--until", default="now", help="to this moment, included (default: now)")
    export.add_argument("--format", required=True, choices=("csv", "jsonl"), help="output format")
    export.add_argument("--output", help="write to this file (default: standard output)")
    export.add_argument("--ticker", help="only this instrument")
    export.add_argument("--template", help="only theses of this template")
    export.set_defaults(handler=_export)
    _register_track_record(sub, common)
