"""int8 activations on the CPU: calls quantize their activations to int8 and multiply int8 by int8 (ours,
``gemv.c``, or ``torch._int_mm``; which rows, :func:`int8_activations_for`), as llama.cpp multiplies its blocks,
over int8 matrices whose input columns were rotated by Hadamard blocks (so that a row's few heavy channels do
not take its int8 scale).

:func:`int8_activations_for` says when a call takes this path, :func:`rotated_int8_in_place` and
:func:`rotated_int8_copy` prepare the weights (once, for the matrices the engine holds in RAM, and the LM
head, :mod:`robot_llm.llm.store.qhead`), :func:`rotate_input` rotates a call's activations and
:func:`int8_dynamic_linear` / :func:`int8_gemm` multiply. The weight formats are :mod:`robot_llm.llm.store.quant`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from robot_llm.llm.plan.cpu import cpu_has_amx
from robot_llm.llm.store import gemv
from robot_llm.llm.store.gemv import VNNI_GROUP
from robot_llm.llm.store.quant import PackedInt4, PackedInt8, int8_padded_width, quantize_int8

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from robot_llm.llm.store.gemv import Int8Matrix


#: Rows of a call from which an int8 matrix (rotated, on the CPU) meets int8 activations where torch's int8 GEMM
#: multiplies them (:func:`int8_activation_min_rows`: every call where ours does). Against the int8 kernel, 1
#: thread, ms at 1 / 4 / 8 / 32 rows, AVX512-VNNI (262144x640: 10.0 / 10.1 / 20.6 / 84 fused, 8.5 / 21 / 22 / 56
#: quantized; 2048x640: 0.03 / 0.08 / 0.13 / 0.52 against 0.03 / 0.07 / 0.08 / 0.16) and AVX2 (262144x640: 14.7 /
#: 29 / 57 / 232 against 30 / 38 / 45 / 111; 2048x640: 0.06 / 0.14 / 0.27 / 1.26 against 0.16 / 0.19 / 0.24 / 0.49):
#: both cross at 6-8 rows. An int4 matrix with a rotated int8 copy (RAM-homed) takes it from the same row count.
INT8_ACTIVATION_MIN_ROWS = 8
#: Rows of a call up to which int8 activations are used under bf16 compute on an AMX CPU
#: (:func:`int8_activation_max_rows`). There the dense bf16 GEMM over widened codes (AMX tiles) overtakes them
#: between 128 and 256 rows (Sapphire Rapids, 1 thread, ms at 32 / 256 / 2,048 rows: 2048x640 0.45 / 3.5 / 33
#: against 1.4 / 3.1 / 16; 640x2048 0.29 / 1.5 / 36 against 0.40 / 1.6 / 13), so a prefill stays bf16.
INT8_ACTIVATION_MAX_ROWS_AMX = 128
#: Rows up to which an int8 x int8 product over row-major codes is ``gemv.c``'s VNNI body rather than
#: ``torch._int_mm`` (oneDNN), which reads few rows' weights slowly (:func:`our_int8_mm_max_rows`). Sapphire Rapids,
#: 1 thread, ms at 8 / 16 / 32 rows: 262,144 x 640 ours 18 / 26 / 41, oneDNN (AMX) 32 / 33 / 40. Zen 4, ms at 8 / 16 /
#: 32 / 64 rows: 262,144 x 640 14 / 28 / 63 / 146 against 34 / 40 / 67 / 112. AMX tiles take every call (the head at
#: 32 rows 24 ms against 55); packed codes (``vnni.c``) are ours at every row count.
OUR_INT8_MM_MAX_ROWS = {"amx": 15, "vnni": 32}


@functools.cache
def int8_activations_on_cpu() -> bool:
    """True when calls on the CPU quantize their activations to int8 and multiply int8 by int8 (ours, or
    ``torch._int_mm``, oneDNN's s8s8s32 GEMM; which rows, :func:`int8_activations_for`), as llama.cpp multiplies its
    blocks: by default where that GEMM is exact (VNNI: AVX512-VNNI, AVX-VNNI, AMX; :func:`weight_levels`) and faster
    than the fp32 GEMM: where ours multiplies with VNNI or AMX (:func:`_ours_vnni`), else as :func:`_int8_gemm_fast`
    measures. ``ROBOT_LLM_INT8_ACTIVATIONS=1`` turns them on on any CPU with the
    kernel (without VNNI the rotated weights then keep 7 bits, which costs accuracy: Gemma 3 270M +1.2 % ru
    perplexity on the AVX2 kernels), ``0`` off (the weight-only kernels), e.g. to measure one path against the other
    in separate processes.

    The GEMM runs at 2.3x (oneDNN's AVX2 kernels) to 6-8x (AVX512-VNNI) the fp32 one on these shapes; the cost
    is an int8 rounding of each row of activations (one scale per row, :func:`quantize_activations`).
    """
    import os

    asked = os.environ.get("ROBOT_LLM_INT8_ACTIVATIONS", "auto").strip().lower()
    if asked in ("0", "false", "no", "off"):
        return False
    if _ours_multiply_every_call():
        return True
    exact = _int8_gemm_exact()
    if exact is None:
        return False
    return asked in ("1", "true", "yes", "on") or (exact and (_ours_vnni() or _int8_gemm_fast()))


def weight_levels() -> int:
    """The largest int8 code a rotated matrix may hold: 127 where the CPU's int8 GEMM is exact (VNNI), 63
    where it is not. Without VNNI oneDNN adds 128 to every activation code (``vpmaddubsw`` multiplies unsigned
    by signed bytes) and sums pairs of products into a saturating int16: 255 x 127 x 2 overflows it (measured
    on the AVX2 kernels: products off by up to 24 % of their range on random codes, and Gemma 3 270M's
    perplexity +2.0 % ru), 255 x 63 x 2 does not."""
    return 127 if _ours_multiply_every_call() or _int8_gemm_exact() else 63


def _ours_multiply_every_call() -> bool:
    """Whether every int8 x int8 product of this process is ``gemv.c``'s AVX2 body (exact for the codes quantized
    here, at every row count, :func:`int8_kernels_for`): then neither torch's kernel's
    exactness nor its speed matters. On an AVX2 EPYC (Zen 3, 1 thread) it runs 70-110 G ops/s against the fp32
    GEMM's 40-60 GFLOP/s at a batched decode step's shapes."""
    lib = gemv.kernels()
    return lib is not None and lib.int8_mm_body == "avx2"


def _ours_vnni() -> bool:
    """Whether our int8 x int8 product was built with VNNI or AMX (:attr:`~robot_llm.llm.store.gemv.Kernels.
    int8_mm_body`): then the CPU has what makes oneDNN's int8 GEMM 2-8x the fp32 one, and :func:`_int8_gemm_fast`'s
    timing is not asked. Its microseconds turn on a busy minute (2 threads beside two busy processes: 1 probe in 6
    said slower, seen on a 2-core AVX512-VNNI VM), and its answer would switch the whole process's int8 activations
    off: a night computing other numbers, slower, because something else ran when it started."""
    lib = gemv.kernels()
    return lib is not None and lib.int8_mm_body in ("vnni", "amx")


@functools.cache
def _int8_gemm_fast() -> bool:
    """Whether this CPU's ``torch._int_mm`` outruns its fp32 GEMM (best of three calls each, 32 x 512 x 512, at
    the process's threads). Exact is not enough: on an AVX2 EPYC (no VNNI) torch 2.13's int8 GEMM is exact but a
    fallback of 1-2 G ops/s against the fp32 GEMM's 30-50 GFLOP/s (32 x 640 x 2048, 1 thread: 45 against
    2.7 ms), which would make every batched decode step of a night 10-20x slower; with VNNI it is 2-8x faster
    than fp32, so the probe's margin is wide either way."""
    import time

    import torch

    a, w = torch.ones(32, 512, dtype=torch.int8), torch.ones(512, 512, dtype=torch.int8)
    x, v = torch.ones(32, 512), torch.ones(512, 512)

    def best(fn: Callable[[], object]) -> float:
        fn()  # first call: dispatch and allocation
        times = []
        for _ in range(3):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return min(times)

    return best(lambda: torch._int_mm(a, w.t())) < best(lambda: x @ v.t())


