"""``robot-llm demo``: a whole night on bundled data (:mod:`robot_llm.demo`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from robot_llm.demo import demo_command


def _demo(args: argparse.Namespace) -> int:
    return demo_command(args.workdir, clean=args.clean)


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``robot-llm demo``."""
    demo = sub.add_parser("demo", help="run a whole night on bundled data with a tiny random model")
    demo.add_argument(
        "--workdir", type=Path, default=Path("robot-llm-demo"), help="working folder (default: %(default)s)"
    )
    demo.add_argument("--clean", action="store_true", help="start from an empty working folder")
    demo.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    demo.set_defaults(handler=_demo)
