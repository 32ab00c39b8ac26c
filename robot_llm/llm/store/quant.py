"""Weight-only int4 and int8 of the streamed matrices, stored in the layout of torch's fused CPU kernels.

**int4** (group-wise asymmetric, as gpt-fast/torchao): each row of a ``[N, K]`` matrix is cut into groups of
``group_size`` consecutive input columns; a group keeps a bf16 ``scale`` and ``zero`` and every weight a 4-bit code
``q`` with ``w = (q - 8) * scale + zero`` (``zero`` is the value code 8 stands for: ``minimum + 8 * step``). Which
``(step, minimum)`` a group gets is decided by :func:`int4_grid` alone (least squares over a few candidate grids).
The stored bytes are exactly what ``torch._weight_int4pack_mm_for_cpu`` reads, so the reader reads straight into the
kernel's operands and the CPU never dequantises at batch 1:

* codes ``uint8 [Np, Kp / 2]``: rows in blocks of 64; within a block, for each
  input column ``k``, 32 bytes, byte ``j`` holding row ``j`` in its low nibble
  and row ``j + 32`` in its high one (i.e. ``[Np / 64, Kp, 32]``);
* ``scales_and_zeros`` ``bf16 [Kp / group, Np, 2]``.

``Np`` is ``N`` rounded up to 64 (padded rows are zero and sliced off the output); ``Kp`` is ``K`` rounded up to the
group (padded columns repeat the row's last weight and meet zeros in the padded input), so any shape works, also
YaLM's 27308-wide MLP. That is 4.5 bits per weight at group 64, 5 at group 32.

**int8** is symmetric per output channel: ``int8 [N, Kp]`` (``K`` zero-padded to a multiple of 64) and one bf16
scale per row, what ``torch._weight_int8pack_mm`` reads.

:func:`int4_linear`/:func:`int8_linear` run the fused kernels (bf16 activations: with fp32 ones they are 30-100x
slower). :func:`dequantize_int4_into` and :func:`dequantize_int8_into` write the weights into a preallocated float
buffer with plain torch ops (any device: the CUDA path and fp32 compute use them). The size arithmetic needs no
torch (the planner uses it); torch is imported by the functions that touch tensors.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import Tensor

#: Group sizes the fused int4 CPU kernel accepts (it also takes 256; the issue caps groups at 128).
INT4_GROUP_SIZES = (32, 64, 128)
#: int4's group for a float source (YaLM's release, a Hugging Face folder): 4.5 bits per weight.
DEFAULT_INT4_GROUP = 64
#: int4's group for a GGUF source. Its weights are already block-quantised in runs of 32 (K-quants:
#: sub-blocks of 32 or 16), each run on its own grid; a group of 64 would force two grids into one
#: (Gemma 3 270M Q4_K_M: +76 % ru perplexity at 64 against +43 % at 32), so it pays the 5th bit.
GGUF_INT4_GROUP = 32
#: Rows per block of the int4 kernel's layout (the stored row count is padded to it).
INT4_BLOCK = 64
_LEVELS = 15
_ZERO_CODE = 8
#: Smallest normal fp16: a flat group (max == min) still gets a usable, non-zero step.
_MIN_STEP = 2.0**-14
#: Values dequantized per pass (at least one block of 64 rows): the byte temporaries stay in the cache
#: (measured here: 0.32 G values/s into bf16 at 256 Ki values per pass, 0.22 at 4 Mi).
_PASS_VALUES = 1 << 18
#: ... and on a GPU, where each pass is a dozen kernel launches: in CPU-sized passes a YaLM-100B layer would
#: take about 1,650 of them (some 15,000 launches, more time launching than working); 2^24 values keep each
#: byte temporary at 8 MiB and the float one (a matrix whose columns are padded) at 32 MiB in fp16.
_GPU_PASS_VALUES = 1 << 24
#: Rows of a call, per stored dtype, above which a quantized matrix is made dense once and multiplied by a
#: bf16 GEMM: the fused kernels' cost grows with every row while the GEMM's barely does. Measured here (1 thread,
#: bf16, 8192x2048 / 5460x1024 / 1024x2730): int4 fused 1.2 / 0.8 / 0.4 ms at 1 row, 20 / 5.8 / 3.1 ms at 32,
#: against 30-66 / 8.4 / 7.8 ms to dequantize, so int4 stays fused up to 48 rows (it crosses at 48-96);
#: int8 fused 24 / 5.8 / 3.7 ms at 32 rows against 11 / 2.8 / 1.6 ms to widen the codes to bf16 (a plain
#: copy: 4 G values/s) and multiply densely, the scale applied to the output; int8 crosses at 8-12 rows.
FUSED_MAX_ROWS = {"int4": 48, "int8": 10}
#: Compute dtypes whose engine hands quantized matrices to the fused kernels on the CPU. fp32 qualifies (fp32
#: rows cast to bf16 for the call, as :func:`robot_llm.llm.families.family.linear` does) by the whole step:
#: an int4 Gemma 3 270M store (27 int4 + 99 int8 matrices, weights in RAM, 1 thread, the AVX2 kernels,
#: prompt 512, CPU time per decode step, so that this shared box's load of 7-9 does not count) took 34 ms
#: at batch 1 against 82 with every layer dequantized into fp32 each pass, 263 against 321 ms at batch 32,
#: and prefilled at the same rate (prefill rows exceed :data:`FUSED_MAX_ROWS` and multiply dense fp32 either
#: way). An earlier wall-clock measurement at load 9 had found it slower.
FUSED_COMPUTE_DTYPES = ("bf16", "fp32")
#: The int8 kernel reads garbage (or crashes) when K is not a multiple of 16 (measured: 168, 184, 27308),
#: and crashes on weights not 16-byte aligned: stored int8 rows are zero-padded to a multiple of 64, and the
#: store places every quantized matrix at a multiple of :data:`ALIGN` bytes.
INT8_K_MULTIPLE = 64
#: Alignment of quantized matrices in memory (bytes) that the fused kernels are given.
ALIGN = 64


#: KV cache dtypes stored compressed (:mod:`robot_llm.llm.engine.kvquant`): int8 symmetric with an fp16
#: scale per head and slot; int4 asymmetric with an fp16 step and minimum per head and slot.
KV_QUANTIZED = ("int8", "int4")
_KV_BITS = {"int8": (8, 16), "int4": (4, 32)}


def fused_on_cpu(weight_dtype: str, compute_dtype: str) -> bool:
    """True when a CPU computing in ``compute_dtype`` hands a ``weight_dtype`` store's matrices to the fused
    kernels as stored (decode-sized calls) instead of dequantizing every layer into a float buffer."""
    return weight_dtype in ("int4", "int8") and compute_dtype in FUSED_COMPUTE_DTYPES


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


def dequantize_int4_into(
    codes: Tensor, scales_and_zeros: Tensor, out: Tensor, pass_values: int | None = None
) -> Tensor:
    """Write the weights of ``(codes, scales_and_zeros)`` into the preallocated float ``out [N, K]``; return it.

    Plain torch ops on any device: the bytes of a few row blocks are transposed
    to row order, the nibbles split with bitwise ops (``byte & 15`` is row ``j``,
    ``byte >> 4`` row ``j + 32``) and ``q - 8`` taken on bytes, converted into
    ``out`` and scaled in place, ``(q - 8) * scale + zero``, with the
    stored scale and zero cast to ``out``'s dtype (exact in bf16; a mixed-dtype
    broadcast is several times slower). Blocks of 64 rows are done a few at a time, so the byte
    temporaries stay small; padded columns, and the last block when ``N`` is not
    a multiple of 64, go through a float temporary of one pass. A pass covers about ``pass_values``
    values (default: :data:`_PASS_VALUES` on the CPU, :data:`_GPU_PASS_VALUES` elsewhere).
    """
    import torch

    np_, kp = codes.shape[0], 2 * codes.shape[1]
    n, k = out.shape
    group = kp // scales_and_zeros.shape[0]
    blocks = codes.view(np_ // INT4_BLOCK, kp, 32).transpose(1, 2)  # [blocks, 32, Kp]: byte j of rows j, j + 32
    scale = scales_and_zeros[..., 0].to(out.dtype).t()  # [Np, Kp / group]
    zero = scales_and_zeros[..., 1].to(out.dtype).t()
    if pass_values is None:
        pass_values = _PASS_VALUES if out.device.type == "cpu" else _GPU_PASS_VALUES
    per_pass = max(1, pass_values // (INT4_BLOCK * kp))  # blocks of 64 rows at a time

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


def _float_buffer(buffer: Tensor | None, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """The packed matrix's own buffer when it has one of ``dtype``, else a new ``shape`` tensor."""
    import torch

    return buffer if buffer is not None and buffer.dtype == dtype else torch.empty(shape, dtype=dtype, device=device)


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
    #: The codes in the layout this CPU's kernel reads, where it is not the stored one (:func:`int4_kernel_codes`).
    kernel_codes: Tensor | None = None
    #: Its rotated int8 copy (:func:`~robot_llm.llm.store.int8act.rotated_int8_copy`), made once per matrix.
    int8_copy: PackedInt8 | None = None

    @property
    def group_size(self) -> int:
        """Input columns per scale group."""
        return 2 * self.codes.shape[1] // self.scales_and_zeros.shape[0]

    def dense(self, dtype: torch.dtype) -> Tensor:
        """The weights as a float ``[N, K]`` tensor of ``dtype`` (dequantised on the first call)."""
        if self._dense is None or self._dense.dtype != dtype:
            out = _float_buffer(self.buffer, self.shape, dtype, self.codes.device)
            self._dense = dequantize_int4_into(self.codes, self.scales_and_zeros, out)
        return self._dense