@functools.cache
def _int8_gemm_exact() -> bool | None:
    """Whether this CPU's ``torch._int_mm`` gives exact products of full-range codes (None: no such kernel).
    Probed once per process against an int64 product."""
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (17, 256), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (64, 256), dtype=torch.int8, generator=g)
    try:
        product = torch._int_mm(a, w.t())
    except (RuntimeError, AttributeError):  # a torch without the CPU kernel
        return None
    return bool(torch.equal(product.long(), a.long() @ w.long().t()))


#: Input columns per block of the Hadamard rotation that int8 activations need: a row of activations has a
#: few channels far above the rest (Gemma 3 270M: the largest value is 20-45x the row's RMS), so one int8 scale
#: per row leaves the others a handful of levels (the whole model's perplexity +10 % ru, +5 % en measured with
#: every matrix's activations rounded so). Rotating both the activations and the weights' input columns by the
#: same orthogonal Hadamard blocks (QuaRot's idea; ``x @ W.T == (x H) @ (W H).T``) spreads those channels over
#: the block: measured the same way, 128: -0.1 % ru, +0.3 % en; 64: +0.3 %, -0.7 %; with the rotated weights
#: int8 per row as well: +0.4 %, 0.0 %. A matrix whose padded width is not a multiple of 128 takes 64 (every
#: stored int8 width is a multiple of :data:`~robot_llm.llm.store.quant.INT8_K_MULTIPLE`).
ROTATION_BLOCKS = (128, 64)


