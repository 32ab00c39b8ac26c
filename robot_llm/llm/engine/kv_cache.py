"""The KV cache every family shares, and the view of it one layer gets.

With a :class:`KVCache` the left pads of a batch are stored in the cache and
every step writes slots ``cache.length .. cache.length+T-1`` of all rows. The
cache holds ``num_key_value_heads`` heads per layer (grouped-query attention
shares each among several query heads); sliding-window layers use the same
slots with a mask that hides keys ``window`` or more positions back. The cache
tensors may live on another device than the compute: each layer copies the
slice it reads, or, for a cache that attends where it is stored
(``KVCache.attend_where_stored``, FlexGen's CPU attention), a decode step's
attention runs on the cache's device in fp32 and only ``q`` and the output move.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from robot_llm.llm.engine.kvquant import KV_QUANTIZED, QuantKV, materialize, store
from robot_llm.llm.engine.slots import SlotState, StepLayout
from robot_llm.llm.families.config import ModelConfig


@dataclass
class KVCache:
    """Per-layer rotated keys and values of every processed slot.

    ``k[i]``/``v[i]`` are preallocated ``[B, max_len, kv_heads, head_dim]`` tensors for
    layer ``i``; slots ``0 .. length-1`` are written. ``pad[b]`` (CPU long tensor) is the
    number of left-pad slots of row ``b``; those slots are never attended to.
    ``slots`` says which written slots belong to their row and at which position (see
    :mod:`robot_llm.llm.engine.slots`): a finished row is masked rather than copied out, and
    ``layout``, when set, is the layout of the next step instead of a plain append.
    ``prefix``, when set (:meth:`share_prefix`), is a one-row cache of the tokens every
    row starts with: stored once, attended by every row, whose own tokens follow it.
    A cache allocated with ``kv_dtype`` ``int8``/``int4`` keeps ``k``/``v`` compressed
    (:class:`~robot_llm.llm.engine.kvquant.QuantKV`), dequantized one layer at a time for attention.
    ``attend_where_stored``: a one-token (decode) step attends on the cache's own device in
    fp32 instead of copying the cache to the compute device (a KV cache in RAM on a GPU
    machine: its bytes stay put, ``q`` and the attention output move).
    """

    k: list[Tensor | QuantKV]
    v: list[Tensor | QuantKV]
    pad: Tensor
    slots: SlotState
    length: int = 0
    layout: StepLayout | None = None
    prefix: KVCache | None = None
    attend_where_stored: bool = False

    @classmethod
    def allocate(
        cls,
        cfg: ModelConfig,
        batch: int,
        max_len: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        pad: Tensor | None = None,
        kv_dtype: str | None = None,
    ) -> KVCache:
        """An empty cache for ``batch`` rows of up to ``max_len`` slots (``kv_dtype`` int8/int4: compressed)."""
        shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)

        def one() -> Tensor | QuantKV:
            if kv_dtype in KV_QUANTIZED:
                return QuantKV.empty(shape, kv_dtype, device)
            return torch.zeros(shape, dtype=dtype, device=device)

        k = [one() for _ in range(cfg.num_layers)]
        v = [one() for _ in range(cfg.num_layers)]
        pad_t = torch.zeros(batch, dtype=torch.long) if pad is None else pad.to("cpu", torch.long)
        if pad_t.shape != (batch,):
            raise ValueError(f"pad must have shape ({batch},), got {tuple(pad_t.shape)}")
        return cls(k=k, v=v, pad=pad_t, slots=SlotState.empty(batch, max_len, pad_t), length=0)

    @property
    def batch(self) -> int:
        """Number of rows."""
        return int(self.pad.shape[0])

    @property
    def max_len(self) -> int:
        """Number of slots per row."""
        return int(self.k[0].shape[1]) if self.k else 0

    def layer(self, index: int) -> LayerKV:
        """The cache view handed to a family's layer function for layer ``index``."""
        if self.prefix is None:
            return LayerKV(self.k[index], self.v[index], self.length, attend_where_stored=self.attend_where_stored)
        p = self.prefix
        return LayerKV(
            self.k[index],
            self.v[index],
            self.length,
            _head(p.k[index], p.length),
            _head(p.v[index], p.length),
            self.attend_where_stored,
        )

    def share_prefix(self, prefix: KVCache) -> None:
        """Let every row continue ``prefix`` (a filled one-row cache) before its own tokens; call before any step."""
        if self.length or prefix.batch != 1 or not bool(prefix.slots.valid[0, : prefix.length].all()):
            raise ValueError("a shared prefix is a filled one-row cache, shared before the first step")
        self.prefix = prefix
        self.slots.share_prefix(prefix.length)

    def step_layout(self, steps: int) -> StepLayout:
        """The layout of the next step of ``steps`` tokens: the one set in ``layout``, else a plain append."""
        if self.length + steps > self.max_len:
            raise ValueError(f"KV cache overflow: {self.length} + {steps} > {self.max_len} slots")
        if self.layout is None:
            return self.slots.append_layout(self.length, steps)
        if tuple(self.layout.real.shape) != (self.batch, steps):
            raise ValueError(
                f"the step layout is for {tuple(self.layout.real.shape)} tokens, got {(self.batch, steps)}"
            )
        return self.layout

    def advance(self, steps: int) -> None:
        """Record that every layer has written ``steps`` more slots (a step's unkept tail is reused)."""
        self.length = self.slots.commit(self.length, self.step_layout(steps))
        self.layout = None