def unpack_int4_codes(codes: Tensor) -> Tensor:
    """The stored codes ``uint8 [Np, Kp / 2]`` as one code per weight, ``uint8 [Np, Kp]`` in row order."""
    import torch

    np_, kp = codes.shape[0], 2 * codes.shape[1]
    blocks = codes.view(np_ // INT4_BLOCK, kp, 32)
    return torch.stack((blocks & 15, blocks >> 4), dim=1).transpose(2, 3).reshape(np_, kp)


@functools.cache
def int4_kernel_reads_stored_layout() -> bool:
    """True when this CPU's int4 kernel reads the stored layout as it is (torch's AVX512 build of the kernel).

    torch packs int4 weights for its CPU kernel differently per instruction set: on an AVX2-only CPU
    (torch 2.13) its packing is another interleave, and the kernel fed the stored bytes returns wrong
    products. Probed once per process by packing a random 64 x 64 matrix both ways.
    """
    import torch

    probe = torch.randint(0, 16, (INT4_BLOCK, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    ours = probe.to(torch.uint8).view(1, 2, 32, 64)
    stored = (ours[:, 0] | (ours[:, 1] << 4)).transpose(1, 2).contiguous().view(INT4_BLOCK, 32)
    return bool(torch.equal(torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1), stored))


def int4_kernel_codes(codes: Tensor, out: Tensor | None = None) -> Tensor:
    """The stored int4 ``codes`` repacked into the layout this CPU's kernel reads (into ``out`` when given).

    Only needed where :func:`int4_kernel_reads_stored_layout` is False; the stored layout stays what
    the store, the dequantization and every other machine read.
    """
    import torch

    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4_codes(codes).int(), 1)
    return packed if out is None else out.copy_(packed)


def int4_linear(x: Tensor, w: PackedInt4) -> Tensor:
    """``x @ w.T`` with the fused CPU kernel: ``x`` cast to bf16 (padded to ``Kp``), the output cast back."""
    import torch
    import torch.nn.functional as F

    n, k = w.shape
    kp = 2 * w.codes.shape[1]
    rows = x.reshape(-1, k).to(torch.bfloat16)
    if kp != k:
        rows = F.pad(rows, (0, kp - k))
    if w.kernel_codes is None and not int4_kernel_reads_stored_layout():
        w.kernel_codes = int4_kernel_codes(w.codes)  # once per matrix; the engine repacks ahead of time
    codes = w.codes if w.kernel_codes is None else w.kernel_codes
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, codes, w.group_size, w.scales_and_zeros)
    return y[:, :n].reshape(*x.shape[:-1], n).to(x.dtype)


