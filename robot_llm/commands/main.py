"""The ``robot-llm`` command line.

Each pipeline stage registers its own subcommands (``register(subparsers, common)`` in
its module), so a change to one stage's CLI is made next to that stage. This file only
wires them together and turns errors into one clear line and an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from robot_llm import __version__
from robot_llm.errors import RobotLLMError, closed_pipe, missing_extra
from robot_llm.logs import add_log_file, setup_logging

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from robot_llm.config import AppConfig

log = logging.getLogger("robot_llm")

Handler = Callable[[argparse.Namespace], int]

# Modules that contribute subcommands; each has ``register(subparsers, common)``.
# Imported lazily (only when the parser is built) and kept free of torch at import time.
COMMAND_MODULES: tuple[str, ...] = (
    "robot_llm.commands.config",
    "robot_llm.store.migrate",
    "robot_llm.commands.prompts",
    "robot_llm.commands.forecasts",
    "robot_llm.commands.track_record",
    "robot_llm.commands.ingest",
    "robot_llm.commands.batch",
    "robot_llm.commands.daemon",
    "robot_llm.commands.model",
    "robot_llm.demo",
)


def common_parser() -> argparse.ArgumentParser:
    """Options every subcommand takes: ``-c/--config``, ``-v`` and ``--log-format``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-c", "--config", default="robot-llm.yaml", help="the YAML config file (default: %(default)s)")
    # SUPPRESS: a subcommand's own defaults would otherwise overwrite `robot-llm -vv COMMAND`.
    common.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS,
        help="more log output (-v info, -vv debug); -vv also shows tracebacks",
    )
    common.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=argparse.SUPPRESS,
        help="log lines as text (default) or one JSON object per line",
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    """The full parser with every stage's subcommands."""
    parser = argparse.ArgumentParser(
        prog="robot-llm",
        description="Overnight LLM theses for a trading robot: ingest news and signals, generate, read.",
    )
    parser.add_argument("--version", action="version", version=f"robot-llm {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output; -vv shows tracebacks")
    parser.add_argument("--log-format", choices=("text", "json"), default="text", help="log lines as text or JSON")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = common_parser()
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub, common)
    return parser


def load_app_config(args: argparse.Namespace) -> AppConfig:
    """Load and validate the config named by ``-c`` (or, with ``--config-stdin``, the snapshot on stdin).

    Applies its ``logging`` section.
    The terminal keeps the command line's verbosity (a command's output is its answer; -v
    adds log lines); the config's zone dates every line; ``logging.file``, when set, receives
    every command's log lines at the config's level and format.
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
    """The terminal's log level for the command line's ``-v`` count: warnings, -v info, -vv debug."""
    verbosity = getattr(args, "verbose", 0) or 0
    return logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG


def open_database(config: AppConfig) -> Engine:
    """An engine for the configured database, checked to be reachable."""
    from robot_llm.store.db import check_connection, make_engine

    engine = make_engine(config.database.url, echo=config.database.echo)
    check_connection(engine)
    return engine


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``robot-llm`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    verbosity = getattr(args, "verbose", 0) or 0
    setup_logging(console_level(args), getattr(args, "log_format", "text"))
    try:
        code = int(args.handler(args) or 0)
        sys.stdout.flush()  # here, not at exit: a reader gone by now is a BrokenPipeError we can still catch
        return code
    except BrokenPipeError:
        return closed_pipe()
    except RobotLLMError as exc:
        if verbosity >= 2:
            log.exception("failed")
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: say so in one line unless asked for the traceback
        if verbosity >= 2:
            raise
        extra = missing_extra(exc)
        if extra is not None:  # not a bug: an optional part is not installed
            print(f"error: {extra}", file=sys.stderr)
            return 1
        print(f"error: {type(exc).__name__}: {exc} (run with -vv for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
