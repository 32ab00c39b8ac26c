"""YaLM forward pass (docs/yalm-model.md §3-§4) as pure functions plus a small in-memory model.

Calling convention (shared with the offloaded engine in ``engine.py``)
----------------------------------------------------------------------
Weights are plain ``dict[str, Tensor]`` per module, keyed by the *release* key
names with the module prefix stripped (exactly the keys of one
``layer_NN-model_00-model_states.pt`` file, see :mod:`robot_llm.llm.checkpoint`):

* embedding (file 00): ``word_embeddings.weight`` ``[V, E]``;
* projector (file 01): ``input_layernorm.weight/bias`` ``[E]``;
* transformer layer (files 03..L+2): ``attention.query_key_value.weight/bias``,
  ``attention.dense.weight/bias``, ``post_attention_layernorm.weight/bias``,
  ``mlp.dense_ffn_hidden.weight/bias``, ``mlp.dense_ffn_gate.weight/bias``,
  ``mlp.dense_ffn_output.weight/bias`` and, for every layer but the first,
  ``input_layernorm.weight/bias``;
* output layer (file L+4): ``input_layer_norm.weight/bias``, ``dense.weight/bias``,
  ``output_layer_norm.weight/bias``, ``output_bias``.

Every function computes in the dtype and on the device of the tensors it is
given: the caller casts/moves the weights to the compute dtype and device
beforehand (fp32, bf16 or fp16). Activations are batch-first ``[B, T, ...]``.

One forward step over ``ids [B, T]``::

    rope = Rope.build(cfg, device)                      # once per model
    B, T = ids.shape
    step = prepare_step(cfg, rope, cache, T, pad, device, dtype, batch=B)  # cache or pad (or neither)
    x = embed(ids, emb_params, proj_params, cfg)
    for i in range(cfg.num_layers):
        x = transformer_layer(x, layer_params[i], cfg, i, step, cache.layer(i) if cache is not None else None)
    if cache is not None:
        cache.advance(T)                                # after all layers wrote slots length..length+T-1
    logits = output_head(x, out_params, emb_params["word_embeddings.weight"], cfg).float()

Batching prompts of different lengths: left-pad every row to the same length
and pass ``pad[b]`` (the number of pad slots at the front of row ``b``). Row
``b``'s rotary position of slot ``s`` is ``s - pad[b]`` (BOS at position 0),
and pad slots are masked out as keys, so each row computes exactly what it
would compute alone. With a :class:`KVCache` the pads are stored in the cache
(``KVCache.pad``) and every step writes slots ``cache.length .. cache.length+T-1``
of all rows. The cache tensors may live on another device than the compute
(for example CPU while computing on a GPU): each layer copies the slice it reads.

:class:`ForwardModel` is the protocol the generation loop uses; :class:`Yalm`
implements it with all weights in memory, and the offload engine implements it
by streaming layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from robot_llm.llm.config import YalmConfig
from robot_llm.llm.slots import SlotState, StepLayout

Params = dict[str, Tensor]

#: Score written over masked attention logits (masked_fill, as the original does).
MASK_VALUE = -10000.0

#: Compute dtypes this implementation supports, by name.
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


# --------------------------------------------------------------------------- rotary


@dataclass(frozen=True)
class Rope:
    """Rotary cos/sin tables, float32, ``[max_position_embeddings, hn]`` (both halves repeated)."""

    cos: Tensor
    sin: Tensor

    @classmethod
    def build(cls, cfg: YalmConfig, device: torch.device | str = "cpu") -> Rope:
        """Tables exactly as the original computes them (§3.4.3): ``float32(1e-4) ** (2i / hn)``."""
        hn = cfg.head_dim
        inv_freq = torch.tensor(1e-4, dtype=torch.float32) ** (torch.arange(0, hn, 2, dtype=torch.float32) / hn)
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return cls(cos=emb.cos().to(device), sin=emb.sin().to(device))


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half rotary on ``x [B, T, n, hn]`` with ``cos``/``sin`` ``[B, T, 1, hn]`` in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


# --------------------------------------------------------------------------- KV cache


@dataclass
class KVCache:
    """Per-layer rotated keys and values of every processed slot.

    ``k[i]``/``v[i]`` are preallocated ``[B, max_len, n, hn]`` tensors for layer
    ``i``; slots ``0 .. length-1`` are written. ``pad[b]`` (CPU long tensor) is the
    number of left-pad slots of row ``b``; those slots are never attended to.
    ``slots`` says which written slots belong to their row (see
    :mod:`robot_llm.llm.slots`): a finished row is masked rather than copied out, and
    ``layout``, when set, is the layout of the next step instead of a plain append.
    The tensors may sit on any device (their "home"); a layer reads the slice
    it needs onto the compute device.
    """

    k: list[Tensor]
    v: list[Tensor]
    pad: Tensor
    slots: SlotState
    length: int = 0
    layout: StepLayout | None = None

    @classmethod
    def allocate(
        cls,
        cfg: YalmConfig,
        batch: int,
        max_len: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        pad: Tensor | None = None,
    ) -> KVCache:
        """Allocate an empty cache for ``batch`` rows of up to ``max_len`` slots."""
        shape = (batch, max_len, cfg.num_attention_heads, cfg.head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
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
        """The cache view handed to :func:`transformer_layer` for layer ``index``."""
        return LayerKV(k=self.k[index], v=self.v[index], start=self.length)

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
        layout = self.step_layout(steps)
        self.length = self.slots.commit(self.length, layout)
        self.layout = None


@dataclass(frozen=True)
class LayerKV:
    """One layer's cache tensors and the first slot the current step writes."""

    k: Tensor
    v: Tensor
    start: int


