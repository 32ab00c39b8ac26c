"""The reference libraries the fidelity tests compare against (transformers, gguf): skipped without them
on a developer's machine, a failure under ``CI=true``, where a skip would pass the check unrun."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require(name: str) -> ModuleType:
    """Import ``name`` for a test module; missing, it skips the module, or fails it in CI."""
    if os.environ.get("CI") == "true":
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            pytest.fail(f"{name} is required in CI (pip install -e '.[dev]'): {exc}", pytrace=False)
    return pytest.importorskip(name)