# --------------------------------------------------------------------------- int8


def quantize_int8(weight: Tensor, levels: int = 127) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8 of ``weight [N, K]``: ``(q int8 [N, Kp], scale bf16 [N])``, in ``±levels``.

    The scale is rounded to bf16 first and the codes chosen for it; the padded columns are zero.
    """
    import torch
    import torch.nn.functional as F

    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / levels).clamp_min(_MIN_STEP).bfloat16()
    q = torch.round(w / scale.float()[:, None]).clamp_(-levels, levels).to(torch.int8)
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
    with its logical shape ``[N, K]``; ``buffer`` as :class:`PackedInt4`'s (:meth:`dense` and :meth:`widened`
    fill it, whichever is called first for this matrix)."""

    q: Tensor
    scale: Tensor
    shape: tuple[int, int]
    buffer: Tensor | None = None
    _dense: Tensor | None = None
    _widened: Tensor | None = None
    _scale32: Tensor | None = None
    #: The Hadamard block its input columns were rotated by (0: not rotated; :mod:`~robot_llm.llm.store.int8act`):
    #: the matrix multiplies rotated activations, and ``shape[1]`` is the padded width.
    rotation: int = 0
    #: Set where ``q`` holds a rotated copy's codes packed in VNNI order for our int8 x int8 product
    #: (:func:`~robot_llm.llm.store.int8act.vnni_pack`): its rows' offsets, int32 ``[N]``; only that product reads them.
    offset: Tensor | None = None

    def scale32(self) -> Tensor:
        """The per-row scales as fp32 ``[N]`` (cast once): what int8 activations' products are scaled by."""
        if self._scale32 is None:
            self._scale32 = self.scale.float()
        return self._scale32

    def widened(self, dtype: torch.dtype) -> Tensor:
        """The codes as a float ``[N, K]`` tensor of ``dtype``, unscaled (one copy, on the first call).

        Every int8 code is exact in bf16, so ``linear(x, widened) * scale`` is the matrix product
        with no rounding of the weights at all.
        """
        assert self.offset is None, "packed codes (vnni_pack) are read by our int8 product only"
        if self._widened is None or self._widened.dtype != dtype:
            out = _float_buffer(self.buffer, self.shape, dtype, self.q.device)
            self._widened = out.copy_(self.q[:, : self.shape[1]])
        return self._widened

    def dense(self, dtype: torch.dtype) -> Tensor:
        """The weights as a float ``[N, K]`` tensor of ``dtype`` (dequantised on the first call)."""
        assert self.offset is None, "packed codes (vnni_pack) are read by our int8 product only"
        if self._dense is None or self._dense.dtype != dtype:
            out = _float_buffer(self.buffer, self.shape, dtype, self.q.device)
            self._dense = dequantize_int8_into(self.q, self.scale, out)
        return self._dense


def int8_linear_widened(x: Tensor, w: PackedInt8) -> Tensor:
    """``x @ w.T`` for many rows: a dense product with the widened codes, then each output channel's scale."""
    import torch.nn.functional as F

    return F.linear(x, w.widened(x.dtype)).mul_(w.scale.to(x.dtype))


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
