"""Reading a config file's text: the YAML 1.2 loader, ``${VAR}`` interpolation, the line of every key for
error messages, and the parsers of the values a config writes as text (durations, sizes, clock times,
cron expressions, time zones).

PyYAML implements YAML 1.1, whose implicit typing bites trading configs: an unquoted
``22:30`` becomes the integer 1350 and a ticker ``ON`` or ``NO`` becomes a boolean. Our
loader is ``yaml.SafeLoader`` with those two resolvers narrowed to YAML 1.2 rules, so such
scalars stay the strings the user wrote and the validators of :mod:`robot_llm.config` judge them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from datetime import time, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import yaml

from robot_llm.errors import RobotLLMError


class ConfigError(RobotLLMError):
    """A configuration problem, already phrased as ``file:line: key.path: message``."""


# --------------------------------------------------------------------------- YAML loading


class Yaml12SafeLoader(yaml.SafeLoader):
    """SafeLoader whose booleans and integers follow YAML 1.2 (see module docstring).

    It also refuses a key given twice in one mapping: PyYAML would silently keep the last
    one, so a second ``model:`` section pasted further down would quietly win.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (it appears twice in this mapping)", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


Yaml12SafeLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Yaml12SafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
Yaml12SafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
# YAML 1.1 floats include sexagesimal forms such as 190:20:30.15; drop them too.
Yaml12SafeLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if not (tag == "tag:yaml.org,2002:float" and ":" in rx.pattern)]
    for first, resolvers in Yaml12SafeLoader.yaml_implicit_resolvers.items()
}
Yaml12SafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)


def line_index(node: yaml.Node, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], int]]:
    """Yield (key path, 1-based line) for every node of a composed YAML document."""
    yield path, node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value
            yield (*path, key), key_node.start_mark.line + 1
            for sub_path, line in line_index(value_node, (*path, key)):
                if sub_path != (*path, key):
                    yield sub_path, line
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from line_index(item, (*path, i))


_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def interpolate(value: Any, path: tuple[Any, ...], missing: list[tuple[tuple[Any, ...], str]]) -> Any:
    """Replace ``${VAR}`` / ``${VAR:-default}`` in every string; collect unset variables."""
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            if name in os.environ:
                return os.environ[name]
            if default is not None:
                return default
            missing.append((path, name))
            return m.group(0)

        return _ENV_RE.sub(sub, value)
    if isinstance(value, dict):
        return {k: interpolate(v, (*path, k), missing) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, (*path, i), missing) for i, v in enumerate(value)]
    return value


def format_path(path: tuple[Any, ...]) -> str:
    """Render a key path the way a user reads it: ``feeds[2].interval``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


# --------------------------------------------------------------------------- value parsers

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d|w)\s*$")
_DURATION_UNITS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(value: Any) -> timedelta:
    """Parse '90s', '15m', '2h', '1d', '1w' (or a number of seconds) into a timedelta."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like '15m', got {value!r}")
    if isinstance(value, int | float) and value >= 0:
        return timedelta(seconds=value)
    if isinstance(value, str):
        m = _DURATION_RE.match(value)
        if m:
            return timedelta(seconds=float(m.group(1)) * _DURATION_UNITS[m.group(2)])
    raise ValueError(f"expected a duration like '15m', got {value!r}")


def format_duration(value: timedelta) -> str:
    """A duration the way the config writes it: the largest unit that divides it ('15m', '1d', '90s')."""
    seconds = value.total_seconds()
    for unit in ("w", "d", "h", "m", "s"):
        count = seconds / _DURATION_UNITS[unit]
        if count == int(count) and count != 0:
            return f"{int(count)}{unit}"
    return f"{seconds:g}s"


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*$")
_SIZE_UNITS = {
    None: 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}


def parse_size(value: Any) -> int:
    """Parse '64GiB', '500MB' or a plain byte count into bytes."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like '64GiB', got {value!r}")
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])
    raise ValueError(f"expected a size like '64GiB', got {value!r}")


def parse_clock(value: Any) -> time:
    """Parse a local time like '08:30'."""
    if isinstance(value, time):
        return value
    if isinstance(value, str):
        m = re.match(r"^\s*([01]?\d|2[0-3]):([0-5]\d)\s*$", value)
        if m:
            return time(int(m.group(1)), int(m.group(2)))
    raise ValueError(f"expected a local time like '08:30', got {value!r}")


def validate_cron(value: Any) -> str:
    """A cron expression APScheduler accepts, unchanged."""
    if not isinstance(value, str):
        raise ValueError(f"expected a cron expression like '0 23 * * 0-4' (quote it), got {value!r}")
    from apscheduler.triggers.cron import CronTrigger  # light: no scheduler is started

    try:
        CronTrigger.from_crontab(value, timezone="UTC")
    except ValueError as exc:
        raise ValueError(f"invalid cron expression {value!r}: {exc}") from None
    return value


def validate_zone(value: Any) -> str:
    """An IANA time zone name, unchanged."""
    if not isinstance(value, str):
        raise ValueError(f"expected an IANA time zone like 'Europe/Moscow', got {value!r}")
    try:
        ZoneInfo(value)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {value!r} (use an IANA name like 'Europe/Moscow')") from None
    return value


class PathError(ValueError):
    """A cross-field error that knows the exact key path it belongs to."""

    def __init__(self, path: tuple[Any, ...], message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message


def located(source: str, lines: dict[tuple[Any, ...], int], path: tuple[Any, ...], message: str) -> str:
    """``source:line: key.path: message``, the line of ``path`` or of its nearest parent that has one."""
    probe = path
    while probe and probe not in lines:
        probe = probe[:-1]
    line = lines.get(probe, 1)
    return f"{source}:{line}: {format_path(path)}: {message}"


def validation_message(err: dict[str, Any]) -> str:
    """A pydantic error of one field as a config's reader says it."""
    kind, msg, value = err["type"], err["msg"], err.get("input")
    if kind == "extra_forbidden":
        return "unknown key (check the spelling; see config/robot-llm.example.yaml)"
    if kind == "missing":
        return "required key is missing"
    msg = re.sub(r"^(Value|Assertion) error, ", "", msg)
    if kind in (
        "string_type",
        "int_type",
        "float_type",
        "bool_type",
        "int_parsing",
        "float_parsing",
        "bool_parsing",
        "literal_error",
        "dict_type",
        "list_type",
        "tuple_type",
        "model_type",
    ):
        return f"{msg[0].lower()}{msg[1:]}, got {value!r}"
    return msg
