"""What a model family supplies, and the machinery every family shares.

A family (:mod:`~robot_llm.llm.families.yalm`, :mod:`~robot_llm.llm.families.llama`,
:mod:`~robot_llm.llm.families.gemma3`) is a config dataclass (weight names and shapes
per streamed module, see :mod:`robot_llm.llm.families.config`) plus a :class:`Family`:
its rotary frequencies, its embedding, one transformer layer and its output
head, as plain functions over ``dict[str, Tensor]`` weights. The in-memory
model (:mod:`robot_llm.llm.engine.memory`), the streaming engine, the store, the
planner and generation only ever call these; :func:`~robot_llm.llm.families.registry.family_of`
finds a config's family. One forward step over ``ids [B, T]`` is :func:`forward_pass`, the one
loop every engine runs (in-memory, streaming, DeepSpeed); only where the weights come from differs::

    fam = family_of(cfg)
    step = prepare_step(cfg, fam.rope(cfg), cache, T, pad, device, dtype, batch=B)
    logits, hidden = forward_pass(
        ids, step, cache,                              # resident: {"embedding": ..., "output": ...}
        embed=lambda ids: fam.embed(ids, resident, cfg),
        layers=((f"layer {i}", bind_layer(fam, p, cfg, i)) for i, p in enumerate(layers)),
        head=lambda x: fam.head(x, resident, cfg),
        watch=FiniteWatch(),
    )

Batching prompts of different lengths: left-pad every row to the same length and pass ``pad[b]`` (the number of
pad slots at the front of row ``b``). Row ``b``'s rotary position of slot ``s`` is ``s - pad[b]`` (BOS at position
0), and pad slots are masked out as keys, so each row computes exactly what it would compute alone. The KV cache
and what a layer sees of it are :mod:`robot_llm.llm.engine.kv_cache`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from robot_llm.llm.engine.finite import FiniteWatch
from robot_llm.llm.engine.kv_cache import KVCache, LayerKV
from robot_llm.llm.families.config import ModelConfig, module_plan
from robot_llm.llm.store.gemv import gemv_available, kernels, matmul_serves
from robot_llm.llm.store.int8act import (
    int8_activations_for,
    int8_dynamic_linear,
    int8_dynamic_linears,
    int8_kernels_for,
    rotate_input,
)
from robot_llm.llm.store.qhead import QuantizedTable
from robot_llm.llm.store.quant import (
    FUSED_MAX_ROWS,
    PackedInt4,
    PackedInt8,
    int4_kernel_reads_stored_layout,
    int4_linear,
    int8_linear,
    int8_linear_widened,
)

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


def int8_activations_form(x: Tensor, weight: object, rows: int) -> PackedInt8 | None:
    """The rotated int8 matrix a CPU call of ``rows`` rows of ``x`` multiplies with int8 activations
    (:func:`~robot_llm.llm.store.int8act.int8_activations_for`), or None where the call takes another path: an int8
    matrix rotated in place, or an int4 one's rotated int8 copy (both RAM-homed, made once when the engine opens; a
    streamed matrix's copy would cost a pass each time). The copy beats the fused int4 kernel from 8 rows (AMX, 1
    thread, 2048 x 640: 0.34 against 1.40 ms at 32 rows) and ties it at 1 (where ours multiplies, every call takes
    it)."""
    if isinstance(weight, PackedInt4):
        rotated = weight.int8_copy
    elif isinstance(weight, PackedInt8) and weight.rotation:
        rotated = weight
    else:
        return None
    if rotated is None or not x.is_cpu or x.dtype not in (torch.bfloat16, torch.float32):
        return None
    return rotated if int8_activations_for(rows, x.dtype) else None


def linear(x: Tensor, weight: Tensor | PackedInt4 | PackedInt8 | QuantizedTable, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` for a streamed matrix: a plain tensor, or one the engine handed over packed.

    A packed matrix runs torch's fused kernel when ``x`` is a bf16 or fp32 CPU tensor (fp32 rows cast to bf16)
    of at most :data:`~robot_llm.llm.store.quant.FUSED_MAX_ROWS` rows for its dtype (decode steps); an int8 one
    goes through our own kernel instead where it is built (:mod:`~robot_llm.llm.store.gemv`, exact fp32
    activations). A CPU call quantizes its activations to int8 and multiplies int8 by int8 instead
    (:func:`~robot_llm.llm.store.int8act.int8_dynamic_linear`; every call where ours is built, else oneDNN's from a
    few rows, :func:`~robot_llm.llm.store.int8act.int8_activations_for`) where the CPU can and the matrix's input
    columns are rotated (RAM-homed matrices: an int8 one rotated in place, an
    int4 one given a rotated int8 copy, once when the engine opens); otherwise the matrix is made dense once and
    multiplied densely. A rotated matrix is always given rotated activations; an int8 output head
    (:class:`~robot_llm.llm.store.qhead.QuantizedTable`) computes its own way.
    """
    if isinstance(weight, Tensor):
        return F.linear(x, weight, bias)
    if isinstance(weight, QuantizedTable):
        return weight.linear(x, bias)
    rows = x.numel() // x.shape[-1]
    kernel = x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32)
    rotated = int8_activations_form(x, weight, rows)
    if rotated is None and isinstance(weight, PackedInt8) and weight.offset is not None:
        raise ValueError(f"packed int8 codes (vnni.c) meet {rows} {x.dtype} rows on {x.device}: int8 activations only")
    if rotated is not None:
        y = int8_dynamic_linear(x, rotated, int8_kernels_for(rows))  # it rotates x itself
    elif isinstance(weight, PackedInt4):
        torch_reads = weight.kernel_codes is not None or int4_kernel_reads_stored_layout()  # its codes as given
        if kernel and matmul_serves("int4", rows, torch_reads):
            y = kernels().int4_matmul(x, weight.codes, weight.scales_and_zeros, weight.shape[0])
        elif kernel and rows <= FUSED_MAX_ROWS["int4"]:
            y = int4_linear(x, weight)
        else:
            return F.linear(x, weight.dense(x.dtype), bias)
    elif kernel and rows <= FUSED_MAX_ROWS["int8"] and gemv_available():
        y = kernels().int8_gemv(x, weight.q, weight.scale, weight.shape[0], weight.rotation)  # pads, rotates x
    elif kernel and matmul_serves("int8", rows):
        y = kernels().int8_matmul(x, weight.q, weight.scale, weight.shape[0], weight.rotation)
    else:
        if weight.rotation:
            x = rotate_input(x, weight)
        fused = kernel and rows <= FUSED_MAX_ROWS["int8"]
        y = int8_linear(x, weight) if fused else int8_linear_widened(x, weight)
    return y if bias is None else y + bias