def rotation_block(width: int) -> int:
    """The Hadamard block of a matrix ``width`` input columns wide (0: none fits)."""
    return next((b for b in ROTATION_BLOCKS if width % b == 0), 0)


@functools.cache
def _hadamard(n: int, dtype: torch.dtype) -> Tensor:
    """The Sylvester Hadamard matrix of order ``n`` (a power of two) in ``dtype``: entries +-1 (exact in every
    float dtype), symmetric, and ``H @ H == n * I``."""
    import torch

    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(dtype)


#: Values up to which a bf16 input is rotated through fp32: torch's small bf16 matmuls cost more than the casts
#: (one decode row, 640 columns: 15 us against 9 us, 1 thread).
_SMALL_ROTATION = 1 << 14


def rotate(x: Tensor, block: int) -> Tensor:
    """``x [..., K]`` (``K`` a multiple of ``block``) times the block-diagonal Hadamard matrix of +-1 entries, in
    ``x``'s dtype: every run of ``block`` columns mixed by one product. Weights are stored rotated and divided
    by ``block`` (:func:`rotate_weights`), so ``rotate(x) @ rotate_weights(W).T == x @ W.T``; the +-1 entries
    keep a bf16 ``x``'s rotation exact up to the product's own rounding, in one matmul (a decode step rotates
    about 70 inputs)."""
    import torch

    shape = x.shape
    if x.dtype == torch.float32 or x.numel() > _SMALL_ROTATION:
        return (x.reshape(-1, block) @ _hadamard(block, x.dtype)).reshape(shape)
    return (x.reshape(-1, block).float() @ _hadamard(block, torch.float32)).to(x.dtype).reshape(shape)


def rotate_weights(w: Tensor, block: int) -> Tensor:
    """Float weights ``w [N, K]`` with their input columns rotated for :func:`rotate`'d inputs (fp32)."""
    return rotate(w.float(), block).div_(block)


def rotate_int8_in_place(q: Tensor, scale: Tensor, rows: int = 1024) -> int:
    """Requantize an int8 matrix (``q [N, Kp]``, bf16 ``scale [N]``) so that its input columns are rotated
    (:func:`rotate_weights`): the codes and scales are overwritten, ``rows`` at a time; returns the block (0 when no
    block fits ``Kp``, and nothing is changed)."""
    block = rotation_block(q.shape[1])
    for a in range(0, q.shape[0] if block else 0, rows):
        b = min(q.shape[0], a + rows)
        dense = q[a:b].float().mul_(scale[a:b].float()[:, None])
        q[a:b], scale[a:b] = quantize_int8(rotate_weights(dense, block), weight_levels())
    return block


def rotated_int8_in_place(q: Tensor, scale: Tensor) -> PackedInt8 | None:
    """A RAM-homed int8 matrix (``q [N, Kp]``, bf16 ``scale [N]``) rotated in place (:func:`rotate_int8_in_place`)
    and, where :func:`packs_codes` and its rows fill whole groups of :data:`VNNI_GROUP`, packed in place too, for
    int8 activations; None where no rotation block fits (nothing changed)."""
    block = rotate_int8_in_place(q, scale)
    if not block:
        return None
    packs = packs_codes() and q.is_contiguous() and q.shape[0] % VNNI_GROUP == 0
    offset = vnni_pack(q, q.shape[0], into=q)[1] if packs else None
    return PackedInt8(q, scale, (q.shape[0], q.shape[1]), rotation=block, offset=offset)


