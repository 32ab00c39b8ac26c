"""``robot-llm config check``: validate a config and show what is in effect."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml


def _check(args: argparse.Namespace) -> int:
    from robot_llm.commands.common import load_app_config
    from robot_llm.config import ConfigError, effective_config
    from robot_llm.night.model import backend_refusal

    config = load_app_config(args)
    reason = backend_refusal(config)
    if reason is not None:
        raise ConfigError(_at_backend_line(config.source, reason.removeprefix("model.backend: ")))
    data = effective_config(config)
    if args.json:
        print(json.dumps(data, ensure_ascii=False, indent=2))
    else:
        print(f"# {config.source}: OK")
        print(yaml.safe_dump(data, allow_unicode=True, sort_keys=False), end="")
    return 0


def _at_backend_line(source: Any, reason: str) -> str:
    """``FILE:LINE: model.backend: reason``, the line where the file sets the backend (the file's name alone
    for a config that did not come from a file)."""
    from robot_llm.config_parsing import Yaml12SafeLoader, format_path, line_index, located

    path = ("model", "backend")
    try:
        node = yaml.compose(Path(source).read_text(encoding="utf-8"), Loader=Yaml12SafeLoader)
    except (OSError, TypeError, yaml.YAMLError):
        return f"{source}: {format_path(path)}: {reason}"
    return located(str(source), dict(line_index(node)) if node is not None else {}, path, reason)


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``config check``."""
    config = sub.add_parser("config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = config_sub.add_parser("check", parents=[common], help="validate the config and print it (secrets masked)")
    check.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    check.set_defaults(handler=_check)