#: The attention's input projections and the gated MLP's two: each group meets one input (:func:`linears`).
QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")


def linears(x: Tensor, p: Params, *keys: str) -> list[Tensor]:
    """``linear(x, p[key], bias)`` for each of ``keys``, matrices that meet one input (:data:`QKV`, :data:`GATE_UP`;
    a ``*.bias`` beside a ``*.weight`` added): where each takes int8 activations (a rotated int8 matrix, or an int4
    one's rotated int8 copy: :func:`linear`'s own test), in one call of ours (:func:`int8_dynamic_linears`: the rows
    quantized and the threads woken once, not once a matrix; the same values). A batch-32 decode step of Gemma 3
    270M makes 126 products of its layers, 54 of them q, k and v and 36 gate and up."""
    weights, biases = [p[key] for key in keys], [p.get(key.removesuffix("weight") + "bias") for key in keys]
    rows = x.numel() // x.shape[-1]
    rotated = [r for w in weights if (r := int8_activations_form(x, w, rows)) is not None]
    if len(rotated) == len(weights):
        ys = int8_dynamic_linears(x, rotated, int8_kernels_for(rows))
        return [y if b is None else y + b for y, b in zip(ys, biases, strict=True)]
    return [linear(x, w, b) for w, b in zip(weights, biases, strict=True)]


def qkv_projections(a_in: Tensor, p: Params, step: StepInfo) -> list[Tensor]:
    """The attention's q, k and v projections (:data:`QKV`, with their biases) of ``a_in [B, T, H]``: q at the
    positions the layer computes (:meth:`StepInfo.kept`), k and v at every one; in one call where that is one input."""
    q_in = step.kept(a_in)
    if q_in is a_in:
        return linears(a_in, p, *QKV)
    return linears(q_in, p, QKV[0]) + linears(a_in, p, *QKV[1:])