def quantize_activations(x: Tensor, width: int, levels: int = 127) -> tuple[Tensor, Tensor]:
    """Rows of ``x [..., K]`` as symmetric int8 codes within ``-levels..levels``, one fp32 scale per row:
    ``(q int8 [M, width], scale [M, 1])``, the columns past ``K`` zero (a stored matrix's padding). The row maxima
    are taken in ``x``'s own dtype (exact) and the codes divided out in fp32."""
    import torch

    k = x.shape[-1]
    rows = x.reshape(-1, k)
    scale = rows.abs().amax(dim=1, keepdim=True).float().clamp_min_(1e-30).div_(float(levels))
    codes = torch.mul(rows, scale.reciprocal()).round_()
    if width == k:
        return codes.to(torch.int8), scale
    q = torch.zeros(rows.shape[0], width, dtype=torch.int8)
    q[:, :k] = codes
    return q, scale


def int8_activation_min_rows() -> int:
    """The fewest rows of a call that quantizes its activations: 1 where ``gemv.c``'s int8 x int8 product is built,
    else :data:`INT8_ACTIVATION_MIN_ROWS` (torch's product).

    Ours multiplies int8 by int8 in fewer instructions a weight byte than its exact few-row kernel, which widens
    every code to fp32 (1 thread, ms at 1 row, quantizing included, exact kernel against int8 activations: AVX2
    262144x640 21.4 / 16.5, 2048x640 0.110 / 0.074; AVX512-VNNI 15.1 / 13.0, 0.096 / 0.059; AMX 18.7 / 16.5, 0.098
    / 0.061). A batch-1 decode step of Gemma 3 270M (int4 store, 512 + 128 tokens, Sapphire Rapids, ms at 1 / 2
    threads, two runs each): AVX2 kind 49.3-49.5 / 33.7-35.3 -> 41.1-44.0 / 29.0-30.8; AVX512-VNNI 43.2-43.5 /
    28.8-30.5 -> 39.9-41.4 / 28.1-28.4; AMX a tie. On a Zen 4 core (the head at 1 row, 1 thread): AVX512-VNNI 8.5
    against 7.6 ms, the AVX2 kind 7.0 against 6.0-6.6 (the AVX2 body's one-row tile read it at half the rate before
    it ran as a pair: 12-18 ms, and that kind's batch-1 step took 37-48 ms where the exact kernel's took 24-32)."""
    return 1 if gemv.kernels() is not None else INT8_ACTIVATION_MIN_ROWS


def int8_activation_max_rows(dtype: str, flags: frozenset[str] | None = None) -> int | None:
    """The most rows of a call that quantizes its activations under ``dtype`` compute on a CPU with ``flags``
    (default: this one's), None for every row count: :data:`INT8_ACTIVATION_MAX_ROWS_AMX` under bf16 on an AMX
    CPU, whose bf16 tiles win at prefill sizes. Without AMX the int8 GEMM wins at every size: under AVX512-BF16 on
    a Zen 4 EPYC (1 thread, the whole call, ms at 256 / 512 / 2,048 rows, bf16 over widened codes against int8
    activations: 2048x640 4.5 / 8.4 / 33 against 2.6 / 4.8 / 32; 640x2048 4.3 / 8.8 / 35 against 2.8 / 5.3 / 20;
    1024x640 2.2 / 4.7 / 17 against 1.3 / 2.7 / 10), and under fp32 on AVX2 (2048x640: 0.59 / 3.9 / 32 against
    0.98 / 7.6 / 60 at 32 / 256 / 2,048 rows)."""
    if dtype == "bf16" and cpu_has_amx(flags):
        return INT8_ACTIVATION_MAX_ROWS_AMX
    return None


def int8_activations_for(rows: int, dtype: torch.dtype) -> bool:
    """True when a CPU call of ``rows`` rows in ``dtype`` quantizes its activations: from
    :func:`int8_activation_min_rows` rows up to :func:`int8_activation_max_rows`, where the CPU can
    (:func:`int8_activations_on_cpu`)."""
    import torch

    if rows < int8_activation_min_rows() or not int8_activations_on_cpu():
        return False
    most = int8_activation_max_rows("bf16" if dtype == torch.bfloat16 else "fp32")
    return most is None or rows <= most


