"""Fixtures for the offload-engine tests: the in-repo yalm-tiny fixture, its stores and the in-memory reference."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from robot_llm.llm.engine.memory import Yalm
from robot_llm.llm.families.yalm import YalmConfig
from robot_llm.llm.store.writer import convert

# Tiny models: more intra-op threads only add synchronisation cost on shared CI cores.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def reference(tiny_dir: Path, tiny_config: YalmConfig) -> Yalm:
    """The whole fixture model in memory, fp32: what the engines must reproduce."""
    return Yalm.from_release(str(tiny_dir / "weights"), tiny_config)


@pytest.fixture(scope="session")
def stores(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The fixture converted once per store dtype."""
    root = tmp_path_factory.mktemp("stores")
    return {
        dtype: convert(tiny_dir, root / dtype, dtype=dtype) and root / dtype
        for dtype in ("fp16", "bf16", "int8", "int4")
    }


@pytest.fixture
def weight_only(monkeypatch: pytest.MonkeyPatch):
    """int8 activations off for this test (``ROBOT_LLM_INT8_ACTIVATIONS=0``): the weight-only kernels' paths."""
    from robot_llm.llm.store.int8act import int8_activations_on_cpu

    monkeypatch.setenv("ROBOT_LLM_INT8_ACTIVATIONS", "0")
    int8_activations_on_cpu.cache_clear()
    yield
    monkeypatch.undo()
    int8_activations_on_cpu.cache_clear()


def _kernels_cached_in(root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    from robot_llm.llm.store import gemv, int8act

    # int8act's answers hold the kernels' bound methods: cleared with them, so that no later test compares a
    # method of this test's build with one of the build after it
    monkeypatch.setenv("XDG_CACHE_HOME", str(root))
    gemv.kernels.cache_clear()
    int8act._int8_kernels.cache_clear()
    yield root / "robot-llm" / "kernels"
    gemv.kernels.cache_clear()
    int8act._int8_kernels.cache_clear()


@pytest.fixture(scope="session")
def _kernel_builds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernel-builds")


@pytest.fixture
def kernel_cache(_kernel_builds: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Our compiled kernels' cache for this test, with a fresh :func:`~robot_llm.llm.store.gemv.kernels`: one
    folder for the session, so that each build (5-6 s of the compiler) is made once, not once a test."""
    yield from _kernels_cached_in(_kernel_builds, monkeypatch)


@pytest.fixture
def fresh_kernel_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty kernel cache, for the tests of what a build leaves in it."""
    yield from _kernels_cached_in(tmp_path, monkeypatch)
