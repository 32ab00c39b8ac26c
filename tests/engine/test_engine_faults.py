"""Streaming engine under a failing disk: transient read errors are retried, a layer that stays
unreadable fails that forward pass with its file named, and the engine stays usable.

The fault injector wraps the engine's real read (:func:`robot_llm.llm.store.layout.read_into`): a disk
that fails on demand cannot exist here, so the test decides which read of which file fails.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from robot_llm.llm.engine import streaming as engine_module
from robot_llm.llm.engine.memory import Yalm
from robot_llm.llm.engine.stream_slots import LayerReadError
from robot_llm.llm.engine.streaming import READ_ATTEMPTS, StreamingModel
from robot_llm.llm.store.layout import StoreError


class FaultyReader:
    """``read_into`` with faults: ``plan(path, call_number) -> None | 'eio' | 'short' | 'stall'``."""

    def __init__(self, real: Callable[..., int], plan: Callable[[Path, int], str | None]) -> None:
        self.real = real
        self.plan = plan
        self.calls: dict[str, int] = {}
        self.faults = 0
        self.lock = threading.Lock()

    def __call__(self, path: Any, *args: Any, **kwargs: Any) -> int:
        with self.lock:
            n = self.calls[str(path)] = self.calls.get(str(path), 0) + 1
        fault = self.plan(Path(path), n)
        if fault is not None:
            self.faults += 1
        if fault == "eio":
            raise OSError(errno.EIO, "Input/output error", str(path))
        if fault == "short":
            raise StoreError(f"{path}: file is shorter than its header says")
        if fault == "stall":
            time.sleep(0.3)
        return self.real(path, *args, **kwargs)


def _inject(monkeypatch: pytest.MonkeyPatch, plan: Callable[[Path, int], str | None]) -> FaultyReader:
    reader = FaultyReader(engine_module.read_into, plan)
    monkeypatch.setattr(engine_module, "read_into", reader)
    monkeypatch.setattr(engine_module, "READ_BACKOFF_S", 0.001)
    return reader


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(5, 600, (2, 7), generator=torch.Generator().manual_seed(1)), torch.tensor([0, 3])


def _max_diff(model: StreamingModel, reference: Yalm) -> float:
    ids, pad = _ids()
    return float((model.forward(ids, None, pad) - reference.forward(ids, None, pad)).abs().max())


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("fault", ["eio", "short", "stall"])
def test_one_transient_fault_is_retried_and_the_logits_stay_exact(
    stores: dict[str, Path], reference: Yalm, monkeypatch: pytest.MonkeyPatch, prefetch: bool, fault: str
) -> None:
    model = StreamingModel(stores["fp16"], device="cpu", prefetch=prefetch)
    target = model.paths[1]
    reader = _inject(monkeypatch, lambda path, n: fault if path == target and n == 1 else None)
    try:
        assert _max_diff(model, reference) <= 1e-4
        assert reader.faults == 1
        assert model.stats.read_retries == (0 if fault == "stall" else 1)
        assert _max_diff(model, reference) <= 1e-4  # and the next pass is unaffected
    finally:
        model.close()


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("layer", [0, 1, -1])
def test_a_layer_that_stays_unreadable_fails_the_pass_naming_its_file_then_the_engine_recovers(
    stores: dict[str, Path], reference: Yalm, monkeypatch: pytest.MonkeyPatch, prefetch: bool, layer: int
) -> None:
    model = StreamingModel(stores["fp16"], device="cpu", prefetch=prefetch)
    target = model.paths[layer]
    broken = threading.Event()
    broken.set()
    _inject(monkeypatch, lambda path, n: "eio" if path == target and broken.is_set() else None)
    try:
        for _ in range(2):  # fails every time while the disk is broken, with the same clear error
            with pytest.raises(LayerReadError) as info:
                _max_diff(model, reference)
            assert str(target) in str(info.value) and f"failed {READ_ATTEMPTS} times" in str(info.value)
            assert "Input/output error" in str(info.value)
        broken.clear()  # the disk is back: the same engine serves the next batch exactly
        assert _max_diff(model, reference) <= 1e-4
        assert _max_diff(model, reference) <= 1e-4
    finally:
        model.close()


def test_generation_after_a_failed_batch_matches_a_fresh_engine(
    stores: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bug this guards: the failed prefetch future stayed in its slot and every later
    # forward re-raised it, so one bad read broke the engine for good.
    fresh = StreamingModel(stores["fp16"], device="cpu")
    ids, pad = _ids()
    expected = fresh.forward(ids, None, pad)
    fresh.close()
    model = StreamingModel(stores["fp16"], device="cpu")
    target = model.paths[2 % len(model.paths)]
    _inject(monkeypatch, lambda path, n: "eio" if path == target and n <= READ_ATTEMPTS else None)
    try:
        with pytest.raises(LayerReadError):
            model.forward(ids, None, pad)
        assert torch.equal(model.forward(ids, None, pad), expected)
    finally:
        model.close()


def test_the_next_layer_is_read_while_the_read_before_it_stalls(
    stores: dict[str, Path], reference: Yalm, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two reader threads: a slow read of one layer does not hold up the next layer's (so the disk's
    # queue does not drain at every file's end); the engine stays exact afterwards.
    model = StreamingModel(stores["fp16"], device="cpu", prefetch=True)
    first, second = model.paths[0], model.paths[1]
    release = threading.Event()
    finished: list[Path] = []
    real = engine_module.read_into

    def reader(path: Any, *args: Any, **kwargs: Any) -> int:
        if Path(path) == first:
            release.wait(30)
        offset = real(path, *args, **kwargs)
        finished.append(Path(path))
        return offset

    monkeypatch.setattr(engine_module, "read_into", reader)
    try:
        stalled, _ = model._request(0), model._request(1)
        deadline = time.monotonic() + 30
        while not finished and time.monotonic() < deadline:
            time.sleep(0.01)
        assert finished == [second]
        assert stalled.ready is not None and not stalled.ready.done()
        release.set()
        assert _max_diff(model, reference) <= 1e-4
        assert finished[:2] == [second, first]
    finally:
        release.set()
        model.close()


def test_the_logits_check_tells_an_overflowing_sum_from_a_non_finite_logit() -> None:
    from robot_llm.llm.engine.finite import NonFiniteError, check_logits

    big = torch.full((2, 8), 3e38)  # every logit finite, their sum not
    check_logits(big, object())
    check_logits(big.bfloat16(), object())
    for bad in (float("nan"), float("inf"), float("-inf")):
        logits = torch.zeros(2, 8)
        logits[1, 5] = bad
        with pytest.raises(NonFiniteError, match="non-finite logits"):
            check_logits(logits, object())
    opposite = torch.zeros(2, 8)
    opposite[0, 0], opposite[1, 1] = float("inf"), float("-inf")  # a sum of NaN, not of zero
    with pytest.raises(NonFiniteError):
        check_logits(opposite, object())