#: The last :func:`rotate_input`: ``(x, width, block, rotated)``. A layer multiplies one input by several
#: matrices in a row (q, k and v; gate and up): they share its rotation. Holding ``x`` keeps its identity;
#: the families never change a matrix's input in place (and inference tensors keep no version counter to
#: tell), so the identity is enough.
_last_rotation: list[tuple[Tensor, int, int, Tensor]] = []


def rotate_input(x: Tensor, w: PackedInt8) -> Tensor:
    """``x [..., K]`` as a rotated matrix ``w`` multiplies it: zero-padded to ``w``'s width and rotated."""
    import torch.nn.functional as F

    k, width = x.shape[-1], w.shape[1]
    if _last_rotation:
        last, last_width, last_block, rotated = _last_rotation[0]
        if last is x and (last_width, last_block) == (width, w.rotation):
            return rotated
    rotated = rotate(F.pad(x, (0, width - k)) if width != k else x, w.rotation)
    _last_rotation[:] = [(x, width, w.rotation, rotated)]
    return rotated


#: The last :func:`quantize_input`: ``(x, width, block, ours, (q, scale))``, shared as :func:`rotate_input`'s
#: rotation is (q, k and v; gate and up meet one input).
_last_quantized: list[tuple[Tensor, int, int, bool, tuple[Tensor, Tensor]]] = []


def quantize_input(x: Tensor, width: int, block: int, ours: Int8Kernels | None = None) -> tuple[Tensor, Tensor]:
    """The rows of ``x [..., K]`` as a matrix ``width`` columns wide, its input columns rotated by ``block`` (0:
    none), multiplies them with int8 activations: zero-padded, rotated and quantized (:func:`quantize_activations`),
    ``(q int8 [M, width], scale fp32 [M, 1])``. ``ours``: in one C pass per row, the rotation as the fast transform in
    fp32 (torch's rotation is a matmul, :func:`rotate`: 0.4 ms a batch-32 call on an AVX2 EPYC); else torch's ops.
    The last answer is reused for the same ``x``."""
    import torch.nn.functional as F

    if _last_quantized:
        last, last_width, last_block, last_ours, answer = _last_quantized[0]
        if last is x and (last_width, last_block, last_ours) == (width, block, ours is not None):
            return answer
    rows = x.reshape(-1, x.shape[-1])
    if ours is not None:
        answer = ours.quantize(rows, width, block)
    else:
        padded = F.pad(rows, (0, width - rows.shape[1])) if width != rows.shape[1] else rows
        answer = quantize_activations(rotate(padded, block) if block else padded, width)
    _last_quantized[:] = [(x, width, block, ours is not None, answer)]
    return answer


#: Rows of a call up to which our kernels take the whole of :func:`int8_dynamic_linear` in one call
#: (:meth:`~robot_llm.llm.store.gemv.Kernels.int8_linear`); past them the rows are quantized once for every matrix
#: that meets them (:func:`quantize_input`: q, k and v; gate and up).
ONE_CALL_ROWS = 32


@dataclass(frozen=True)
class Int8Kernels:
    """Our kernels for a product with int8 activations (``gemv.c``'s, :func:`int8_kernels_for`):
    ``quantize(rows, width, rotation)`` as :func:`quantize_input` computes it; ``matmul(q, codes, out, scale,
    row_scale)`` as ``torch._int_mm`` (int32; with both scales, fp32 as :func:`int8_gemm` computes it;
    None: torch's serves); ``linears(x, matrices, rotation)`` the whole of :func:`int8_dynamic_linear` for one or
    several matrices in one call (:meth:`~robot_llm.llm.store.gemv.Kernels.int8_linears`; None: past
    :data:`ONE_CALL_ROWS` rows)."""

    quantize: Callable[[Tensor, int, int], tuple[Tensor, Tensor]]
    matmul: Callable[..., Tensor] | None = None
    linears: Callable[[Tensor, tuple[Int8Matrix, ...], int], list[Tensor]] | None = None


def our_int8_mm_max_rows() -> int:
    """The most rows of an int8 x int8 product a VNNI build of ours takes (:data:`OUR_INT8_MM_MAX_ROWS`: fewer
    where oneDNN has AMX tiles and ours has not, e.g. where Linux refused them)."""
    return OUR_INT8_MM_MAX_ROWS["amx" if cpu_has_amx() else "vnni"]


