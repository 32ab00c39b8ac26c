"""Non-finite activations: where a forward pass first went NaN or infinite, found without a sync per layer.

A damaged or NaN weight, or an fp16 overflow, turns a layer's output non-finite and everything
after it follows; the sampled token is then garbage (an argmax over NaN) and the thesis empty.
:class:`FiniteWatch` keeps, for each module of a pass, a copy of the last position of every row (no
host sync, one small copy: a finiteness test per module was five ops, a tenth of a decode step's kernels
at batch 1); only when the logits come out non-finite are they tested, to name the first module that
produced a non-finite value.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from robot_llm.errors import ModelFault

__all__ = ["FiniteWatch", "NonFiniteError", "check_logits", "check_rows"]


class NonFiniteError(ModelFault):
    """The model produced NaN or infinite values: a fault of the weights (or the dtype), not of a prompt.

    ``where`` names the first module whose output was non-finite (``layer 5``, ``embedding``,
    ``output head``), or is None when the model cannot tell.
    """

    def __init__(self, message: str, where: str | None = None) -> None:
        super().__init__(message)
        self.where = where


class FiniteWatch:
    """Per-module last positions of one forward pass (cheap: one ``[B, H]`` copy per module)."""

    def __init__(self) -> None:
        self._rows: list[tuple[str, Tensor]] = []

    def reset(self) -> None:
        """Start a new pass."""
        self._rows = []

    def note(self, where: str, x: Tensor) -> None:
        """Keep the last position of every row of ``x [B, T, H]`` after ``where`` (a copy: a micro-batched pass
        writes the next layer's output into the same tensor)."""
        self._rows.append((where, x[:, -1].clone()))

    def first_bad(self) -> str | None:
        """The first module whose output was non-finite in this pass, if any (tests the copies: a sync)."""
        for where, rows in self._rows:
            if not bool(torch.isfinite(rows).all()):
                return where
        return None


def check_logits(logits: Tensor, model: object) -> None:
    """Raise :class:`NonFiniteError` when ``logits`` hold a NaN or an infinity, naming where it started.

    ``model`` may offer ``first_nonfinite() -> str | None`` (the engines with a :class:`FiniteWatch`).
    """
    # A sum is finite exactly when every logit is (inf - inf is NaN), but for finite logits whose sum overflows,
    # which the exact test then clears: 0.7 against 18 ms for a batch-16 step's 262k-token logits.
    if bool(torch.isfinite(logits.sum())) or bool(torch.isfinite(logits).all()):
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


def check_rows(logits: Tensor, rows: Sequence[int], model: object) -> None:
    """:func:`check_logits` of the rows ``rows`` of ``logits [B, V]``: one sum a row over the whole batch in one op,
    the exact test only where a row's sum is not finite (a batch-32 step made two ops a row)."""
    finite = torch.isfinite(logits.sum(-1)).tolist()
    for b in rows:
        if not finite[b]:
            check_logits(logits[b], model)
