"""``robot-llm batch plan|run|status``, ``robot-llm report`` and ``robot-llm doctor``.

Import-light on purpose: the parser is built for every command, so the heavy modules
(the worker, the planner, the model) are imported inside the handlers.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from robot_llm.config import AppConfig

__all__ = ["register"]


def _parse_day(value: str) -> date:
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a date like 2026-11-30, got {value!r}") from None


def _open(args: argparse.Namespace) -> tuple[AppConfig, Any]:
    from robot_llm.commands.common import load_app_config, open_database
    from robot_llm.store.migrate import ensure_current

    config = load_app_config(args)
    engine = open_database(config)
    ensure_current(engine, args.config)
    return config, engine


def _plan(args: argparse.Namespace) -> int:
    from robot_llm.clock import night_as_of, parse_as_of
    from robot_llm.night.plan import plan_night
    from robot_llm.store.db import utcnow

    config, engine = _open(args)
    try:
        as_of = parse_as_of(args.as_of, config.tz) if args.as_of else night_as_of(config, utcnow())
        result = plan_night(config, engine, as_of)
    finally:
        engine.dispose()
    local = result.as_of.astimezone(config.tz).strftime("%Y-%m-%d %H:%M %Z")
    print(
        f"planned night {local}: {result.created} new request(s), {result.existing} already planned, "
        f"{len(result.skipped)} skipped"
    )
    for ticker, template, reason in result.skipped:
        print(f"  skipped {ticker} {template}: {reason}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from robot_llm.clock import parse_as_of
    from robot_llm.night.worker import run_queue, summary_line

    config, engine = _open(args)
    as_of = parse_as_of(args.as_of, config.tz) if args.as_of else None
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()
        print(
            f"{signal.Signals(signum).name}: finishing the current batch, then stopping "
            "(send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )
        # A second signal means "now": the batch in flight is lost, its leases expire.
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        summary = run_queue(
            config,
            engine,
            worker_id=args.worker_id,
            as_of=as_of,
            stop=stop,
            preflight=not args.skip_preflight,
        )
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        engine.dispose()
    print(summary_line(summary))
    for request_id, error in summary.failures:
        print(f"  request #{request_id} failed: {error}")
    # A clean stop on request (SIGTERM, Ctrl-C) exits 0: what was done is stored, the rest waits.
    if summary.exit_code:
        print(f"error: {summary_line(summary)}", file=sys.stderr)
    return summary.exit_code


def _status(args: argparse.Namespace) -> int:
    from robot_llm.report.summary import format_status, queue_status

    config, engine = _open(args)
    try:
        status = queue_status(engine, nights=args.nights)
    finally:
        engine.dispose()
    print(format_status(status, config))
    return 0


def _report(args: argparse.Namespace) -> int:
    from robot_llm.report.summary import format_report, report_job

    if args.html:
        from robot_llm.report.html import require_plotly

        require_plotly()  # before anything is recorded
    config, engine = _open(args)
    try:
        report = report_job(config, engine, args.date)
        if args.html:
            from robot_llm.report.html import write_report

            print(f"wrote {write_report(config, engine, report.day, args.html)}", file=sys.stderr)
    finally:
        engine.dispose()
    if args.json:
        print(json.dumps(report.to_json(), ensure_ascii=False, indent=1))
    else:
        print(format_report(report, config))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from robot_llm.night.preflight import doctor, format_checks

    checks = doctor(args.config, deep=args.deep)
    print(format_checks(checks))
    return 1 if any(c.ok is False for c in checks) else 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``batch plan|run|status``, ``report`` and ``doctor``."""
    batch = sub.add_parser("batch", help="the nightly batch: plan requests, run the model, show the queue")
    batch_sub = batch.add_subparsers(dest="batch_command", metavar="ACTION", required=True)
    as_of_help = "the night's cut-off, ISO 8601 (no offset: the config's timezone); default: the latest nightly time"

    plan = batch_sub.add_parser("plan", parents=[common], help="render tonight's prompts into generation requests")
    plan.add_argument("--as-of", help=as_of_help)
    plan.set_defaults(handler=_plan)

    run = batch_sub.add_parser(
        "run", parents=[common], help="generate theses for pending requests (SIGTERM/Ctrl-C: finish the batch, stop)"
    )
    run.add_argument("--as-of", help="work only this night's requests (ISO 8601); default: every valid request")
    run.add_argument("--worker-id", help="lease owner name (default: host:pid:random)")
    run.add_argument("--skip-preflight", action="store_true", help="start without running the preflight checks")
    run.set_defaults(handler=_run)

    status = batch_sub.add_parser("status", parents=[common], help="per night: pending/running/done/failed, leases")
    status.add_argument("--nights", type=int, default=7, help="how many recent nights to show (default: %(default)s)")
    status.set_defaults(handler=_status)

    report = sub.add_parser("report", parents=[common], help="what ran on a day: runs, theses, failures, speed")
    report.add_argument(
        "--date", type=_parse_day, help="local day (YYYY-MM-DD); default: the day of the latest plan/generate run"
    )
    report.add_argument("--json", action="store_true", help="machine-readable output")
    report.add_argument(
        "--html", type=Path, metavar="FILE", help="also write the morning as a self-contained HTML page with charts"
    )
    report.set_defaults(handler=_report)

    doctor = sub.add_parser("doctor", parents=[common], help="preflight: check everything the night needs")
    doctor.add_argument("--deep", action="store_true", help="also verify every weight file's sha256 (slow)")
    doctor.set_defaults(handler=_doctor)