def int8_kernels_for(rows: int) -> Int8Kernels | None:
    """Our kernels for a call of ``rows`` rows with int8 activations where built: the rows' quantization
    (:meth:`~robot_llm.llm.store.gemv.Kernels.quantize_rows`) and the int8 x int8 product
    (:meth:`~robot_llm.llm.store.gemv.Kernels.int8_mm`): an AMX or AVX2 build's at every row count, a VNNI build's
    up to :func:`our_int8_mm_max_rows` rows (oneDNN's past them), both in one call up to
    :data:`ONE_CALL_ROWS` rows; None: torch's ops."""
    lib = gemv.kernels()
    if lib is None:
        return None
    multiplies = lib.int8_mm_body in ("amx", "avx2") or rows <= our_int8_mm_max_rows()
    return _int8_kernels(multiplies, multiplies and rows <= ONE_CALL_ROWS)


@functools.cache
def _int8_kernels(with_matmul: bool, one_call: bool) -> Int8Kernels:
    """:func:`int8_kernels_for`'s answers, made once (a decode step asks about 130 times)."""
    lib = gemv.kernels()
    assert lib is not None
    matmul, linears = lib.int8_mm if with_matmul else None, lib.int8_linears if one_call else None
    return Int8Kernels(quantize=lib.quantize_rows, matmul=matmul, linears=linears)


def int8_dynamic_linear(x: Tensor, w: PackedInt8, ours: Int8Kernels | None = None) -> Tensor:
    """``x @ w.T`` with int8 activations: the rows of ``x [..., K]`` (not rotated: a rotated ``w`` rotates them)
    quantized (:func:`quantize_input`), one int8 x int8 -> int32 GEMM over the stored codes (``ours`` where given,
    as :func:`int8_gemm`), then both scales (the output in ``x``'s dtype); all in one call of ours where it takes
    the call whole (:attr:`Int8Kernels.linears`). Packed codes (``w.offset``, :func:`vnni_pack`) are ours at every
    row count."""
    if ours is not None and ours.linears is not None:
        return ours.linears(x, ((w.q, w.scale32(), w.offset),), w.rotation)[0]
    y = int8_gemm(x, w.q, w.scale32(), w.rotation, ours=ours, dtype=x.dtype, offset=w.offset)
    return y.reshape(*x.shape[:-1], w.shape[0])


def int8_dynamic_linears(x: Tensor, ws: list[PackedInt8], ours: Int8Kernels | None = None) -> list[Tensor]:
    """:func:`int8_dynamic_linear` of ``x`` by each of ``ws``, rotated matrices that meet one input (q, k and v; gate
    and up): in one call of ours where it takes calls whole and they share a width and a rotation (the rows
    quantized and the threads woken once: the same values), else a call each (sharing the rows' quantization)."""
    width, block = ws[0].shape[1], ws[0].rotation
    if ours is not None and ours.linears is not None and all((w.shape[1], w.rotation) == (width, block) for w in ws):
        return ours.linears(x, tuple((w.q, w.scale32(), w.offset) for w in ws), block)
    return [int8_dynamic_linear(x, w, ours) for w in ws]


def int8_gemm(
    x: Tensor,
    codes: Tensor,
    scale: Tensor,
    rotation: int = 0,
    acc: Tensor | None = None,
    ours: Int8Kernels | None = None,
    out: Tensor | None = None,
    dtype: torch.dtype | None = None,
    offset: Tensor | None = None,
) -> Tensor:
    """``x [..., K] @ (codes [N, Kp] * scale [N, 1]).T`` as ``[M, N]`` in ``dtype`` (fp32 where None), where
    ``codes``' input columns were rotated by ``rotation`` (0: none): the rows padded, rotated and quantized to int8
    first (:func:`quantize_input`), one int8 x int8 -> int32 GEMM (into ``acc [M, N]`` when given), converted to
    fp32, then both scales (a mixed int32 x fp32 multiply is 3-4x slower: 34 against 4.5 ms for 32 x 262,144
    logits, 1 thread) and the cast, in one pass of ours where it is built (:meth:`~robot_llm.llm.store.gemv.Kernels.
    scale_int32`: torch's four passes over fresh buffers were a fifth of a VNNI build's prefill, whose products are
    oneDNN's, at 1 thread), else torch's ops. ``ours`` (:func:`~robot_llm.llm.store.gemv.int8_kernels_for`)
    quantize and multiply as the torch ops do (the rotation as its fast transform); where ours multiplies, the
    scales are applied in the product's own pass (the same values; ``acc`` is not needed), into ``out``
    (contiguous fp32 ``[M, N]``) where given. ``offset``: the codes are packed (:func:`vnni_pack`), and ours
    multiplies them at every row count."""
    import torch

    dtype = dtype or torch.float32
    q, row_scale = quantize_input(x, codes.shape[1], rotation, ours)
    if offset is not None:  # packed: our product, whatever the rows
        lib = gemv.kernels()
        assert lib is not None, "packed codes are multiplied by the kernels that packed them"
        return lib.int8_mm(q, codes, out, scale, row_scale, offset).to(dtype)
    if ours is not None and ours.matmul is not None:
        return ours.matmul(q, codes, out, scale, row_scale).to(dtype)  # the epilogue's values in the product's pass
    product = torch._int_mm(q, codes.t()) if acc is None else torch._int_mm(q, codes.t(), out=acc)
    lib = gemv.kernels()
    if lib is not None and dtype in (torch.float32, torch.bfloat16):
        return lib.scale_int32(product, scale, row_scale, bf16=dtype == torch.bfloat16)
    return product.float().mul_(scale).mul_(row_scale).to(dtype)


