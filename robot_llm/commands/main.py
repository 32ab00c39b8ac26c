"""The ``robot-llm`` command line.

Each command group registers its own subcommands (``register(subparsers, common)`` in its
module of :mod:`robot_llm.commands`). This file only wires them together and turns errors
into one clear line and an exit code.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from robot_llm import __version__
from robot_llm.commands import batch, config, daemon, demo, forecasts, ingest, migrate, model, prompts
from robot_llm.commands.common import console_level
from robot_llm.errors import RobotLLMError, closed_pipe, missing_extra
from robot_llm.logs import setup_logging

log = logging.getLogger("robot_llm")

Handler = Callable[[argparse.Namespace], int]

# The command groups, in the order `robot-llm --help` lists them; each has ``register(subparsers, common)``.
# They are kept free of torch at import time: building the parser must stay fast.
COMMAND_MODULES = (config, migrate, prompts, forecasts, ingest, batch, daemon, model, demo)


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
    for module in COMMAND_MODULES:
        module.register(sub, common)
    return parser


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
