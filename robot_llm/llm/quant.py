"""Weight-only int4 and int8 of the streamed matrices, stored in the layout of torch's fused CPU kernels.

**int4** (group-wise asymmetric, as gpt-fast/torchao): each row of a ``[N, K]``
matrix is cut into groups of ``group_size`` consecutive input columns; a group
keeps a bf16 ``scale`` and ``zero`` and every weight a 4-bit code ``q`` with
``w = (q - 8) * scale + zero`` (``zero`` is the value code 8 stands for:
``minimum + 8 * step``). Which ``(step, minimum)`` a group gets is decided by
:func:`int4_grid` alone. The stored bytes are exactly what
``torch._weight_int4pack_mm_for_cpu`` reads, so the reader reads straight into
the kernel's operands and the CPU never dequantises at batch 1:

* codes ``uint8 [Np, Kp / 2]``: rows in blocks of 64; within a block, for each
  input column ``k``, 32 bytes, byte ``j`` holding row ``j`` in its low nibble
  and row ``j + 32`` in its high one (i.e. ``[Np / 64, Kp, 32]``);
* ``scales_and_zeros`` ``bf16 [Kp / group, Np, 2]``.

``Np`` is ``N`` rounded up to 64 (padded rows are zero and sliced off the
output); ``Kp`` is ``K`` rounded up to the group (padded columns repeat the
row's last weight and meet zeros in the padded input), so any shape works,
also YaLM's 27308-wide MLP. At group 32 that is 5 bits per weight.

**int8** is symmetric per output channel: ``int8 [N, Kp]`` (``K`` zero-padded
to a multiple of 64) and one bf16 scale per row, what ``torch._weight_int8pack_mm`` reads.

:func:`int4_linear`/:func:`int8_linear` run the fused kernels (bf16 activations:
with fp32 ones they are 30-100x slower). :func:`dequantize_int4_into` and
:func:`dequantize_int8_into` write the weights into a preallocated float buffer
with plain torch ops (any device: the CUDA path and fp32 compute use them).
The size arithmetic needs no torch (the planner uses it); torch is imported by
the functions that touch tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import Tensor

#: Group sizes the fused int4 CPU kernel accepts (it also takes 256; the issue caps groups at 128).
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP = 32
#: Rows per block of the int4 kernel's layout (the stored row count is padded to it).
INT4_BLOCK = 64
_LEVELS = 15
_ZERO_CODE = 8
#: Smallest normal fp16: a flat group (max == min) still gets a usable, non-zero step.
_MIN_STEP = 2.0**-14
#: Values dequantized per pass: the temporaries of a pass stay in the cache.
_PASS_VALUES = 1 << 22
#: Rows of a call above which a quantized matrix is dequantized once and multiplied densely: the fused
#: kernels' cost grows with every row (int4: 0.9 ms for an 8192x2048 matrix at 1 row, 13 ms at 32) while a
#: bf16 GEMM after dequantising barely does (measured here, 1 thread; see the planner).
FUSED_MAX_ROWS = 48
#: The int8 kernel reads garbage (or crashes) when K is not a multiple of 16 (measured: 168, 184, 27308),
#: and crashes on weights not 16-byte aligned: stored int8 rows are zero-padded to a multiple of 64, and the
#: store places every quantized matrix at a multiple of :data:`ALIGN` bytes.
INT8_K_MULTIPLE = 64
#: Alignment of quantized matrices in memory (bytes) that the fused kernels are given.
ALIGN = 64


#: KV cache dtypes stored compressed (:mod:`robot_llm.llm.kvquant`): int8 symmetric with an fp16
#: scale per head and slot; int4 asymmetric with an fp16 step and minimum per head and slot.
KV_QUANTIZED = ("int8", "int4")
_KV_BITS = {"int8": (8, 16), "int4": (4, 32)}


def kv_bits_per_value(kv_dtype: str, head_dim: int) -> float:
    """Stored bits per K or V value of a compressed KV cache (``int8``/``int4``; scales included)."""
    code, scales = _KV_BITS[kv_dtype]
    return code + scales / head_dim


def check_group_size(group_size: int) -> None:
    """int4 groups must be one the fused kernel takes: 32, 64 or 128."""
    if group_size not in INT4_GROUP_SIZES:
        sizes = ", ".join(map(str, INT4_GROUP_SIZES))
        raise ValueError(f"int4 group size must be one of {sizes} (the fused CPU kernel's), got {group_size}")


def int4_padded_shape(shape: tuple[int, int], group_size: int) -> tuple[int, int]:
    """``(Np, Kp)``: rows rounded up to :data:`INT4_BLOCK`, columns to the group."""
    n, k = shape
    return math.ceil(n / INT4_BLOCK) * INT4_BLOCK, math.ceil(k / group_size) * group_size


def int4_bytes(shape: tuple[int, int], group_size: int) -> int:
    """Stored bytes of an int4 ``[N, K]`` matrix: packed codes plus a bf16 scale and zero per group."""
    n, k = int4_padded_shape(shape, group_size)
    return n * k // 2 + 4 * n * (k // group_size)


def int8_padded_width(k: int) -> int:
    """Stored columns of an int8 matrix: ``K`` rounded up to :data:`INT8_K_MULTIPLE`."""
    return math.ceil(k / INT8_K_MULTIPLE) * INT8_K_MULTIPLE


def int8_bytes(shape: tuple[int, int]) -> int:
    """Stored bytes of an int8 ``[N, K]`` matrix: one byte per (padded) weight plus a bf16 scale per row."""
    return shape[0] * int8_padded_width(shape[1]) + 2 * shape[0]


# --------------------------------------------------------------------------- int4


def int4_grid(groups: Tensor) -> tuple[Tensor, Tensor]:
    """The grid of each group of ``groups`` (float32 ``[G, group]``): ``(step, minimum)``, float32 ``[G]``.

    Code ``c`` stands for ``minimum + c * step`` (``c`` in 0..15). Min-max: the
    grid spans the group exactly. This is the one place that decides the grid.
    """
    lo, hi = groups.amin(dim=1), groups.amax(dim=1)
    return ((hi - lo) / _LEVELS).clamp_min(_MIN_STEP), lo


def quantize_int4(weight: Tensor, group_size: int = DEFAULT_INT4_GROUP) -> tuple[Tensor, Tensor]:
    """Quantise ``weight [N, K]``: ``(codes uint8 [Np, Kp / 2], scales_and_zeros bf16 [Kp / group, Np, 2])``."""
    import torch

    check_group_size(group_size)
    n, k = weight.shape
    np_, kp = int4_padded_shape((n, k), group_size)
    w = torch.zeros(np_, kp, dtype=torch.float32)
    w[:n, :k] = weight.detach().float()
    w[:n, k:] = w[:n, k - 1 : k]  # padded columns repeat the last weight: the group's grid stays its own
    groups = w.view(np_ * kp // group_size, group_size)
    step, minimum = int4_grid(groups)
    # Round the group's parameters to bf16 first, so the codes are chosen for the values stored.
    scale = step.bfloat16()
    zero = (minimum + _ZERO_CODE * step).bfloat16()
    codes = torch.round((groups - zero.float()[:, None]) / scale.float()[:, None]) + _ZERO_CODE
    codes = codes.clamp_(0, _LEVELS).to(torch.uint8).view(np_ // INT4_BLOCK, 2, 32, kp)
    packed = (codes[:, 0] | (codes[:, 1] << 4)).transpose(1, 2).contiguous().view(np_, kp // 2)
    scales_and_zeros = torch.stack([scale, zero], dim=-1).view(np_, kp // group_size, 2).transpose(0, 1)
    return packed, scales_and_zeros.contiguous()


def dequantize_int4_into(codes: Tensor, scales_and_zeros: Tensor, out: Tensor) -> Tensor:
    """Write the weights of ``(codes, scales_and_zeros)`` into the preallocated float ``out [N, K]``; return it.

    Plain torch ops on any device: the bytes of a few row blocks are transposed
    to row order, the nibbles split with bitwise ops (``byte & 15`` is row ``j``,
    ``byte >> 4`` row ``j + 32``) and ``q - 8`` taken on bytes, converted into
    ``out`` and scaled in place, ``(q - 8) * scale + zero``, with the
    stored scale and zero cast to ``out``'s dtype (exact in bf16; a mixed-dtype
    broadcast is several times slower). Blocks of 64 rows are done a few at a time, so the byte
    temporaries stay small; padded columns, and the last block when ``N`` is not
    a multiple of 64, go through a float temporary of at most 4 Mi values.
    """
    import torch

    np_, kp = codes.shape[0], 2 * codes.shape[1]
    n, k = out.shape
    group = kp // scales_and_zeros.shape[0]
    blocks = codes.view(np_ // INT4_BLOCK, kp, 32).transpose(1, 2)  # [blocks, 32, Kp]: byte j of rows j, j + 32
    scale = scales_and_zeros[..., 0].to(out.dtype).t()  # [Np, Kp / group]
    zero = scales_and_zeros[..., 1].to(out.dtype).t()
    per_pass = max(1, _PASS_VALUES // (INT4_BLOCK * kp))  # blocks of 64 rows at a time

    def fill(first: int, count: int, dense: Tensor) -> None:
        """Blocks ``first .. first + count - 1`` into ``dense``, a contiguous float ``[count * 64, Kp]``."""
        data = blocks[first : first + count].contiguous()  # the transpose on bytes: cheap, and the rest contiguous
        halves = dense.view(count, 2, 32, kp)
        halves[:, 0].copy_((data & 15).view(torch.int8).sub_(_ZERO_CODE))
        halves[:, 1].copy_((data >> 4).view(torch.int8).sub_(_ZERO_CODE))
        # Two broadcast passes: measured 2x faster than one broadcast addcmul, or addcmul over repeated factors.
        rows = slice(first * INT4_BLOCK, (first + count) * INT4_BLOCK)
        values = dense.view(count * INT4_BLOCK, kp // group, group)
        values.mul_(scale[rows, :, None]).add_(zero[rows, :, None])

    in_place = n // INT4_BLOCK if k == kp else 0
    for first in range(0, in_place, per_pass):
        count = min(per_pass, in_place - first)
        fill(first, count, out[first * INT4_BLOCK : (first + count) * INT4_BLOCK])
    for first in range(in_place, math.ceil(n / INT4_BLOCK), per_pass):
        count = min(per_pass, np_ // INT4_BLOCK - first)
        dense = torch.empty(count * INT4_BLOCK, kp, dtype=out.dtype, device=out.device)
        fill(first, count, dense)
        start = first * INT4_BLOCK
        stop = min(n, start + count * INT4_BLOCK)
        out[start:stop].copy_(dense[: stop - start, :k])
    return out


@dataclass
class PackedInt4:
    """An int4 matrix as the fused CPU kernel takes it (see the module docstring), with its logical shape.

    ``buffer``, when given, is a float ``[N, K]`` tensor a call with many rows
    dequantises into (once; :meth:`dense`) instead of allocating one.
    """

    codes: Tensor
    scales_and_zeros: Tensor
    shape: tuple[int, int]
    buffer: Tensor | None = None
    _dense: Tensor | None = None

    @property
    def group_size(self) -> int:
        """Input columns per scale group."""
        return 2 * self.codes.shape[1] // self.scales_and_zeros.shape[0]

    def dense(self, dtype: torch.dtype) -> Tensor:
        """The weights as a float ``[N, K]`` tensor of ``dtype`` (dequantised on the first call)."""
        import torch

        if self._dense is None or self._dense.dtype != dtype:
            out = self.buffer
            if out is None or out.dtype != dtype:
                out = torch.empty(self.shape, dtype=dtype, device=self.codes.device)
            self._dense = dequantize_int4_into(self.codes, self.scales_and_zeros, out)
        return self._dense


def int4_linear(x: Tensor, w: PackedInt4) -> Tensor:
    """``x @ w.T`` with the fused CPU kernel: ``x`` cast to bf16 (padded to ``Kp``), the output cast back."""
    import torch
    import torch.nn.functional as F

    n, k = w.shape
    kp = 2 * w.codes.shape[1]
    rows = x.reshape(-1, k).to(torch.bfloat16)
    if kp != k:
        rows = F.pad(rows, (0, kp - k))
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, w.codes, w.group_size, w.scales_and_zeros)
    return y[:, :n].reshape(*x.shape[:-1], n).to(x.dtype)


# --------------------------------------------------------------------------- int8


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8 of ``weight [N, K]``: ``(q int8 [N, Kp], scale bf16 [N])``.

    The scale is rounded to bf16 first and the codes chosen for it; the padded columns are zero.
    """
    import torch
    import torch.nn.functional as F

    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(_MIN_STEP).bfloat16()
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return F.pad(q, (0, int8_padded_width(w.shape[1]) - w.shape[1])).contiguous(), scale


