"""Compressed KV cache: one layer's keys or values stored in int8 or int4, group-wise.

A group is one head's ``head_dim`` values of one slot (``head_dim`` <= 256 in
every family we run, 80 for YaLM-100B), so a slot can be written on its own,
step by step, without touching its neighbours. int8 is symmetric (fp16 scale
per group: 8.25 bits per value at head_dim 64); int4 is asymmetric like the
int4 weights (:mod:`robot_llm.llm.store.quant`: fp16 step and minimum per group,
two codes per byte, the group's first half in the low nibbles): 4.5 bits.
YaLM-100B's 3.28 MB of fp16 KV per token becomes 1.7 MB (int8) or 0.92 MB
(int4), so a RAM-limited machine holds about 2x or 3.5x the batch.

The cache is dequantized one layer at a time where attention runs (on the
compute device, from the compressed bytes: moving them to a GPU costs 2-4x
less than moving fp16), into a temporary of that one layer's attended slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from robot_llm.llm.store.quant import KV_QUANTIZED, kv_bits_per_value

__all__ = ["KV_QUANTIZED", "QuantKV", "kv_bits_per_value", "materialize", "store"]


@dataclass
class QuantKV:
    """Keys or values of one layer, ``[B, S, heads, head_dim]`` logically, stored compressed."""

    codes: Tensor  # int8 [B, S, H, D] | uint8 [B, S, H, D/2]
    scale: Tensor  # fp16 [B, S, H, 1]: int8 scale | int4 step
    low: Tensor | None  # fp16 [B, S, H, 1]: int4 group minimum
    head_dim: int

    @classmethod
    def empty(cls, shape: tuple[int, int, int, int], kv_dtype: str, device: torch.device | str) -> QuantKV:
        """A zero cache of logical ``shape`` in ``kv_dtype`` (``int8`` or ``int4``)."""
        B, S, H, D = shape
        group = (B, S, H, 1)
        if kv_dtype == "int8":
            return cls(
                torch.zeros(shape, dtype=torch.int8, device=device),
                torch.zeros(group, dtype=torch.float16, device=device),
                None,
                D,
            )
        if kv_dtype != "int4" or D % 2:
            raise ValueError(f"KV dtype {kv_dtype!r} needs int8, or int4 with an even head_dim (got {D})")
        codes = torch.zeros((B, S, H, D // 2), dtype=torch.uint8, device=device)
        scale = torch.zeros(group, dtype=torch.float16, device=device)
        return cls(codes, scale, torch.zeros(group, dtype=torch.float16, device=device), D)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Logical shape ``[B, S, heads, head_dim]``."""
        B, S, H, _ = self.codes.shape
        return (B, S, H, self.head_dim)

    @property
    def device(self) -> torch.device:
        """Where the compressed bytes live."""
        return self.codes.device

    def rows(self, a: int, b: int) -> QuantKV:
        """Rows ``a:b`` (views)."""
        return QuantKV(self.codes[a:b], self.scale[a:b], None if self.low is None else self.low[a:b], self.head_dim)

    def head(self, end: int) -> QuantKV:
        """Slots ``0:end`` (views)."""
        low = None if self.low is None else self.low[:, :end]
        return QuantKV(self.codes[:, :end], self.scale[:, :end], low, self.head_dim)

    def write(self, start: int, x: Tensor) -> None:
        """Quantize ``x [B, T, heads, head_dim]`` into slots ``start:start+T``."""
        end = start + x.shape[1]
        x = x.to(self.device, torch.float32)
        if self.low is None:
            scale = (x.abs().amax(dim=-1, keepdim=True) / 127).clamp_min(2.0**-14).half()
            self.codes[:, start:end] = torch.round(x / scale.float()).clamp_(-127, 127).to(torch.int8)
            self.scale[:, start:end] = scale
            return
        low = x.amin(dim=-1, keepdim=True).half()
        step = ((x.amax(dim=-1, keepdim=True) - low.float()) / 15).clamp_min(2.0**-14).half()
        q = torch.round((x - low.float()) / step.float()).clamp_(0, 15).to(torch.uint8)
        half = self.head_dim // 2
        self.codes[:, start:end] = q[..., :half] | (q[..., half:] << 4)
        self.scale[:, start:end], self.low[:, start:end] = step, low

    def read(self, end: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """Slots ``0:end`` dequantized on ``device`` in ``dtype`` (the compressed bytes are what moves)."""
        codes = self.codes[:, :end].to(device)
        scale = self.scale[:, :end].to(device, dtype)
        if self.low is None:
            return codes.to(dtype).mul_(scale)
        byte = codes.to(dtype)
        high = torch.floor(byte / 16)
        values = torch.cat([byte.add_(high, alpha=-16), high], dim=-1)
        return values.mul_(scale).add_(self.low[:, :end].to(device, dtype))


def materialize(t: Tensor | QuantKV, end: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Slots ``0:end`` of a plain or compressed cache tensor, on ``device`` in ``dtype``."""
    if isinstance(t, QuantKV):
        return t.read(end, device, dtype)
    return t[:, :end].to(device, dtype)


def store(t: Tensor | QuantKV, start: int, x: Tensor) -> None:
    """Write ``x`` into slots ``start:start+T`` of a plain or compressed cache tensor."""
    if isinstance(t, QuantKV):
        t.write(start, x)
    else:
        t[:, start : start + x.shape[1]] = x.to(t.device, t.dtype)
