"""int4 weight-only quantisation of the streamed matrices (FlexGen's group-wise asymmetric scheme).

A matrix is flattened in row-major order and cut into groups of ``group_size``
consecutive elements (the last group padded with the final value when the
group does not divide the element count, so any shape works, also YaLM's
27308-wide MLP). Each group keeps its minimum and its step ``(max - min) / 15``
as fp16, and every element the 4-bit code ``round((w - min) / step)``; byte
``j`` of a group holds element ``j`` in its low nibble and element
``j + group/2`` in its high one, so unpacking writes two contiguous halves. That is 4.5 bits per
weight at group 64: a YaLM-100B layer shrinks from 2.52 GB (fp16) to 0.71 GB.

:func:`dequantize_int4_into` writes the weights back into a preallocated
float buffer with in-place arithmetic only (no temporaries the size of the
layer), on the CPU or the GPU. The size arithmetic needs no torch (the
planner uses it); torch is imported by the functions that touch tensors.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

#: Largest group the issue allows; more groups cost 32 bits each, fewer bits of accuracy.
MAX_GROUP = 128
_LEVELS = 15
#: Smallest normal fp16: a flat group (max == min) still gets a usable, non-zero step.
_MIN_STEP = 2.0**-14


#: KV cache dtypes stored compressed (:mod:`robot_llm.llm.kvquant`): int8 symmetric with an fp16
#: scale per head and slot; int4 asymmetric with an fp16 step and minimum per head and slot.
KV_QUANTIZED = ("int8", "int4")
_KV_BITS = {"int8": (8, 16), "int4": (4, 32)}


def kv_bits_per_value(kv_dtype: str, head_dim: int) -> float:
    """Stored bits per K or V value of a compressed KV cache (``int8``/``int4``; scales included)."""
    code, scales = _KV_BITS[kv_dtype]
    return code + scales / head_dim


def int4_groups(numel: int, group_size: int) -> int:
    """Number of groups of a matrix with ``numel`` elements."""
    return math.ceil(numel / group_size)


def check_group_size(group_size: int) -> None:
    """int4 groups must be even (two codes per byte) and at most :data:`MAX_GROUP`."""
    if group_size < 2 or group_size > MAX_GROUP or group_size % 2:
        raise ValueError(f"int4 group size must be an even number in 2..{MAX_GROUP}, got {group_size}")


def int4_bytes(numel: int, group_size: int) -> int:
    """Stored bytes of an int4 matrix: packed codes plus an fp16 step and minimum per group."""
    groups = int4_groups(numel, group_size)
    return groups * group_size // 2 + 4 * groups


def quantize_int4(weight: Tensor, group_size: int = 64) -> tuple[Tensor, Tensor, Tensor]:
    """Quantise ``weight`` (any shape): ``(codes uint8 [G, group/2], step fp16 [G], minimum fp16 [G])``."""
    import torch

    check_group_size(group_size)
    flat = weight.detach().float().reshape(-1)
    groups = int4_groups(flat.numel(), group_size)
    pad = groups * group_size - flat.numel()
    if pad:
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    w = flat.view(groups, group_size)
    lo, hi = w.amin(dim=1), w.amax(dim=1)
    # Round the group's parameters to fp16 first, so the codes are chosen for the values stored.
    minimum = lo.half()
    step = ((hi - minimum.float()) / _LEVELS).clamp_min(_MIN_STEP).half()
    codes = torch.round((w - minimum.float()[:, None]) / step.float()[:, None]).clamp_(0, _LEVELS).to(torch.uint8)
    half = group_size // 2
    packed = codes[:, :half] | (codes[:, half:] << 4)
    return packed.contiguous(), step, minimum


def dequantize_int4_into(codes: Tensor, step: Tensor, minimum: Tensor, out: Tensor) -> Tensor:
    """Write the weights of ``(codes, step, minimum)`` into the preallocated float ``out`` and return it.

    Unpacking uses float arithmetic that is exact in every float dtype
    (bytes are below 256): ``hi = floor(byte / 16)``, ``lo = byte - 16 hi``.
    The per-group step and minimum are cast to ``out``'s dtype first (a
    mixed-dtype broadcast is several times slower); only they and the padded
    last group, if any, need temporaries.
    """
    import torch

    groups, half = codes.shape
    group_size = 2 * half
    flat = out.view(-1)
    full = min(groups, flat.numel() // group_size)
    scale, low = step.to(out.dtype)[:, None], minimum.to(out.dtype)[:, None]
    if full:
        values = flat[: full * group_size].view(full, group_size)
        lo, hi = values[:, :half], values[:, half:]
        hi.copy_(codes[:full]).div_(16).floor_()
        lo.copy_(codes[:full]).add_(hi, alpha=-16)
        values.mul_(scale[:full]).add_(low[:full])
    if full < groups:  # the padded tail group
        byte = codes[full].to(out.dtype)
        high = torch.floor(byte / 16)
        tail = torch.cat([byte - 16 * high, high]) * scale[full] + low[full]
        flat[full * group_size :].copy_(tail[: flat.numel() - full * group_size])
    return out
