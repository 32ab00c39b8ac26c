"""Non-finite activations: where a forward pass first went NaN or infinite, found without a sync per layer.

A damaged or NaN weight, or an fp16 overflow, turns a layer's output non-finite and everything
after it follows; the sampled token is then garbage (an argmax over NaN) and the thesis empty.
:class:`FiniteWatch` records, for each module of a pass, whether the last position of every row
is finite, as a 0-d device tensor (no host sync); only when the logits come out non-finite are
those flags read, to name the first module that produced a non-finite value.
"""

from __future__ import annotations

import torch
from torch import Tensor

from robot_llm.errors import ModelFault

__all__ = ["FiniteWatch", "NonFiniteError", "check_logits"]


class NonFiniteError(ModelFault):
    """The model produced NaN or infinite values: a fault of the weights (or the dtype), not of a prompt.

    ``where`` names the first module whose output was non-finite (``layer 5``, ``embedding``,
    ``output head``), or is None when the model cannot tell.
    """

    def __init__(self, message: str, where: str | None = None) -> None:
        super().__init__(message)
        self.where = where


class FiniteWatch:
    """Per-module finiteness flags of one forward pass (cheap: one reduction of ``[B, H]`` per module)."""

    def __init__(self) -> None:
        self._flags: list[tuple[str, Tensor]] = []

    def reset(self) -> None:
        """Start a new pass."""
        self._flags = []

    def note(self, where: str, x: Tensor) -> None:
        """Record whether the last position of every row of ``x [B, T, H]`` is finite after ``where``."""
        self._flags.append((where, torch.isfinite(x[:, -1]).all()))

    def first_bad(self) -> str | None:
        """The first module whose output was non-finite in this pass, if any (reads the flags: a sync)."""
        for where, ok in self._flags:
            if not bool(ok):
                return where
        return None


def check_logits(logits: Tensor, model: object) -> None:
    """Raise :class:`NonFiniteError` when ``logits`` hold a NaN or an infinity, naming where it started.

    ``model`` may offer ``first_nonfinite() -> str | None`` (the engines with a :class:`FiniteWatch`).
    """
    if bool(torch.isfinite(logits).all()):
        return
    finder = getattr(model, "first_nonfinite", None)
    where = finder() if callable(finder) else None
    place = f"first in the output of {where}" if where else "(this backend cannot tell where they started)"
    raise NonFiniteError(
        f"the model produced non-finite logits (NaN or inf), {place}: the weights are damaged or "
        "hold NaN, or the compute dtype overflows (run `robot-llm model verify` on the store; "
        "try model.dtype: fp32)",
        where,
    )
