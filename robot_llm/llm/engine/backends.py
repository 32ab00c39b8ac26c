"""Registry of model backends: how the CLI turns ``--engine NAME`` into a :class:`ForwardModel`.

A backend is a factory ``create(request: ModelRequest) -> ForwardModel`` named
by a ``"module:function"`` string, imported only when chosen (this package
does not import torch). ``memory`` holds the whole model in RAM/VRAM
(:mod:`robot_llm.llm.engine.memory`); ``stream`` and ``deepspeed`` are the
offloading engines, provided by the modules named below.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from robot_llm.llm.engine.request import BackendError, ModelRequest

if TYPE_CHECKING:
    from robot_llm.llm.families.family import ForwardModel


BackendFactory = Callable[[ModelRequest], "ForwardModel"]

BACKENDS: dict[str, str] = {
    "memory": "robot_llm.llm.engine.memory:create",
    "stream": "robot_llm.llm.engine.stream:create",
    "deepspeed": "robot_llm.llm.engine.deepspeed:create",
}


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
