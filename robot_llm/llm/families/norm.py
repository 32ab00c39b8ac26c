"""The RMSNorm of the Hugging Face families (Gemma 3, Llama, Qwen 3), with the rotary or the residual add that
follows it in a layer, in one call: our kernel (``norm.c``) on the CPU where it is built, torch's ops elsewhere.

A Gemma 3 270M decode step runs some 110 norms and 36 rotaries; as torch ops each is a chain of 5-7 us calls
(about 40 us a norm at batch 1), which a core spends whatever the thread count.
"""

from __future__ import annotations

import torch
from torch import Tensor

from robot_llm.llm.families.family import apply_rotary
from robot_llm.llm.store.gemv import kernels, plain_rows


def rms_norm(
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    *,
    offset: float = 0.0,
    gain_rounded: bool = False,
    rotary: tuple[Tensor, Tensor] | None = None,
    residual: Tensor | None = None,
) -> Tensor:
    """The RMSNorm of the Hugging Face families over ``x [..., n]``, with what follows it in a layer: the
    statistics in float32, then either the gain ``offset + weight`` in float32 and one cast back (Gemma 3:
    offset 1) or, with ``gain_rounded``, the cast back first and ``weight`` applied in x's dtype (Llama);
    ``weight`` None: no norm. Then :func:`apply_rotary` with ``rotary`` (``(cos, sin)``, ``x [B, T, heads,
    n]``), then ``residual + y``. On the CPU our kernel (``norm.c``, where built) runs all of it in one call,
    as torch's ops round it; a chain of 5-7 us ops otherwise (some 40 us a norm at a decode step's sizes)."""
    if _norm_kernel_serves(x, weight, gain_rounded, rotary, residual):
        lib = kernels()
        assert lib is not None
        return lib.rms_norm(x, weight, eps, offset=offset, gain_rounded=gain_rounded, rotary=rotary, residual=residual)
    y = x
    if weight is not None and gain_rounded:
        y = weight * torch.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)
    elif weight is not None:
        y = torch.rms_norm(x.float(), x.shape[-1:], offset + weight.float(), eps).type_as(x)
    if rotary is not None:
        y = apply_rotary(y, *rotary)
    return y if residual is None else residual + y


def _norm_kernel_serves(
    x: Tensor, weight: Tensor | None, gain_rounded: bool, rotary: tuple[Tensor, Tensor] | None, residual: Tensor | None
) -> bool:
    """Whether :func:`rms_norm`'s operands are what ``norm.c`` reads: contiguous CPU tensors, x fp32 or bf16,
    the tables and the residual in x's dtype and layout (and the weight too, where it is applied in that dtype).
    Asked some 110 times a decode step, so in the cheapest of torch's attributes (``is_cpu``, not ``device.type``:
    the whole check took 4-10 us a norm against the kernel's 2.4 at batch 1)."""
    if not plain_rows(x):
        return False
    dtype = x.dtype
    if weight is not None and not gain_serves(weight, x.shape[-1], dtype, gain_rounded):
        return False
    if rotary is not None:
        if x.dim() < 2:
            return False
        shape = (*x.shape[:-2], 1, x.shape[-1])
        for t in rotary:
            if not (t.dtype is dtype and t.is_cpu and t.is_contiguous() and t.shape == shape):
                return False
    if residual is not None and not (
        residual.dtype is dtype and residual.is_cpu and residual.is_contiguous() and residual.shape == x.shape
    ):
        return False
    return kernels() is not None


def gain_serves(weight: Tensor, n: int, dtype: torch.dtype, gain_rounded: bool) -> bool:
    """Whether ``norm.c`` reads ``weight`` as the gain of rows of ``n`` values in ``dtype``: contiguous, on the CPU,
    ``n`` values, in that dtype where it is applied in it (``gain_rounded``), else a float dtype."""
    dtypes = (dtype,) if gain_rounded else _GAIN_DTYPES
    return weight.is_cpu and weight.is_contiguous() and weight.numel() == n and weight.dtype in dtypes


#: The dtypes of a gain ``norm.c`` applies in float32 (not rounded to x's dtype first).
_GAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
