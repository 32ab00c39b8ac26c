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


#: The model families each backend computes; None: every family of the registry
#: (:mod:`robot_llm.llm.families.registry`). The stream engine runs any family's forward; the memory
#: backend loads a YaLM release folder and DeepSpeed wraps YaLM's own layer modules.
SERVES: dict[str, tuple[str, ...] | None] = {"memory": ("yalm",), "stream": None, "deepspeed": ("yalm",)}


def refusal(backend: str, family: str) -> str | None:
    """Why ``backend`` cannot run a model of ``family`` (one line), or None when it can."""
    served = SERVES.get(backend)
    if served is None or family in served:
        return None
    others = [name for name, fams in SERVES.items() if fams is None or family in fams]
    runs = ", ".join(served)
    return f"the {backend} backend runs {runs} models only, not {family}: use backend {' or '.join(others)}"


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
