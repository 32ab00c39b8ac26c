"""What a model family supplies, and the machinery every family shares.

A family (:mod:`~robot_llm.llm.yalm`, :mod:`~robot_llm.llm.llama`,
:mod:`~robot_llm.llm.gemma3`) is a config dataclass (weight names and shapes
per streamed module, see :mod:`robot_llm.llm.config`) plus a :class:`Family`:
its rotary frequencies, its embedding, one transformer layer and its output
head, as plain functions over ``dict[str, Tensor]`` weights. The in-memory
model here, the streaming engine, the store, the planner and generation only
ever call these. One forward step over ``ids [B, T]``::

    fam = family_of(cfg)
    step = prepare_step(cfg, fam.rope(cfg), cache, T, pad, device, dtype, batch=B)
    x = fam.embed(ids, resident, cfg)                  # resident: {"embedding": ..., "output": ...}
    for i in range(cfg.num_layers):
        x = fam.layer(x, layers[i], cfg, i, step, cache.layer(i) if cache is not None else None)
    if cache is not None:
        cache.advance(T)
    logits = fam.head(x, resident, cfg).float()

Batching prompts of different lengths: left-pad every row to the same length
and pass ``pad[b]`` (the number of pad slots at the front of row ``b``). Row
``b``'s rotary position of slot ``s`` is ``s - pad[b]`` (BOS at position 0),
and pad slots are masked out as keys, so each row computes exactly what it
would compute alone. With a :class:`KVCache` the pads are stored in the cache
and every step writes slots ``cache.length .. cache.length+T-1`` of all rows.
The cache holds ``num_key_value_heads`` heads per layer (grouped-query
attention shares each among several query heads); sliding-window layers use
the same slots with a mask that hides keys ``window`` or more positions back.
The cache tensors may live on another device than the compute: each layer
copies the slice it reads, or, for a cache that attends where it is stored
(``KVCache.attend_where_stored``, FlexGen's CPU attention), a decode step's
attention runs on the cache's device in fp32 and only ``q`` and the output move.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from robot_llm.llm.config import ModelConfig, module_plan
from robot_llm.llm.kvquant import KV_QUANTIZED, QuantKV, materialize, store
from robot_llm.llm.quant import FUSED_MAX_ROWS, PackedInt4, PackedInt8, int4_linear, int8_linear
from robot_llm.llm.slots import SlotState, StepLayout

#: A module's weights by key. The streaming engine may hand a layer's matrices over packed
#: (:class:`PackedInt4`/:class:`PackedInt8`): families multiply them only through :func:`linear`.
Params = dict[str, Tensor]
Resident = dict[str, Params]

#: Compute dtypes, by name.
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map ``"fp32"``/``"bf16"``/``"fp16"`` (or a torch dtype) to a supported torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported compute dtype {dtype}")
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown compute dtype {dtype!r}; use one of {', '.join(DTYPES)}") from None


def linear(x: Tensor, weight: Tensor | PackedInt4 | PackedInt8, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` for a streamed matrix: a plain tensor, or one the engine handed over packed.

    A packed matrix runs torch's fused kernel when ``x`` is a bf16 CPU tensor of
    at most :data:`~robot_llm.llm.quant.FUSED_MAX_ROWS` rows (decode steps: it
    never dequantizes); otherwise it is dequantized once into its buffer and
    multiplied densely (a prefill, fp32 compute, another device).
    """
    if isinstance(weight, Tensor):
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    if x.device.type == "cpu" and x.dtype == torch.bfloat16 and rows <= FUSED_MAX_ROWS:
        y = int4_linear(x, weight) if isinstance(weight, PackedInt4) else int8_linear(x, weight)
        return y if bias is None else y + bias
    return F.linear(x, weight.dense(x.dtype), bias)


# --------------------------------------------------------------------------- KV cache