def embedding(ids: Tensor, table: Tensor | QuantizedTable) -> Tensor:
    """The rows of ``ids`` in an embedding table: a float tensor, or the int8 table a tied head is held in."""
    return table.lookup(ids) if isinstance(table, QuantizedTable) else F.embedding(ids, table)


# --------------------------------------------------------------------------- step metadata


@dataclass(frozen=True)
class StepInfo:
    """Everything a layer needs about the current step besides weights and activations.

    ``positions [B, T]`` rotary positions; ``mask [B, 1, T, S]`` bool, True where
    attention is forbidden (``S`` = slots visible after this step); ``windows[w]`` the
    same mask for a sliding window of ``w`` positions; ``rope[name]`` the float32 inverse
    frequencies of the family's rotary table ``name`` and ``dtype`` the compute dtype, from
    which :attr:`rotary` is made when a layer first asks.
    """

    positions: Tensor
    mask: Tensor
    windows: dict[int, Tensor]
    rope: dict[str, Tensor]
    dtype: torch.dtype
    #: The layer computes its output at the last position only (its keys and values at all of them): the last layer
    #: of a step whose caller keeps the last position (``forward_pass``'s ``last_only``).
    last_only: bool = False

    @functools.cached_property
    def rotary(self) -> dict[str, tuple[Tensor, Tensor]]:
        """``rotary[name]``: the ``(cos, sin)`` factors ``[B, T, 1, head_dim]`` of table ``name`` in the compute dtype.

        Made on first use, for these rows only: a prefill split into micro-batches makes each one's (the whole batch's
        at once were 4 x 17 MB of Gemma 3 270M's two tables at 32 rows of 512, resident all the prefill long)."""
        warm_trigonometry(torch.get_num_threads())
        rotary = {}
        for name, inv_freq in self.rope.items():
            # float32 angles exactly as torch.outer(t, inv_freq) computes them, then cos/sin, then the dtype.
            freqs = self.positions[..., None].float() * inv_freq.to(self.positions.device)
            emb = torch.cat((freqs, freqs), dim=-1)
            rotary[name] = (emb.cos().to(self.dtype)[:, :, None, :], emb.sin().to(self.dtype)[:, :, None, :])
        return rotary

    def mask_for(self, window: int | None) -> Tensor:
        """The attention mask of a layer with this sliding window (None: the causal mask), for its queries' positions
        (:meth:`kept`)."""
        mask = self.mask if window is None else self.windows[window]
        return mask[:, :, -1:] if self.last_only else mask

    def kept(self, x: Tensor) -> Tensor:
        """``x [B, T, ...]`` at the positions the layer computes its output for: all, or the last (:attr:`last_only`),
        contiguous (as our kernels read it)."""
        return x[:, -1:].contiguous() if self.last_only and x.shape[1] > 1 else x

    def query_rotary(self, name: str) -> tuple[Tensor, Tensor]:
        """The rotary factors of table ``name`` at the queries' positions (:meth:`kept`)."""
        cos, sin = self.rotary[name]
        return self.kept(cos), self.kept(sin)

    def rows(self, a: int, b: int) -> StepInfo:
        """The step metadata of rows ``a:b``."""
        if a == 0 and b == self.positions.shape[0]:
            return self
        return StepInfo(
            positions=self.positions[a:b],
            mask=self.mask[a:b],
            windows={w: m[a:b] for w, m in self.windows.items()},
            rope=self.rope,
            dtype=self.dtype,
            last_only=self.last_only,
        )


