"""The output head (and the embedding it is tied to) held in int8 per output channel, as llama.cpp keeps
it (Q8_0), for a quantized store computed on the CPU.

A large vocabulary makes the head most of a small model's decode step: Gemma 3 270M's tied
262,144 x 640 table is 671 MB in fp32, read on every step, against about 100 MB for all 18
layers in int4/int8. Held as int8 codes with one bf16 scale per vocabulary row it is 168 MB;
the logits of decode-sized calls come from our int8 kernel (:mod:`~robot_llm.llm.store.gemv`; torch's fused
one where it is not built), the codes read as stored, and a token's embedding is read exactly from the store
(:class:`RowSource`), so the float table never exists in memory. A call with more rows (a batched decode
step, a whole-sequence scoring pass) quantizes its rows to int8 and multiplies int8 by int8 where the CPU can
(:func:`~robot_llm.llm.store.int8act.int8_activations_on_cpu`), else widens the codes, a block of the
vocabulary at a time into one reused buffer. Where that int8 product is our AVX512-VNNI body (no AMX tiles), the
rotated codes are packed in VNNI order (``vnni.c``), which drops the product's horizontal sums.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from robot_llm.llm.store.diskio import huge_page_buffer
from robot_llm.llm.store.gemv import gemv_available, kernels, matmul_serves
from robot_llm.llm.store.int8act import (
    VNNI_GROUP,
    int8_activations_for,
    int8_gemm,
    int8_kernels_for,
    packs_codes,
    rotate_weights,
    rotation_block,
    vnni_pack,
    weight_levels,
)
from robot_llm.llm.store.int8act import rotate as rotate_rows
from robot_llm.llm.store.quant import int8_padded_width, quantize_int8

#: Rows of a head call up to which a fused int8 kernel computes the logits (ours where built, which is faster at
#: every such row count; the figures here are torch's). At decode sizes it reads
#: the 8-bit codes once and is as fast as the fp32 GEMM on a quarter of the bytes (torch 2.13, AVX2, 2
#: threads, 65,536 x 640: 3.7 ms at 1 row against fp32's 12 ms); its cost then grows row by row while
#: the widened blocks' barely does. Gemma 3 270M's 262,144 x 640 head, 1 thread, ms at 1 / 8 / 16 / 32
#: rows, fused against widened in blocks of 2,048: AVX512-BF16 (bf16) 12 / 26 / 65 / 128 against
#: 46 / 32 / 61 / 78; the AVX2 kernels (fp32) 16 / 87 / 167 / 407 against 17 / 52 / 112 / 214.
#: From :func:`~robot_llm.llm.store.int8act.int8_activation_min_rows` rows (1 where ours multiplies), where the CPU
#: multiplies int8 by int8, the rows are quantized instead and the logits come from one int8 GEMM over the rotated codes
#: (:func:`~robot_llm.llm.store.int8act.int8_gemm`; same head, 1 thread, ms at 8 / 16 / 32 rows: AVX512-VNNI
#: 22 / 36 / 56, AVX2 45 / 69 / 111).
HEAD_FUSED_ROWS = 8
#: Vocabulary rows widened per block for a call with more rows: 2.6 MB in bf16, 5.2 in fp32, so the
#: block stays near the cache while a batch's rows multiply it (8,192-row blocks measured slower).
WIDEN_BLOCK_ROWS = 2048
#: Rows of a head call below which our AVX2 build multiplies its fp32 activations (``int8_gemv``, which reads the codes
#: once for every row) rather than quantizing them: the int8 x int8 body takes a lone row as a pair with itself. The
#: 262,144 x 640 head, AVX2 body, ms at 1 / 2 / 3 / 4 rows: 1 thread 20.8 / 22.8 / 24.9 / 28.1 against 27.5 / 26.3 /
#: 29.9 / 30.0 quantized, 2 threads 10.7 / 11.8 / 12.4 / 14.3 against 13.8 / 12.6 / 14.5 / 14.4. The VNNI and AMX
#: bodies are within 10 % of the fp32 path at these rows either way and keep int8 activations.
HEAD_GEMV_ROWS_AVX2 = 4
#: Logits buffers a table keeps for reuse (:meth:`QuantizedTable._logits_for`): a decode loop holds its last step's
#: logits while the next step's are computed. Logits over 64 MiB (past 64 rows of a 262,144 vocabulary: a sequence
#: scored whole) are not kept.
KEPT_LOGITS = 2
KEPT_LOGITS_BYTES = 1 << 26
#: Rows quantized at a time when the table is built: the float temporaries stay small (a 262k x 640
#: table quantized whole would hold a 671 MB fp32 copy at the peak of the engine's start).
QUANTIZE_ROWS = 16384


class RowSource:
    """The float rows of a vocabulary matrix where the store keeps them (a safetensors file), read by ``pread``.

    An embedding lookup needs a handful of rows per step: read exactly from the file (the page
    cache holds what is used), they cost no resident memory and none of int8's error, which the
    layers would carry forward (Gemma 3 270M on a 200-token digest: the next-token KL from the
    float model 0.0092 with int8 embeddings against 0.0010 with exact ones and the int8 head).
    """

    def __init__(self, path: Path, offset: int, shape: tuple[int, int], dtype: torch.dtype) -> None:
        self.path, self.offset, self.shape, self.dtype = path, offset, shape, dtype
        self.row_bytes = shape[1] * dtype.itemsize
        self._fd = os.open(path, os.O_RDONLY)

    def read(self, first: int, count: int) -> Tensor:
        """Rows ``first .. first + count - 1`` as a ``[count, K]`` tensor of the stored dtype."""
        buffer = bytearray(count * self.row_bytes)
        got = os.preadv(self._fd, [buffer], self.offset + first * self.row_bytes)
        if got != len(buffer):
            raise OSError(f"{self.path}: short read of embedding rows {first}..{first + count - 1}")
        return torch.frombuffer(buffer, dtype=self.dtype).view(count, self.shape[1])

    def rows(self, ids: Tensor) -> Tensor:
        """The rows of ``ids`` (any shape): ``[*ids.shape, K]`` in the stored dtype, each distinct row read once."""
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        picked = torch.cat([self.read(int(i), 1) for i in unique.tolist()]) if unique.numel() else None
        if picked is None:
            return torch.empty(*ids.shape, self.shape[1], dtype=self.dtype)
        return picked[inverse].view(*ids.shape, self.shape[1])

    def close(self) -> None:
        """Close the file."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    __del__ = close


