"""int4 weight-only quantisation of the streamed matrices (FlexGen's group-wise asymmetric scheme).

A matrix is flattened in row-major order and cut into groups of ``group_size``
consecutive elements (the last group padded with the final value when the
group does not divide the element count, so any shape works, also YaLM's
27308-wide MLP). Each group keeps the minimum and step of the 16-level grid
:func:`int4_grid` picks for it as fp16, and every element the 4-bit code
``round((w - min) / step)`` clamped to 0..15; byte
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


#: Values :func:`int4_grid` works on at once: its temporaries stay in the CPU's cache (1 MiB each).
_GRID_CHUNK = 1 << 18
#: Grids :func:`int4_grid` tries besides min-max: steps of ``range / k`` centred on the group, so that
#: both tails are clipped (on Gemma 3 270M's matrices at group 64 they take the squared error from 0.86
#: of min-max's to 0.83).
_CLIP_LEVELS = (16.0, 17.0, 18.5)
#: Alternations of "nearest codes for the grid" and "least-squares grid for the codes" at the end.
_REFINE = 2


def int4_grid(groups: Tensor) -> tuple[Tensor, Tensor]:
    """The 16-level grid of each group of ``groups`` (float32 ``[G, g]``): ``(step, minimum)``, float32 ``[G]``.

    Code ``c`` stands for ``minimum + c * step`` (``c`` in 0..15). Min-max
    (``step = (max - min) / 15``) wastes levels on the tails and, worse, does
    not reproduce weights that are already on a 16-level grid but do not use
    both end codes (GGUF Q4_K sub-blocks: 21 % of Gemma 3 270M's Q4_K groups of
    32 use 15 levels; requantised min-max they get the error of a fresh
    quantisation). So, in the spirit of llama.cpp's ``make_qkx2_quants``, every
    group tries a few candidate grids, takes for each the codes nearest to it
    and fits the least-squares ``(step, minimum)`` to those codes, keeps the
    candidate with the smallest squared error, and alternates codes and fit
    :data:`_REFINE` times. Candidates: ``range / k`` for the ``k`` that three
    gaps between the group's values are multiples of (a group already on a
    16-level grid is then reproduced exactly, up to float rounding, and a
    matrix all on grids stops there); min-max; and :data:`_CLIP_LEVELS`,
    centred clipping grids. The fitted error of a candidate is never above
    that of its own start, and min-max is one start, so the grid's squared
    error (codes rounded to nearest) is never above min-max's.

    Measured on Gemma 3 270M's layer matrices (squared error relative to
    min-max): group 32: 0.79 on the Q5_0/Q8_0-sourced ones, 0.62 on
    ``ffn_down`` (half Q4_K, half Q6_K), 0 on ``attn_output`` (Q4_K); group
    64: 0.83-0.85, 0.78 and 0.69. Speed: 17-25 M values per CPU-second on
    one thread (min-max: ~500 M), i.e. about a minute of CPU per YaLM-100B layer.

    Every step is a handful of vectorised passes over the group, in chunks of
    :data:`_GRID_CHUNK` values (a YaLM-100B layer is ~10^9 weights); the
    squared errors come in closed form from the sums the fit needs. The
    caller rounds the grid to what it stores (and picks codes for that).
    """
    import torch

    size = groups.shape[1]
    chunk = max(1, _GRID_CHUNK // size)
    if groups.shape[0] > chunk:
        parts = [int4_grid(groups[i : i + chunk]) for i in range(0, groups.shape[0], chunk)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    x = groups.float()
    lo, hi = x.amin(dim=1), x.amax(dim=1)
    mean = x.mean(dim=1)
    centred = x - mean[:, None]  # sums of centred values keep the closed-form errors accurate
    sxx = torch.linalg.vecdot(centred, centred)
    spread = hi - lo
    # A flat group has no spread: any step fits it; keep the products below float overflow.
    safe = spread.clamp_min(1e-20)

    def fit(inv: Tensor, start: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Nearest codes of the grid ``(1 / inv, start)``; their least-squares ``(step, centred min, error)``."""
        codes = torch.addcmul((-start * inv)[:, None], x, inv[:, None]).round_().clamp_(0, _LEVELS)
        sq = codes.sum(dim=1)
        det = size * torch.linalg.vecdot(codes, codes) - sq * sq
        sqx = torch.linalg.vecdot(codes, centred)
        ok = det > 0  # 0: every code equal, the group's mean is the best such grid can do
        det = torch.where(ok, det, 1)
        step = torch.where(ok, size * sqx / det, 0)
        return step, -step * sq / size, torch.where(ok, sxx - size * sqx * sqx / det, sxx)

    # On a grid of k + 1 levels spanning the group, every gap between two of its values is a multiple
    # of range / k. The smallest of three gaps (above the minimum, below the maximum, across the
    # middle) is j = 1, 2 or 3 such steps unless all three skip levels: k = j range / gap for the j
    # whose k all three gaps fit. More than one j may fit (all gaps even multiples), so each is tried.
    mid = ((lo + hi) / 2)[:, None]
    gaps = torch.stack(
        [
            torch.where(x > (lo + spread / 32)[:, None], x, hi[:, None]).amin(dim=1) - lo,
            hi - torch.where(x < (hi - spread / 32)[:, None], x, lo[:, None]).amax(dim=1),
            torch.where(x > mid, x, hi[:, None]).amin(dim=1) - torch.where(x <= mid, x, lo[:, None]).amax(dim=1),
        ],
        dim=1,
    )
    per_gap = spread / gaps.amin(dim=1).clamp_min(1e-20)
    levels = (per_gap[:, None] * torch.tensor([1.0, 2.0, 3.0], device=x.device)).round()
    multiples = levels[:, :, None] * gaps[:, None, :] / safe[:, None, None]  # [G, j, gap]
    fits = ((multiples - multiples.round()).abs() < 1e-3).all(dim=2) & (levels >= 1) & (levels <= _LEVELS)
    # Exact candidates first, the coarsest first: on a tie (a group on two levels fits min-max's grid
    # too) the coarser step is kept, which survives storage (fp16 flushes steps below 2^-14).
    starts = [(torch.where(fits[:, j], levels[:, j], _LEVELS) / safe, lo) for j in range(3) if fits[:, j].any()]
    exact = len(starts)
    starts.append((_LEVELS / safe, lo))  # min-max
    for k in _CLIP_LEVELS:
        starts.append((k / safe, lo + (k - _LEVELS) / (2 * k) * spread))
    best = fit(*starts[0])
    # A candidate replaces the best only when clearly better than float rounding of the closed-form errors.
    for i in range(1, len(starts) + _REFINE):  # then refine the best so far
        if i == exact and exact and bool((best[2] <= 1e-6 * sxx).all()):
            break  # every group is on its grid (a Q4_K matrix at group 32)
        if i < len(starts):
            inv, start = starts[i]
        else:
            inv, start = torch.where(best[0] > 0, 1 / best[0], _LEVELS / safe), best[1] + mean
        tried = fit(inv, start)
        better = tried[2] < best[2] - 1e-6 * sxx
        best = tuple(torch.where(better, new, old) for new, old in zip(tried, best, strict=True))
    # A flat group fits with step 0 (every code equal): it is stored as its mean, code 0.
    return torch.where(best[0] > 0, best[0], _MIN_STEP), best[1] + mean


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
    step, minimum = int4_grid(w)
    # Round the group's parameters to fp16 first, so the codes are chosen for the values stored.
    minimum = minimum.half()
    step = step.clamp_min(_MIN_STEP).half()
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