def rotated_int8_copy(w: PackedInt4) -> PackedInt8:
    """An int4 matrix requantized to int8 per output channel with its input columns rotated (from its fp32
    values, once: kept on the matrix), for :func:`int8_dynamic_linear`."""
    import torch
    import torch.nn.functional as F

    if w.int8_copy is None:
        dense = w.dense(torch.float32)
        width = int8_padded_width(w.shape[1])
        block = rotation_block(width)
        q, scale = quantize_int8(rotate_weights(F.pad(dense, (0, width - w.shape[1])), block), weight_levels())
        q, offset = vnni_pack(q, q.shape[0]) if packs_codes() else (q, None)
        w.int8_copy = PackedInt8(q=q, scale=scale, shape=(w.shape[0], width), rotation=block, offset=offset)
        if dense is not w.buffer:
            w._dense = None  # the int8 copy replaces the fp32 one (the buffer is the layer slot's)
    return w.int8_copy


def packs_codes() -> bool:
    """Whether rotated int8 matrices held in RAM (the int8 head, an int4 layer's int8 copy) are packed in VNNI order
    (:func:`vnni_pack`) and every call of theirs is our int8 x int8 product over them: where that product's body is
    AVX512-VNNI (Zen 4, 1 thread, the 262,144 x 640 head at 1 / 32 rows 8.6 / 32.3 ms packed against 11.7 / 50.9
    row-major; a b32 decode step of Gemma 3 270M 109 -> 82 ms)."""
    lib = gemv.kernels()
    return lib is not None and lib.int8_mm_body == "vnni"


def vnni_pack(codes: Tensor, rows: int, into: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The first ``rows`` rows of ``codes int8 [R, Kp]`` (rows contiguous) packed in VNNI order (``vnni.c``) into
    ``into`` (``codes`` itself: in place, a group at a time; default a new buffer), rows padded with zeros to a
    multiple of :data:`VNNI_GROUP`; and their offsets, int32 ``[rows]``, which :meth:`~robot_llm.llm.store.gemv.
    Kernels.int8_mm` takes with them. Needs a build of ours (``MemoryError`` where a group cannot be staged)."""
    import torch

    lib, (_, kp), padded = gemv.kernels(), codes.shape, -(-rows // VNNI_GROUP) * VNNI_GROUP
    into = torch.empty(padded, kp, dtype=torch.int8) if into is None else into
    offset = torch.empty(rows, dtype=torch.int32)
    in_place = into.data_ptr() == codes.data_ptr()
    if (
        lib is None
        or codes.stride(1) != 1
        or not into.is_contiguous()
        or into.shape[0] < padded
        or kp % 4
        or (in_place and not codes.is_contiguous())
    ):
        raise ValueError(f"vnni_pack: {rows} rows of codes {tuple(codes.shape)} into {tuple(into.shape)}, ours built")
    if lib.lib.rl_vnni_pack(codes.data_ptr(), codes.stride(0), rows, kp, into.data_ptr(), offset.data_ptr()):
        raise MemoryError(f"vnni_pack: no memory to stage {VNNI_GROUP} rows of {kp} codes")
    return into, offset