def _few_rows_read_faster(m: int) -> bool:
    """Whether a head call of ``m`` rows reads the codes faster with its fp32 activations (``int8_gemv``, exact) than
    quantized: below :data:`HEAD_GEMV_ROWS_AVX2` rows on our AVX2 build."""
    lib = kernels() if m < HEAD_GEMV_ROWS_AVX2 else None
    return lib is not None and lib.int8_mm_body == "avx2"


def _unviewed(t: Tensor) -> bool:
    """Whether ``t``'s storage is held by ``t`` alone (no view or alias of it lives): torch's count of the storage's
    owners, ``t`` and the storage object asked; False where this torch does not tell."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return count is not None and count(t.untyped_storage()._cdata) == 2


def _aligned_int8(rows: int, cols: int) -> Tensor:
    """An int8 ``[rows, cols]`` tensor at a multiple of :data:`~robot_llm.llm.store.quant.ALIGN` (the kernel needs
    it), in huge pages where the kernel grants them (:func:`~robot_llm.llm.store.diskio.huge_page_buffer`: every
    decode step reads the whole table)."""
    return huge_page_buffer(rows * cols).view(torch.int8).view(rows, cols)


@dataclass
class QuantizedTable:
    """A ``[V, K]`` vocabulary matrix as int8 codes ``q [V, Kp]`` and bf16 scales ``[V]``; ``dtype`` is the
    compute dtype its lookups and logits come out in. Used where a family reads the embedding table or the
    LM head: :func:`robot_llm.llm.families.family.linear` and
    :func:`robot_llm.llm.families.family.embedding` dispatch to it."""

    q: Tensor
    scale: Tensor
    shape: tuple[int, int]
    dtype: torch.dtype
    #: Where exact rows are read for lookups (an embedding); None: lookups dequantize the codes.
    source: RowSource | None = field(default=None, repr=False)
    #: The Hadamard block the rows' columns were rotated by before quantizing (0: none); then ``shape[1]`` is
    #: the padded width and ``width`` the embedding's.
    rotation: int = 0
    width: int = 0
    _block: Tensor | None = field(default=None, repr=False)
    _scale32: Tensor | None = field(default=None, repr=False)
    #: The int32 products of the last int8-activation call, reused: a batch's are tens of MB (32 x 262,144: 32 MiB),
    #: which the allocator maps and page-faults in afresh each step (56.9 against 44.4 ms a step, 1 thread).
    _acc: Tensor | None = field(default=None, repr=False)
    #: The fp32 logits our int8 product wrote, each reused once no tensor views it any more (:meth:`_logits_for`).
    _logits: list[Tensor] = field(default_factory=list, repr=False)
    #: Set where ``q`` holds the codes packed in VNNI order (:func:`~robot_llm.llm.store.int8act.packs_codes`; its
    #: rows padded to a multiple of 16): 128 x each row's sum of codes, int32 ``[V]``, which the product takes off.
    offset: Tensor | None = field(default=None, repr=False)

    @classmethod
    def quantize(
        cls, weight: Tensor | RowSource, dtype: torch.dtype, *, exact_lookups: bool = False, rotate: bool = False
    ) -> QuantizedTable:
        """Symmetric int8 per row of ``weight [V, K]`` (any float dtype, or rows read from the store),
        :data:`QUANTIZE_ROWS` rows at a time; ``exact_lookups`` (a :class:`RowSource` only) keeps it for lookups;
        ``rotate`` quantizes the rows with their columns rotated (:func:`~robot_llm.llm.store.int8act.rotate_weights`),
        for int8 activations."""
        v, k = weight.shape
        width = int8_padded_width(k)
        block = rotation_block(width) if rotate else 0
        packs = bool(block) and packs_codes()
        q = _aligned_int8(-(-v // VNNI_GROUP) * VNNI_GROUP if packs else v, width)
        scale = torch.empty(v, dtype=torch.bfloat16)
        step = QUANTIZE_ROWS // 4 if block else QUANTIZE_ROWS  # a rotation's temporaries are a few more
        for a in range(0, v, step):
            count = min(step, v - a)
            rows = weight.read(a, count) if isinstance(weight, RowSource) else weight[a : a + count]
            if block:
                rows = rotate_weights(F.pad(rows.float(), (0, width - k)), block)
            q[a : a + count], scale[a : a + count] = quantize_int8(rows, weight_levels() if block else 127)
        offset = vnni_pack(q, v, into=q)[1] if packs else None
        source = weight if exact_lookups and isinstance(weight, RowSource) else None
        shape = (v, width) if block else (v, k)
        return cls(q=q, scale=scale, shape=shape, dtype=dtype, source=source, rotation=block, width=k, offset=offset)

    @property
    def nbytes(self) -> int:
        """Bytes held (codes, scales and a packed table's offsets)."""
        return self.q.numel() + 2 * self.scale.numel() + (0 if self.offset is None else 4 * self.offset.numel())

    def codes(self, ids: Tensor | None = None) -> Tensor:
        """The int8 codes in row order, ``[V, Kp]``, or the rows of ``ids`` (any shape) ``[*ids.shape, Kp]``:
        unpacked (a copy) where the table is packed."""
        if self.offset is None:
            return self.q[: self.shape[0]] if ids is None else F.embedding(ids, self.q)
        lib, kp = kernels(), self.q.shape[1]
        wanted = (torch.arange(self.shape[0]) if ids is None else ids).reshape(-1).to(torch.int64).contiguous()
        if wanted.numel() and not 0 <= int(wanted.min()) <= int(wanted.max()) < self.shape[0]:
            raise IndexError(f"rows {int(wanted.min())}..{int(wanted.max())} of a {self.shape[0]}-row table")
        out = torch.empty(wanted.numel(), kp, dtype=torch.int8)
        assert lib is not None  # a packed table was packed by it
        lib.lib.rl_vnni_rows(self.q.data_ptr(), kp, wanted.data_ptr(), wanted.numel(), out.data_ptr())
        return out if ids is None else out.view(*ids.shape, kp)

    def lookup(self, ids: Tensor) -> Tensor:
        """The rows of ``ids`` (any shape): ``[*ids.shape, K]`` in the compute dtype, read exactly from the
        store where the table has its source, else dequantized."""
        if self.source is not None:
            return self.source.rows(ids.cpu()).to(ids.device, self.dtype)
        k = self.shape[1]
        rows = self.codes(ids)[..., :k].float() * self.scale[ids].float()[..., None]
        if self.rotation:  # (W H / n) H == W
            rows = rotate_rows(rows, self.rotation)[..., : self.width]
        return rows.to(self.dtype)

    def _logits_for(self, m: int) -> Tensor:
        """An fp32 ``[m, V]`` buffer for a call's logits: one of the :data:`KEPT_LOGITS` kept ones that no tensor
        handed out still views (its storage held by the list alone), else a new one, kept in place of a free one too
        small, or beside the others while fewer are kept. A batch's logits are tens of MB, which the allocator maps
        afresh each call and the kernel zeroes page by page as the product first writes them (Gemma 3 270M's head at
        32 rows, AVX2 body: 129.5 against 117.5 ms at 1 thread, 71.7 against 66.0 at 2). Logits the caller keeps are
        never written over: a step's buffer is free again only once its logits and every view of them are gone."""
        v = self.shape[0]
        free = [b for b in self._logits if _unviewed(b)]
        fits = next((b for b in free if b.shape[0] >= m), None)
        if fits is not None:
            return fits[:m]
        if free:
            self._logits.remove(free[0])
        logits = torch.empty(m, v, dtype=torch.float32)
        if len(self._logits) < KEPT_LOGITS and logits.nbytes <= KEPT_LOGITS_BYTES:
            self._logits.append(logits)
        return logits

    def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """``x @ table.T + bias``: logits ``[..., V]`` in ``x``'s dtype, or fp32 where int8 activations meet our
        epilogue (:meth:`~robot_llm.llm.store.gemv.Kernels.scale_int32`)."""
        v, k = self.shape
        lead = x.shape[:-1]
        m, cpu = x.numel() // x.shape[-1], x.device.type == "cpu"
        packed = self.offset is not None  # vnni.c's codes: our int8 product at every row count
        assert cpu or not packed, "a packed table is multiplied on the CPU by the kernels that packed it"
        fast = packed or (int8_activations_for(m, x.dtype) and not _few_rows_read_faster(m))
        quantized_rows = cpu and self.rotation and fast
        few = cpu and not quantized_rows and m <= HEAD_FUSED_ROWS and gemv_available()
        if few or (cpu and not quantized_rows and matmul_serves("int8", m)):
            lib = kernels()
            assert lib is not None  # few rows or many, ours: they pad and rotate x themselves
            y = (lib.int8_gemv if few else lib.int8_matmul)(x, self.q, self.scale, v, self.rotation)
            return (y if bias is None else y + bias).reshape(*lead, v)
        if quantized_rows:
            if self._scale32 is None:
                self._scale32 = self.scale.float()
            ours = int8_kernels_for(m)
            multiplies = ours is not None and (packed or ours.matmul is not None)
            out, acc = self._logits_for(m) if multiplies else None, None
            if not multiplies:  # torch's product: its int32 sums into a buffer kept
                if self._acc is None or self._acc.shape[0] < m:
                    self._acc = torch.empty(m, v, dtype=torch.int32)
                acc = self._acc[:m]
            # fp32 logits in our epilogue's one pass (the forward pass wants fp32), not rounded to x's dtype and back.
            dtype = torch.float32 if kernels() is not None else x.dtype
            y = int8_gemm(x, self.q, self._scale32, self.rotation, acc, ours, out, dtype, self.offset)
            return (y if bias is None else y + bias).reshape(*lead, v)
        if self.rotation:
            x = rotate_rows(F.pad(x, (0, k - x.shape[-1])), self.rotation)
        flat = x.reshape(-1, k)
        if m <= HEAD_FUSED_ROWS:
            rows = flat.to(torch.bfloat16)
            if self.q.shape[1] != k:
                rows = F.pad(rows, (0, self.q.shape[1] - k))
            y = torch.ops.aten._weight_int8pack_mm(rows, self.q, self.scale).to(x.dtype)
        else:
            y = torch.empty(flat.shape[0], v, dtype=x.dtype)
            scale = self.scale.to(x.dtype)
            if self._block is None or self._block.dtype != x.dtype:
                self._block = torch.empty(min(v, WIDEN_BLOCK_ROWS), k, dtype=x.dtype)
            for a in range(0, v, WIDEN_BLOCK_ROWS):
                b = min(v, a + WIDEN_BLOCK_ROWS)
                block = self._block[: b - a].copy_(self.q[a:b, :k])
                y[:, a:b] = F.linear(flat, block) * scale[a:b]
        if bias is not None:
            y += bias
        return y.reshape(*lead, v)
