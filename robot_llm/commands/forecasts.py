"""``robot-llm forecasts show`` and ``robot-llm forecasts export``: the read API from the shell.

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
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from robot_llm.forecasts import THESIS_FIELDS, Forecasts, ThesisRecord, parse_moment

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
        print(f"  inputs: news {list(rec.news_ids)}, signals {list(rec.signal_ids)}")
        for line in rec.text.strip().splitlines() or [""]:
            print(f"  | {line}")
    return 0


def _times(rec: ThesisRecord) -> tuple[datetime, datetime, datetime]:
    """A record's time contract: (as_of, available_at, valid_until)."""
    return rec.as_of, rec.available_at, rec.valid_until


def _csv_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, tuple):
        return json.dumps(list(value))
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


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``forecasts show`` and ``forecasts export``."""
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
