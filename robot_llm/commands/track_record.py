"""``robot-llm prices ingest`` and ``robot-llm track-record``: closes in, the ledger out."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from robot_llm.errors import RobotLLMError

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from robot_llm.config import AppConfig
    from robot_llm.track.ledger import LedgerSettings

TIME_HELP = "ISO 8601 with zone, a date (midnight in the config's zone), 'now', or a relative time like '1d' (ago)"


def ledger_settings(config: AppConfig) -> LedgerSettings:
    """The ledger's settings from the config's ``prices:`` section."""
    from robot_llm.track.ledger import LedgerSettings

    return LedgerSettings.from_config(config.prices)


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
    from robot_llm.forecasts import parse_moment
    from robot_llm.track.ledger import compute_outcomes, format_ledger, ledger, load_closes, load_theses

    config = load_app_config(args)
    settings = ledger_settings(config)
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


def register(sub: Any, common: argparse.ArgumentParser) -> None:
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
