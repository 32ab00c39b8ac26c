"""Registry of model backends: how the CLI turns ``--engine NAME`` into a :class:`ForwardModel`.

A backend is a factory ``create(request: ModelRequest) -> ForwardModel`` named
by a ``"module:function"`` string, imported only when chosen (this package
does not import torch). ``memory`` holds the whole model in RAM/VRAM
(:mod:`robot_llm.llm.engine.memory`); ``stream`` and ``deepspeed`` are the
offloading engines, provided by the modules named below. Other code may add
entries with :func:`register_backend`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from robot_llm.errors import RobotLLMError
from robot_llm.llm.families.config import YalmConfig

if TYPE_CHECKING:
    from robot_llm.llm.families.family import ForwardModel


@dataclass(frozen=True)
class ModelRequest:
    """What the user asked for on the command line.

    ``checkpoint`` is a release folder (or anything the backend understands,
    e.g. a weight store); ``dtype`` is ``fp32``/``bf16``/``fp16``; ``device`` a
    torch device string; ``home`` (``disk``/``ram``) and ``offload``
    (``cpu``/``nvme``) only mean something to the offloading engines and are
    None when not given.
    """

    checkpoint: Path
    config: YalmConfig
    dtype: str = "fp32"
    device: str = "cpu"
    home: str | None = None
    offload: str | None = None
    trust_pickle: bool = False


BackendFactory = Callable[[ModelRequest], "ForwardModel"]

BACKENDS: dict[str, str] = {
    "memory": "robot_llm.llm.engine.memory:create",
    "stream": "robot_llm.llm.engine.stream:create",
    "deepspeed": "robot_llm.llm.engine.deepspeed:create",
}


class BackendError(RobotLLMError):
    """The chosen backend does not exist or cannot serve the request."""


def register_backend(name: str, target: str) -> None:
    """Add or replace backend ``name``; ``target`` is ``"package.module:function"``."""
    if ":" not in target:
        raise ValueError(f"backend target must look like 'module:function', got {target!r}")
    BACKENDS[name] = target


def get_backend(name: str) -> BackendFactory:
    """Import and return the factory of backend ``name``."""
    try:
        target = BACKENDS[name]
    except KeyError:
        raise BackendError(f"unknown engine {name!r}; known: {', '.join(BACKENDS)}") from None
    module_name, _, func = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise BackendError(f"engine {name!r} is not available in this installation ({module_name})") from exc
        raise
    factory: BackendFactory = getattr(module, func)
    return factory


def create_model(name: str, request: ModelRequest) -> ForwardModel:
    """Build the model of backend ``name`` for ``request``."""
    return get_backend(name)(request)
