"""``robot-llm db upgrade|downgrade|current``: schema migrations from the shell (:mod:`robot_llm.store.migrate`)."""

from __future__ import annotations

import argparse
from typing import Any

from sqlalchemy.engine import Engine

from robot_llm.commands.common import load_app_config, open_database
from robot_llm.store.migrate import current, downgrade, head, upgrade


def _engine_for(args: argparse.Namespace) -> Engine:
    return open_database(load_app_config(args))


def _upgrade(args: argparse.Namespace) -> int:
    engine = _engine_for(args)
    try:
        before = current(engine)
        upgrade(engine, args.revision)
        after = current(engine)
    finally:
        engine.dispose()
    if before == after:
        print(f"database already at {after or 'base'}")
    else:
        print(f"upgraded {before or 'base'} -> {after}")
    return 0


def _downgrade(args: argparse.Namespace) -> int:
    engine = _engine_for(args)
    try:
        before = current(engine)
        downgrade(engine, args.revision)
        after = current(engine)
    finally:
        engine.dispose()
    print(f"downgraded {before or 'base'} -> {after or 'base'}")
    return 0


def _current(args: argparse.Namespace) -> int:
    engine = _engine_for(args)
    try:
        at = current(engine)
    finally:
        engine.dispose()
    want = head()
    state = "up to date" if at == want else f"out of date, head is {want}: run `robot-llm db upgrade -c {args.config}`"
    print(f"{at or 'none (never migrated)'} ({state})")
    return 0 if at == want else 1


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``db upgrade [REV]``, ``db downgrade REV`` and ``db current``."""
    db = sub.add_parser("db", help="database schema migrations")
    db_sub = db.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    up = db_sub.add_parser("upgrade", parents=[common], help="migrate the database to the newest schema")
    up.add_argument("revision", nargs="?", default="head", help="target revision (default: %(default)s)")
    up.set_defaults(handler=_upgrade)
    down = db_sub.add_parser("downgrade", parents=[common], help="migrate the database down to REV ('base': empty)")
    down.add_argument("revision", help="target revision, e.g. base or -1")
    down.set_defaults(handler=_downgrade)
    cur = db_sub.add_parser("current", parents=[common], help="show the database's schema revision")
    cur.set_defaults(handler=_current)