# --------------------------------------------------------------------------- step metadata


@dataclass(frozen=True)
class StepInfo:
    """Everything a layer needs about the current step besides weights and activations.

    ``positions [B, T]`` rotary positions; ``mask [B, 1, T, S]`` bool, True where
    attention is forbidden (``S`` = slots visible after this step); ``cos``/``sin``
    ``[B, T, 1, hn]`` already in the compute dtype.
    """

    positions: Tensor
    mask: Tensor
    cos: Tensor
    sin: Tensor


def prepare_step(
    cfg: YalmConfig,
    rope: Rope,
    cache: KVCache | None,
    num_tokens: int,
    pad: Tensor | None,
    device: torch.device | str,
    dtype: torch.dtype,
    batch: int | None = None,
) -> StepInfo:
    """Build positions, mask and rotary factors for a step feeding ``num_tokens`` per row.

    With a cache, ``pad`` must be None (the cache's slot state is used) and the
    step covers slots ``cache.length .. cache.length + num_tokens - 1``, laid out by
    :meth:`KVCache.step_layout`. Without a cache, ``pad`` (default: no padding)
    describes the left padding of the ``batch`` rows.
    """
    if cache is not None:
        if pad is not None:
            raise ValueError("pass the padding through the cache, not both")
        layout = cache.step_layout(num_tokens)
        positions = layout.positions
        mask = cache.slots.forbidden(cache.length, layout)
    else:
        if pad is None:
            if batch is None:
                raise ValueError("prepare_step needs pad or batch when there is no cache")
            pad = torch.zeros(batch, dtype=torch.long)
        pad_t = pad.to("cpu", torch.long)
        slots = torch.arange(num_tokens)
        positions = (slots[None, :] - pad_t[:, None]).clamp_min(0)
        future = slots[None, :] > slots[:, None]  # [T, S]
        padded = slots[None, :] < pad_t[:, None]  # [B, S]
        mask = (future[None, :, :] | padded[:, None, :])[:, None, :, :]
    if int(positions.max()) >= cfg.max_position_embeddings:
        raise ValueError(
            f"position {int(positions.max())} exceeds max_position_embeddings {cfg.max_position_embeddings}"
        )
    positions = positions.to(device)
    cos = rope.cos.to(device)[positions].to(dtype)[:, :, None, :]
    sin = rope.sin.to(device)[positions].to(dtype)[:, :, None, :]
    return StepInfo(positions=positions, mask=mask.to(device), cos=cos, sin=sin)


# --------------------------------------------------------------------------- the pieces


def _layer_norm(x: Tensor, params: Params, prefix: str, eps: float) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), params[f"{prefix}.weight"], params[f"{prefix}.bias"], eps)


def embed(ids: Tensor, emb_params: Params, proj_params: Params, cfg: YalmConfig) -> Tensor:
    """Word embedding (§3.1) and projector (§3.2): ``ids [B, T]`` -> ``x [B, T, H]``.

    Computes in the dtype of ``word_embeddings.weight``; ``ids`` must be on its device.
    """
    e = F.embedding(ids, emb_params["word_embeddings.weight"])
    p = _layer_norm(e, proj_params, "input_layernorm", cfg.layernorm_epsilon)
    if cfg.embedding_size == cfg.hidden_size:
        return p
    return F.pad(p, (0, cfg.hidden_size - cfg.embedding_size))