@dataclass
class KVCache:
    """Per-layer rotated keys and values of every processed slot.

    ``k[i]``/``v[i]`` are preallocated ``[B, max_len, kv_heads, head_dim]`` tensors for
    layer ``i``; slots ``0 .. length-1`` are written. ``pad[b]`` (CPU long tensor) is the
    number of left-pad slots of row ``b``; those slots are never attended to.
    ``slots`` says which written slots belong to their row and at which position (see
    :mod:`robot_llm.llm.slots`): a finished row is masked rather than copied out, and
    ``layout``, when set, is the layout of the next step instead of a plain append.
    ``prefix``, when set (:meth:`share_prefix`), is a one-row cache of the tokens every
    row starts with: stored once, attended by every row, whose own tokens follow it.
    A cache allocated with ``kv_dtype`` ``int8``/``int4`` keeps ``k``/``v`` compressed
    (:class:`~robot_llm.llm.kvquant.QuantKV`), dequantized one layer at a time for attention.
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

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write this step's ``k``/``v`` ``[B, T, kv, hd]`` into the cache; return every key/value to attend.

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
        keys, values = materialize(self.k, end, device, dtype), materialize(self.v, end, device, dtype)
        if self.prefix_k is None or self.prefix_v is None:
            return keys, values
        length = self.prefix_k.shape[1]
        pk = materialize(self.prefix_k, length, device, dtype)
        pv = materialize(self.prefix_v, length, device, dtype)
        shape = (k.shape[0], *pk.shape[1:])
        return torch.cat((pk.expand(shape), keys), dim=1), torch.cat((pv.expand(shape), values), dim=1)


def attend_with(q: Tensor, mask: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
    """``q`` and ``mask`` moved to where ``keys`` are (:meth:`LayerKV.update`); a no-op when they are there."""
    return q.to(keys.device, keys.dtype), mask.to(keys.device)


def _rows(t: Tensor | QuantKV, a: int, b: int) -> Tensor | QuantKV:
    return t.rows(a, b) if isinstance(t, QuantKV) else t[a:b]


def _head(t: Tensor | QuantKV, end: int) -> Tensor | QuantKV:
    return t.head(end) if isinstance(t, QuantKV) else t[:, :end]


# --------------------------------------------------------------------------- step metadata


@dataclass(frozen=True)
class StepInfo:
    """Everything a layer needs about the current step besides weights and activations.

    ``positions [B, T]`` rotary positions; ``mask [B, 1, T, S]`` bool, True where
    attention is forbidden (``S`` = slots visible after this step); ``windows[w]`` the
    same mask for a sliding window of ``w`` positions; ``rotary[name]`` the
    ``(cos, sin)`` factors ``[B, T, 1, head_dim]`` of the family's rotary table ``name``,
    already in the compute dtype.
    """

    positions: Tensor
    mask: Tensor
    windows: dict[int, Tensor]
    rotary: dict[str, tuple[Tensor, Tensor]]

    def mask_for(self, window: int | None) -> Tensor:
        """The attention mask of a layer with this sliding window (None: the causal mask)."""
        return self.mask if window is None else self.windows[window]

    def rows(self, a: int, b: int) -> StepInfo:
        """The step metadata of rows ``a:b``."""
        if a == 0 and b == self.positions.shape[0]:
            return self
        return StepInfo(
            positions=self.positions[a:b],
            mask=self.mask[a:b],
            windows={w: m[a:b] for w, m in self.windows.items()},
            rotary={name: (c[a:b], s[a:b]) for name, (c, s) in self.rotary.items()},
        )


def prepare_step(
    cfg: ModelConfig,
    rope: dict[str, Tensor],
    cache: KVCache | None,
    num_tokens: int,
    pad: Tensor | None,
    device: torch.device | str,
    dtype: torch.dtype,
    batch: int | None = None,
) -> StepInfo:
    """Build positions, masks and rotary factors for a step feeding ``num_tokens`` per row.

    ``rope`` maps each rotary table's name to its float32 inverse frequencies
    ``[head_dim / 2]`` (:attr:`Family.rope`). With a cache, ``pad`` must be None (the
    cache's slot state is used) and the step covers slots ``cache.length ..
    cache.length + num_tokens - 1``, laid out by :meth:`KVCache.step_layout`. Without
    a cache, ``pad`` (default: no padding) describes the left padding of the ``batch`` rows.
    """
    if cache is not None:
        if pad is not None:
            raise ValueError("pass the padding through the cache, not both")
        layout = cache.step_layout(num_tokens)
        positions = layout.positions
        mask = cache.slots.forbidden(cache.length, layout)
        key_pos = cache.slots.key_positions(cache.length, layout)
    else:
        if pad is None:
            if batch is None:
                raise ValueError("prepare_step needs pad or batch when there is no cache")
            pad = torch.zeros(batch, dtype=torch.long)
        pad_t = pad.to("cpu", torch.long)
        slots = torch.arange(num_tokens)
        positions = (slots[None, :] - pad_t[:, None]).clamp_min(0)
        future = slots[None, :] > slots[:, None]  # [T, S]
        padded = (slots[None, :] < pad_t[:, None])[:, None, None, :]  # [B, 1, 1, S]
        mask = future[None, None] | padded
        key_pos = positions
    if int(positions.max()) >= cfg.max_position_embeddings:
        raise ValueError(
            f"position {int(positions.max())} exceeds max_position_embeddings {cfg.max_position_embeddings}"
        )
    windows = {}
    for w in {cfg.sliding_window(i) for i in range(cfg.num_layers)} - {None}:
        assert w is not None
        too_far = key_pos[:, None, :] <= positions[:, :, None] - w  # a key w or more positions back
        windows[w] = (mask | too_far[:, None]).to(device)
    positions = positions.to(device)
    rotary = {}
    for name, inv_freq in rope.items():
        # float32 angles exactly as torch.outer(t, inv_freq) computes them, then cos/sin, then the dtype.
        freqs = positions[..., None].float() * inv_freq.to(device)
        emb = torch.cat((freqs, freqs), dim=-1)
        rotary[name] = (emb.cos().to(dtype)[:, :, None, :], emb.sin().to(dtype)[:, :, None, :])
    return StepInfo(positions=positions, mask=mask.to(device), windows=windows, rotary=rotary)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half ("NeoX") rotary on ``x [B, T, heads, hd]`` with ``cos``/``sin`` ``[B, T, 1, hd]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


# --------------------------------------------------------------------------- the family interface


@dataclass(frozen=True)
class Family:
    """The functions that make one model family; everything else is shared.

    * ``rope(cfg)``: name -> float32 inverse frequencies of each rotary table the layers use;
    * ``embed(ids, resident, cfg)``: ``ids [B, T]`` -> hidden states ``[B, T, H]``;
    * ``layer(x, params, cfg, index, step, kv)``: one transformer layer; with ``kv`` it
      writes the step's keys/values into the cache and attends to all filled slots;
    * ``head(x, resident, cfg)``: hidden states -> logits ``[B, T, V]`` in x's dtype.

    ``resident`` maps module kinds (``embedding``, ``projector``, ``output``) to their
    weights; every function computes in the dtype and on the device of its tensors.
    """

    name: str
    rope: Callable[[Any], dict[str, Tensor]]
    embed: Callable[[Tensor, Resident, Any], Tensor]
    layer: Callable[[Tensor, Params, Any, int, StepInfo, LayerKV | None], Tensor]
    head: Callable[[Tensor, Resident, Any], Tensor]


def family_of(cfg: ModelConfig) -> Family:
    """The :class:`Family` that computes models of this config."""
    from robot_llm.llm import gemma3, llama, yalm

    families = {"yalm": yalm.FAMILY, "llama": llama.FAMILY, "gemma3": gemma3.FAMILY}
    return families[cfg.family]


# --------------------------------------------------------------------------- models


class ForwardModel(Protocol):
    """What :mod:`robot_llm.llm.generate` needs from a model (in-memory or streamed)."""

    config: Any

    def new_cache(self, batch: int, max_len: int, pad: Tensor | None = None) -> KVCache:
        """An empty cache for ``batch`` left-padded rows (``pad[b]`` pad slots) of ``max_len`` slots."""
        ...

    def forward(
        self,
        ids: Tensor,
        cache: KVCache | None = None,
        pad: Tensor | None = None,
        *,
        last_only: bool = False,
    ) -> Tensor:
        """Run ``ids [B, T]`` (CPU long); return fp32 CPU logits ``[B, T, V]`` (``[B, 1, V]`` if last_only).

        With ``cache`` the tokens continue the cached rows and the cache is
        advanced by ``T``; without it ``pad`` gives the left padding of each row.
        """
        ...


@dataclass(frozen=True)
class Weights:
    """All weights of a model: the resident modules by kind, and the transformer layers."""

    resident: Resident
    layers: list[Params]

    def to(self, device: torch.device | str, dtype: torch.dtype) -> Weights:
        """Copy every tensor to ``device`` and ``dtype``."""

        def conv(p: Params) -> Params:
            return {k: t.to(device=device, dtype=dtype) for k, t in p.items()}

        return Weights(resident={k: conv(p) for k, p in self.resident.items()}, layers=[conv(p) for p in self.layers])


class InMemoryModel:
    """A whole model held in memory, any family; implements :class:`ForwardModel`."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Weights,
        *,
        dtype: str | torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = cfg
        self.family = family_of(cfg)
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        self.weights = weights.to(self.device, self.dtype)
        self.rope = self.family.rope(cfg)

    def new_cache(self, batch: int, max_len: int, pad: Tensor | None = None) -> KVCache:
        """An empty cache on the model's device in the compute dtype."""
        return KVCache.allocate(self.config, batch, max_len, dtype=self.dtype, device=self.device, pad=pad)

    @torch.inference_mode()
    def forward(
        self,
        ids: Tensor,
        cache: KVCache | None = None,
        pad: Tensor | None = None,
        *,
        last_only: bool = False,
    ) -> Tensor:
        """See :meth:`ForwardModel.forward`."""
        cfg, w, fam = self.config, self.weights, self.family
        B, T = ids.shape
        step = prepare_step(cfg, self.rope, cache, T, pad, self.device, self.dtype, batch=B)
        x = fam.embed(ids.to(self.device), w.resident, cfg)
        for i, layer in enumerate(w.layers):
            x = fam.layer(x, layer, cfg, i, step, cache.layer(i) if cache is not None else None)
        if cache is not None:
            cache.advance(T)
        if last_only:
            x = x[:, -1:]
        return fam.head(x, w.resident, cfg).float().cpu()

    __call__ = forward


def random_weights(cfg: ModelConfig, seed: int = 0, std: float = 0.02, dtype: torch.dtype = torch.float32) -> Weights:
    """Random weights with the config's shapes (for tests, demos and benchmarks).

    Norm gains are drawn around 1 and biases around 0 so that every parameter
    matters; ``std`` scales the matrices.
    """
    g = torch.Generator().manual_seed(seed)

    def draw(name: str, shape: tuple[int, ...]) -> Tensor:
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        if len(shape) == 2:
            t = t * std
        elif name.endswith("norm.weight"):
            t = 1.0 + 0.1 * t
        else:
            t = 0.1 * t
        return t.to(dtype)

    resident: Resident = {}
    layers: list[Params] = []
    for kind, _, shapes in module_plan(cfg):
        params = {k: draw(k, s) for k, s in shapes.items()}
        if kind == "layer":
            layers.append(params)
        else:
            resident[kind] = params
    return Weights(resident=resident, layers=layers)


# --------------------------------------------------------------------------- pieces the HF families share


def rope_inv_freq(base: float, dim: int) -> Tensor:
    """Default rotary inverse frequencies ``1 / base^(2i/dim)`` in float32, as transformers computes them."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def grouped_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float | None = None
) -> Tensor:
    """Attention of ``q [B, T, n, hd]`` over ``k``/``v`` ``[B, S, kv, hd]``, query head ``j`` using KV head
    ``j // (n / kv)``; ``mask [B, 1, T, S]`` True where forbidden. Returns ``[B, T, n * hd]``.

    As transformers' eager attention: scores scaled after the matmul, optional tanh soft-capping,
    softmax in float32, probabilities cast back to the compute dtype. Masked scores become the
    dtype's minimum (not -inf) so that a fully masked row (a pad slot) stays finite.
    """
    B, T, n, hd = q.shape
    group = n // k.shape[2]
    q = q.transpose(1, 2)
    k = k.transpose(1, 2).repeat_interleave(group, dim=1)
    v = v.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(1, 2).reshape(B, T, n * hd)