def dequantize_int8_into(q: Tensor, scale: Tensor, out: Tensor) -> Tensor:
    """Write ``q * scale`` into the preallocated ``out`` (any float dtype/device) without temporaries.

    The scales are cast to ``out``'s dtype first: an in-place multiply by a wider dtype
    makes torch compute into a temporary of the whole matrix in that dtype and copy it back.
    """
    out.copy_(q[:, : out.shape[1]]).mul_(scale.to(out.dtype)[:, None])
    return out


@dataclass
class PackedInt8:
    """A per-channel int8 matrix (``q [N, Kp]``, bf16 ``scale [N]``) as ``_weight_int8pack_mm`` takes it,
    with its logical shape ``[N, K]``; ``buffer`` as :class:`PackedInt4`'s."""

    q: Tensor
    scale: Tensor
    shape: tuple[int, int]
    buffer: Tensor | None = None
    _dense: Tensor | None = None

    def dense(self, dtype: torch.dtype) -> Tensor:
        """The weights as a float ``[N, K]`` tensor of ``dtype`` (dequantised on the first call)."""
        import torch

        if self._dense is None or self._dense.dtype != dtype:
            out = self.buffer
            if out is None or out.dtype != dtype:
                out = torch.empty(self.shape, dtype=dtype, device=self.q.device)
            self._dense = dequantize_int8_into(self.q, self.scale, out)
        return self._dense


def int8_linear(x: Tensor, w: PackedInt8) -> Tensor:
    """``x @ w.T`` with the fused CPU kernel: ``x`` cast to bf16, the output cast back."""
    import torch
    import torch.nn.functional as F

    n, k = w.shape
    if w.q.data_ptr() % ALIGN:
        raise ValueError(f"int8 weights at {w.q.data_ptr():#x} are not {ALIGN}-byte aligned (the kernel crashes)")
    rows = x.reshape(-1, k).to(torch.bfloat16)
    if w.q.shape[1] != k:
        rows = F.pad(rows, (0, w.q.shape[1] - k))
    y = torch.ops.aten._weight_int8pack_mm(rows, w.q, w.scale)
    return y.reshape(*x.shape[:-1], n).to(x.dtype)