def attention(a_in: Tensor, params: Params, cfg: YalmConfig, step: StepInfo, kv: LayerKV | None) -> Tensor:
    """Self-attention (§3.4) without the output bias: returns ``A`` of ``h = x + (A + b_o)``."""
    B, T, H = a_in.shape
    n, hn = cfg.num_attention_heads, cfg.head_dim
    c = F.linear(a_in, params["attention.query_key_value.weight"], params["attention.query_key_value.bias"])
    # Fused layout is per-head interleaved [n, 3, hn] (§3.4.2).
    q, k, v = c.view(B, T, n, 3, hn).unbind(dim=3)
    q = apply_rotary(q, step.cos, step.sin)
    k = apply_rotary(k, step.cos, step.sin)
    if kv is not None:
        end = kv.start + T
        kv.k[:, kv.start : end] = k.to(kv.k.device, kv.k.dtype)
        kv.v[:, kv.start : end] = v.to(kv.v.device, kv.v.dtype)
        k = kv.k[:, :end].to(a_in.device, a_in.dtype)
        v = kv.v[:, :end].to(a_in.device, a_in.dtype)
    S = k.shape[1]
    q = q.transpose(1, 2).reshape(B * n, T, hn)
    k = k.permute(0, 2, 3, 1).reshape(B * n, hn, S)
    v = v.transpose(1, 2).reshape(B * n, S, hn)
    # Scale applied as the GEMM's alpha, like the original (matters for fp16 rounding).
    scores = torch.baddbmm(
        torch.empty(B * n, T, S, dtype=q.dtype, device=q.device), q, k, beta=0.0, alpha=1.0 / math.sqrt(hn)
    ).view(B, n, T, S)
    scores = scores.masked_fill(step.mask, MASK_VALUE)
    probs = torch.softmax(scores, dim=-1)
    o = torch.bmm(probs.view(B * n, T, S), v).view(B, n, T, hn).transpose(1, 2).reshape(B, T, H)
    return F.linear(o, params["attention.dense.weight"])


def geglu_mlp(m_in: Tensor, params: Params) -> Tensor:
    """GeGLU MLP (§3.5) without the output bias: returns ``M`` of ``x' = h + (M + b_out)``."""
    u = F.linear(m_in, params["mlp.dense_ffn_hidden.weight"])
    r = F.gelu(u + params["mlp.dense_ffn_hidden.bias"])
    g = F.linear(m_in, params["mlp.dense_ffn_gate.weight"], params["mlp.dense_ffn_gate.bias"])
    return F.linear(r * g, params["mlp.dense_ffn_output.weight"])


def transformer_layer(
    x: Tensor,
    params: Params,
    cfg: YalmConfig,
    layer_index: int,
    step: StepInfo,
    kv: LayerKV | None = None,
) -> Tensor:
    """One pre-LN transformer layer (§3.3); ``layer_index`` is 0-based (file ``layer_{index+3:02d}``).

    Layer 0 has no input LayerNorm. With ``kv`` the step's keys/values are
    written into the cache slots ``kv.start ..`` and all filled slots are attended.
    """
    eps = cfg.layernorm_epsilon
    a_in = x if layer_index == 0 else _layer_norm(x, params, "input_layernorm", eps)
    h = x + (attention(a_in, params, cfg, step, kv) + params["attention.dense.bias"])
    m_in = _layer_norm(h, params, "post_attention_layernorm", eps)
    return h + (geglu_mlp(m_in, params) + params["mlp.dense_ffn_output.bias"])


def output_head(x: Tensor, out_params: Params, word_embeddings: Tensor, cfg: YalmConfig) -> Tensor:
    """Output layer and tied LM head (§3.6): ``x [B, T, H]`` -> logits ``[B, T, V]`` in x's dtype."""
    eps = cfg.layernorm_epsilon
    y = _layer_norm(x, out_params, "input_layer_norm", eps)
    z = F.linear(y, out_params["dense.weight"]) + out_params["dense.bias"]
    z = _layer_norm(F.gelu(z), out_params, "output_layer_norm", eps)
    return F.linear(z, word_embeddings, out_params["output_bias"])


# --------------------------------------------------------------------------- model protocol


class ForwardModel(Protocol):
    """What :mod:`robot_llm.llm.generate` needs from a model (in-memory or streamed)."""

    config: YalmConfig

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
class YalmWeights:
    """All weights of a model, grouped per release module (see the module docstring for keys)."""

    embedding: Params
    projector: Params
    layers: list[Params]
    output: Params

    def to(self, device: torch.device | str, dtype: torch.dtype) -> YalmWeights:
        """Copy every tensor to ``device`` and ``dtype``."""

        def conv(p: Params) -> Params:
            return {k: t.to(device=device, dtype=dtype) for k, t in p.items()}

        return YalmWeights(
            embedding=conv(self.embedding),
            projector=conv(self.projector),
            layers=[conv(p) for p in self.layers],
            output=conv(self.output),
        )