@dataclass(frozen=True)
class LayerKV:
    """One layer's cache tensors and the first slot the current step writes."""

    k: Tensor | QuantKV
    v: Tensor | QuantKV
    start: int
    prefix_k: Tensor | QuantKV | None = None
    prefix_v: Tensor | QuantKV | None = None
    attend_where_stored: bool = False

    def rows(self, a: int, b: int) -> LayerKV:
        """The view of rows ``a:b`` (the shared prefix stays whole)."""
        k, v = _rows(self.k, a, b), _rows(self.v, a, b)
        return LayerKV(k, v, self.start, self.prefix_k, self.prefix_v, self.attend_where_stored)

    def update(self, k: Tensor, v: Tensor, fused: bool = False) -> tuple[Tensor | QuantKV, Tensor | QuantKV]:
        """Write this step's ``k``/``v`` ``[B, T, kv, hd]`` into the cache; return every key/value to attend.

        ``fused``: the caller's attention reads a bf16 cache as stored (see :func:`reads_in_place`), and an int8
        CPU cache too at a decode step: its codes and scales come back as they are (views), and
        :func:`~robot_llm.llm.families.attention.grouped_attention` reads them in place, or dequantizes them where
        its kernel cannot.

        With a shared prefix, its slots come first, broadcast to every row for this step only.
        The keys come back where attention runs (:func:`attend_with`): on ``k``'s device in its
        dtype, or, for a decode step of a cache that attends where it is stored, on the cache's
        device in fp32 (a CPU has no fast fp16, and the cache is read once either way).
        """
        end = self.start + k.shape[1]
        store(self.k, self.start, k)
        store(self.v, self.start, v)
        device, dtype = k.device, k.dtype
        if self.attend_where_stored and k.shape[1] == 1:
            device, dtype = self.k.device, torch.float32
        elif fused and k.shape[1] == 1 and reads_in_place(self.k, k):
            dtype = self.k.dtype
        elif fused and k.shape[1] == 1 and self.prefix_k is None and int8_on_cpu(self.k, k):
            return _head(self.k, end), _head(self.v, end)
        keys, values = materialize(self.k, end, device, dtype), materialize(self.v, end, device, dtype)
        if self.prefix_k is None or self.prefix_v is None:
            return keys, values
        length = self.prefix_k.shape[1]
        pk = materialize(self.prefix_k, length, device, dtype)
        pv = materialize(self.prefix_v, length, device, dtype)
        shape = (k.shape[0], *pk.shape[1:])
        return torch.cat((pk.expand(shape), keys), dim=1), torch.cat((pv.expand(shape), values), dim=1)


def reads_in_place(cache: Tensor | QuantKV, k: Tensor) -> bool:
    """True when a decode step attends a bf16 CPU cache under fp32 compute in the cache's own dtype.

    Casting the live slots up to fp32 every layer of every step writes and reads them again
    (a batch-32 decode step over 580 keys, Gemma 3 270M shapes, 1 thread: 5.9 ms a layer against
    2.5 for an fp32 cache, AVX2 kernels); torch's fused attention reads bf16 keys and values as
    they are, accumulating in fp32 (2.7 ms), at half the cache's bytes. A prefill keeps the cast:
    its attention is a small share of its step, and its numbers stay fp32's. An fp16 cache is cast:
    the CPU's fused fp16 attention is 4x slower than fp32 (12 against 3 ms).
    """
    return (
        isinstance(cache, Tensor)
        and cache.dtype == torch.bfloat16
        and k.dtype == torch.float32
        and cache.device.type == k.device.type == "cpu"
    )


def int8_on_cpu(cache: Tensor | QuantKV, k: Tensor) -> bool:
    """True when a decode step's ``k`` goes into an int8 cache on the CPU, whose codes and scales the attention then
    reads as stored (a batch-32 step over 580 keys had dequantized every layer's live slots: a copy per layer)."""
    return isinstance(cache, QuantKV) and cache.low is None and cache.device.type == k.device.type == "cpu"


def attend_with(q: Tensor, mask: Tensor, keys: Tensor | QuantKV, *, keep_dtype: bool = False) -> tuple[Tensor, Tensor]:
    """``q`` and ``mask`` moved to where ``keys`` are (:meth:`LayerKV.update`), ``q`` in their dtype; a no-op when they
    are there (an int8 cache read as stored: where q already is). ``keep_dtype``: ``q`` keeps its own, for
    :func:`~robot_llm.llm.families.attention.grouped_attention`, whose ``attend.c`` reads an fp32 query over a bf16
    cache as it is (a cast to bf16 rounded the query and the output, and cost two copies a layer), and which casts it
    where torch computes."""
    if isinstance(keys, QuantKV):
        return q, mask
    return q.to(keys.device, q.dtype if keep_dtype else keys.dtype), mask.to(keys.device)


def _rows(t: Tensor | QuantKV, a: int, b: int) -> Tensor | QuantKV:
    return t.rows(a, b) if isinstance(t, QuantKV) else t[a:b]


def _head(t: Tensor | QuantKV, end: int) -> Tensor | QuantKV:
    return t.head(end) if isinstance(t, QuantKV) else t[:, :end]
