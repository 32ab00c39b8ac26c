"""What every command group shares: loading the config named by ``-c``, opening the database."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from robot_llm.logs import add_log_file, setup_logging

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from robot_llm.config import AppConfig

log = logging.getLogger(__name__)


def load_app_config(args: argparse.Namespace) -> AppConfig:
    """Load and validate the config named by ``-c`` (or, with ``--config-stdin``, the snapshot on stdin).

    Applies its ``logging`` section. The terminal keeps the command line's verbosity (a
    command's output is its answer; -v adds log lines); the config's zone dates every line;
    ``logging.file``, when set, receives every command's log lines at the config's level and format.
    """
    from robot_llm.config import config_from_snapshot, load_config

    if getattr(args, "config_stdin", False):
        config = config_from_snapshot(sys.stdin.read(), f"{args.config} (the snapshot on stdin)")
    else:
        config = load_config(args.config)
    setup_logging(console_level(args), getattr(args, "log_format", "text"), tz=config.tz)
    if config.logging.file is not None:
        level = "DEBUG" if (getattr(args, "verbose", 0) or 0) >= 2 else config.logging.level
        add_log_file(level, config.logging.format, config.logging.file, tz=config.tz)
    if getattr(args, "config_stdin", False):
        log.info(
            "config: the daemon's configuration of %s, by value on stdin (the file itself is not read)", args.config
        )
    return config


def console_level(args: argparse.Namespace) -> int:
    """The terminal's log level for the ``-v`` count on the command line."""
    verbosity = getattr(args, "verbose", 0) or 0
    return logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG


def open_database(config: AppConfig) -> Engine:
    """An engine for the configured database, checked to be reachable."""
    from robot_llm.store.db import check_connection, make_engine

    engine = make_engine(config.database.url, echo=config.database.echo)
    check_connection(engine)
    return engine