@functools.cache
def warm_trigonometry(threads: int) -> None:
    """One cos and sin over enough values to reach ``threads`` threads, once, before the rotary tables: torch 2.13's
    first cos of a process split over threads can compute one thread's part another way (a 2-core Emerald Rapids
    VM, 2 threads, 1 process in 4-6: 32,252 of 65,536 values not the next call's; 34,068 not the fp64 cos rounded,
    against 3,632 on every later call), and a night's first prefill then differed from an identical later one."""
    x = torch.linspace(0.0, 1000.0, threads * 65536)
    x.cos(), x.sin()


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
    """Build positions, masks and the rotary factors (made on first use, :attr:`StepInfo.rotary`) for a step
    feeding ``num_tokens`` per row.

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
    return StepInfo(positions=positions.to(device), mask=mask.to(device), windows=windows, rope=rope, dtype=dtype)


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


# --------------------------------------------------------------------------- the forward pass

#: One layer ready to run on some rows of the batch: ``(x, step, kv) -> x``, its weights already at hand.
LayerCall = Callable[[Tensor, StepInfo, LayerKV | None], Tensor]


def bind_layer(fam: Family, params: Params, cfg: Any, index: int) -> LayerCall:
    """Layer ``index`` of ``fam`` with its weights ``params``, as :func:`forward_pass` calls it."""
    return lambda x, step, kv: fam.layer(x, params, cfg, index, step, kv)


def forward_pass(
    ids: Tensor,
    step: StepInfo,
    cache: KVCache | None,
    *,
    embed: Callable[[Tensor], Tensor],
    layers: Iterable[tuple[str, LayerCall]],
    head: Callable[[Tensor], Tensor],
    watch: FiniteWatch,
    rows: int | None = None,
    last_only: bool = False,
    select: Tensor | None = None,
    on_layer: Callable[[], None] | None = None,
    num_layers: int | None = None,
) -> tuple[Tensor, Tensor]:
    """One step of any engine over ``ids [B, T]``: embed, every layer, the head. Returns the fp32 CPU logits and
    the hidden states the head read (``[B, T, H]``, ``[B, 1, H]`` with ``last_only``: a stance head reads them).

    The engines differ only in where weights come from, so they pass them in: ``layers`` yields each layer's name
    (for ``watch``) and its call, in order; a generator may fetch the next layer before it yields and release the
    last one after (the streaming engine's slots), or yield modules whose hooks gather their weights (DeepSpeed
    ZeRO-3). ``rows`` splits the batch into micro-batches of that many rows (bounded activations; each layer still
    fetched once); ``on_layer`` runs after every layer of every micro-batch (the watchdog's liveness). ``cache``
    (``step`` from :func:`prepare_step` over it) is advanced by ``T``; ``last_only`` keeps the last position only;
    ``select`` (``[B, T]`` bool) runs the head at those positions only and returns their logits packed ``[N, V]``
    in row-major order (the hidden states stay ``[B, T, H]``). ``num_layers``, the number of layers ``layers``
    yields, lets a ``last_only`` step's last layer compute its output at the last position only
    (:attr:`StepInfo.last_only`: its queries, attention output and MLP; its keys and values still at every position):
    a 512-token prefill of Gemma 3 270M's 18 layers skips some 5 % of its products.
    """
    B, T = ids.shape
    rows = rows or B
    x = embed(ids)
    watch.reset()
    watch.note("the embedding", x)
    for i, (name, layer) in enumerate(layers):
        pruned = last_only and select is None and T > 1 and i == (num_layers or 0) - 1
        layer_step = dataclasses.replace(step, last_only=True) if pruned else step
        y = x.new_empty(B, 1, x.shape[-1]) if pruned and rows < B else x  # rows of a micro-batch go back in place
        for a in range(0, B, rows):
            b = min(a + rows, B)
            kv = cache.layer(i).rows(a, b) if cache is not None else None
            out = layer(x[a:b], layer_step.rows(a, b), kv)
            if b - a == B:
                y = out  # the whole batch in one call: keep its output, no copy back
            else:
                y[a:b] = out
            if on_layer is not None:
                on_layer()
        x = y
        watch.note(name, x)
    if cache is not None:
        cache.advance(T)
    if last_only:
        x = x[:, -1:]
    return head(x if select is None else x[select.to(x.device)]).float().cpu(), x


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
        select: Tensor | None = None,
    ) -> Tensor:
        """Run ``ids [B, T]`` (CPU long); return fp32 CPU logits ``[B, T, V]`` (``[B, 1, V]`` if last_only;
        ``[N, V]`` at the N True positions of a ``[B, T]`` bool ``select``, row-major: the head only where read).

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