class Yalm:
    """The whole model held in memory; implements :class:`ForwardModel`."""

    def __init__(
        self,
        cfg: YalmConfig,
        weights: YalmWeights,
        *,
        dtype: str | torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = cfg
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        self.weights = weights.to(self.device, self.dtype)
        self.rope = Rope.build(cfg, self.device)

    @classmethod
    def from_release(
        cls,
        directory: str,
        cfg: YalmConfig,
        *,
        dtype: str | torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        trust_pickle: bool = False,
    ) -> Yalm:
        """Load a release-layout checkpoint folder (``layer_NN-model_00-model_states.pt`` files)."""
        from robot_llm.llm.checkpoint import load_release

        return cls(cfg, load_release(directory, cfg, trust_pickle=trust_pickle), dtype=dtype, device=device)

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
        cfg, w = self.config, self.weights
        B, T = ids.shape
        step = prepare_step(cfg, self.rope, cache, T, pad, self.device, self.dtype, batch=B)
        x = embed(ids.to(self.device), w.embedding, w.projector, cfg)
        for i, layer in enumerate(w.layers):
            x = transformer_layer(x, layer, cfg, i, step, cache.layer(i) if cache is not None else None)
        if cache is not None:
            cache.advance(T)
        if last_only:
            x = x[:, -1:]
        logits = output_head(x, w.output, w.embedding["word_embeddings.weight"], cfg)
        return logits.float().cpu()

    __call__ = forward


def random_weights(
    cfg: YalmConfig, seed: int = 0, std: float = 0.02, dtype: torch.dtype = torch.float32
) -> YalmWeights:
    """Random weights with the release shapes (for tests, demos and benchmarks).

    LayerNorm gains are drawn around 1 and biases around 0 so that every
    parameter matters; ``std`` scales the matrices.
    """
    g = torch.Generator().manual_seed(seed)
    shapes = release_shapes(cfg)

    def draw(name: str, shape: tuple[int, ...]) -> Tensor:
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        if len(shape) == 2:
            t = t * std
        elif name.endswith("norm.weight"):
            t = 1.0 + 0.1 * t
        else:
            t = 0.1 * t
        return t.to(dtype)

    def module(spec: dict[str, tuple[int, ...]]) -> Params:
        return {k: draw(k, s) for k, s in spec.items()}

    return YalmWeights(
        embedding=module(shapes["embedding"]),
        projector=module(shapes["projector"]),
        layers=[module(layer_shapes(cfg, i)) for i in range(cfg.num_layers)],
        output=module(shapes["output"]),
    )


def layer_shapes(cfg: YalmConfig, layer_index: int) -> dict[str, tuple[int, ...]]:
    """Release keys and shapes of transformer layer ``layer_index`` (0-based), §5.3."""
    H, intermediate = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {}
    if layer_index > 0:
        shapes["input_layernorm.weight"] = (H,)
        shapes["input_layernorm.bias"] = (H,)
    shapes.update(
        {
            "attention.query_key_value.weight": (3 * H, H),
            "attention.query_key_value.bias": (3 * H,),
            "attention.dense.weight": (H, H),
            "attention.dense.bias": (H,),
            "post_attention_layernorm.weight": (H,),
            "post_attention_layernorm.bias": (H,),
            "mlp.dense_ffn_hidden.weight": (intermediate, H),
            "mlp.dense_ffn_hidden.bias": (intermediate,),
            "mlp.dense_ffn_gate.weight": (intermediate, H),
            "mlp.dense_ffn_gate.bias": (intermediate,),
            "mlp.dense_ffn_output.weight": (H, intermediate),
            "mlp.dense_ffn_output.bias": (H,),
        }
    )
    return shapes


def release_shapes(cfg: YalmConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """Release keys and shapes of the embedding, projector and output layer, §5.3."""
    H, E, V = cfg.hidden_size, cfg.embedding_size, cfg.vocab_size
    return {
        "embedding": {"word_embeddings.weight": (V, E)},
        "projector": {"input_layernorm.weight": (E,), "input_layernorm.bias": (E,)},
        "output": {
            "input_layer_norm.weight": (H,),
            "input_layer_norm.bias": (H,),
            "dense.weight": (E, H),
            "dense.bias": (E,),
            "output_layer_norm.weight": (E,),
            "output_layer_norm.bias": (E,),
            "output_bias": (V,),
        },
    }
