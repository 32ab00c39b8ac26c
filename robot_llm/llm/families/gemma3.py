"""Gemma 3 (text) in one file: its config (:class:`Gemma3Config`, the importer's names, the presets) and its
forward pass in plain PyTorch: the ``gemma3`` :class:`Family`.

Written from transformers' ``modeling_gemma3`` behaviour. Per layer (keys of
:meth:`Gemma3Config.layer_shapes`)::

    h  = x + post_attention_norm(o_proj(attention(rope(q_norm(q_proj(n))), rope(k_norm(k_proj(n))), v_proj(n))))
         where n = input_norm(x)
    x' = h + post_feedforward_norm(down_proj(gelu_tanh(gate_proj(m)) * up_proj(m)))  where m = pre_feedforward_norm(h)

Every RMSNorm computes in float32 and scales by ``(1 + weight)`` before casting
back. The embedding is scaled by ``sqrt(hidden)`` (rounded to the compute dtype
first); attention scores by ``query_pre_attn_scalar ** -0.5``. Local layers use
the ``sliding_attention`` rotary base and see the last ``sliding_window_size``
positions; global layers use the ``full_attention`` base (optionally linearly
scaled) and see everything. The LM head is the embedding matrix (unscaled).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from robot_llm.llm.engine.kv_cache import LayerKV, attend_with
from robot_llm.llm.families.attention import grouped_attention
from robot_llm.llm.families.config import (
    HF_SIZES,
    ModuleKind,
    Shapes,
    check_positive,
    decoder_shapes,
    from_fields,
    hf_rope,
)
from robot_llm.llm.families.decode_layer import LayerSpec, decode_layer
from robot_llm.llm.families.family import (
    GATE_UP,
    Family,
    Params,
    Resident,
    StepInfo,
    embedding,
    linear,
    linears,
    qkv_projections,
    rope_inv_freq,
)
from robot_llm.llm.families.gated import gated
from robot_llm.llm.families.norm import rms_norm


def norm(
    x: Tensor, weight: Tensor, eps: float, rotary: tuple[Tensor, Tensor] | None = None, residual: Tensor | None = None
) -> Tensor:
    """Gemma's RMSNorm: float32 throughout, gain ``1 + weight``, then back to the input dtype; then the rotary
    (a normed query or key) or the residual add (a post-norm) where given (:func:`rms_norm`: one call)."""
    return rms_norm(x, weight, eps, offset=1.0, rotary=rotary, residual=residual)


def rope(cfg: Gemma3Config) -> dict[str, Tensor]:
    """One rotary table per layer type: local base for sliding layers, (scaled) global base for full layers."""
    return {
        SLIDING: rope_inv_freq(cfg.rope_local_base_freq, cfg.head_dim),
        FULL: rope_inv_freq(cfg.rope_theta, cfg.head_dim) / cfg.rope_scaling_factor,
    }


def embed(ids: Tensor, resident: Resident, cfg: Gemma3Config) -> Tensor:
    """Embedding lookup times ``sqrt(hidden)`` (the scale rounded to the weight dtype, as the reference)."""
    weight = resident["embedding"]["embed_tokens.weight"]
    return embedding(ids, weight) * torch.tensor(cfg.hidden_size**0.5).to(weight.dtype)


def attention(a_in: Tensor, p: Params, cfg: Gemma3Config, index: int, step: StepInfo, kv: LayerKV | None) -> Tensor:
    """Grouped-query attention with per-head q/k RMSNorm and the rotary of this layer's type."""
    B, T, _ = a_in.shape
    d, eps = cfg.head_dim, cfg.rms_norm_eps
    table = cfg.layer_types[index]
    q, k, v = qkv_projections(a_in, p, step)
    q = norm(q.view(B, q.shape[1], -1, d), p["self_attn.q_norm.weight"], eps, step.query_rotary(table))
    k = norm(k.view(B, T, -1, d), p["self_attn.k_norm.weight"], eps, step.rotary[table])
    v = v.view(B, T, -1, d)
    mask = step.mask_for(cfg.sliding_window(index))
    if kv is not None:
        k, v = kv.update(k, v, fused=True)
        q, mask = attend_with(q, mask, k, keep_dtype=True)
    o = grouped_attention(q, k, v, mask, cfg.query_pre_attn_scalar**-0.5, cfg.attn_logit_softcapping)
    o = o.to(a_in.device, a_in.dtype)
    return linear(o, p["self_attn.o_proj.weight"])


def transformer_layer(
    x: Tensor, p: Params, cfg: Gemma3Config, layer_index: int, step: StepInfo, kv: LayerKV | None = None
) -> Tensor:
    """One Gemma 3 decoder layer: four norms, attention, GeGLU MLP with the tanh GELU (a decode step's in one call of
    ours where it can, :func:`~robot_llm.llm.families.decode_layer.decode_layer`: the same values)."""
    if (fused := decode_layer(x, p, kv, step, layer_spec(cfg, layer_index))) is not None:
        return fused
    eps = cfg.rms_norm_eps
    a = attention(norm(x, p["input_layernorm.weight"], eps), p, cfg, layer_index, step, kv)
    h = norm(a, p["post_attention_layernorm.weight"], eps, residual=step.kept(x))
    m = norm(h, p["pre_feedforward_layernorm.weight"], eps)
    hidden = gated(*linears(m, p, *GATE_UP), "gelu_tanh")
    return norm(linear(hidden, p["mlp.down_proj.weight"]), p["post_feedforward_layernorm.weight"], eps, residual=h)


@functools.cache
def layer_spec(cfg: Gemma3Config, index: int) -> LayerSpec:
    """Layer ``index`` as :func:`transformer_layer` computes it, for ``layer.c``."""
    return LayerSpec(
        norms=(
            "input_layernorm.weight",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            "post_attention_layernorm.weight",
            "pre_feedforward_layernorm.weight",
            "post_feedforward_layernorm.weight",
        ),
        eps=cfg.rms_norm_eps,
        offset=1.0,
        gain_rounded=False,
        activation="gelu_tanh",
        scale=cfg.query_pre_attn_scalar**-0.5,
        softcap=cfg.attn_logit_softcapping,
        window=cfg.sliding_window(index),
        rotary=cfg.layer_types[index],
        head_dim=cfg.head_dim,
    )


def output_head(x: Tensor, resident: Resident, cfg: Gemma3Config) -> Tensor:
    """Final norm, the tied LM head, and the optional final soft-capping."""
    y = norm(x, resident["output"]["norm.weight"], cfg.rms_norm_eps)
    logits = linear(y, resident["embedding"]["embed_tokens.weight"])
    if cfg.final_logit_softcapping is not None:
        logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return logits


# --------------------------------------------------------------------------- config

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class Gemma3Config:
    """Gemma 3 (text): RMSNorm with ``(1 + weight)``, four norms per layer, QK-norm, GeGLU (tanh GELU),
    embeddings scaled by ``sqrt(hidden)``, local sliding-window and global layers with their own rotary bases.

    ``layer_types[i]`` is ``"sliding_attention"`` or ``"full_attention"``;
    ``rope_scaling_factor`` is the linear scaling of the global layers' rotary.
    """

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    vocab_size: int
    layer_types: tuple[str, ...]
    sliding_window_size: int = 512
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rope_scaling_factor: float = 1.0
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None

    family: ClassVar[str] = "gemma3"
    #: Gemma 3's activations exceed fp16's range (65504): bf16, else fp32, never fp16.
    gpu_dtypes: ClassVar[tuple[str, str]] = ("bf16", "fp32")
    kv_read_as_stored: ClassVar[bool] = True
    gguf_architectures: ClassVar[tuple[str, ...]] = ("gemma3",)
    hf_model_types: ClassVar[tuple[str, ...]] = ("gemma3_text", "gemma3")
    #: A norm after attention, one before and one after the MLP.
    gguf_norms: ClassVar[dict[str, str]] = {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    }
    #: llama.cpp stores Gemma's RMSNorm gain as 1 + weight.
    gguf_norm_offset: ClassVar[float] = 1.0
    gguf_permuted: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        check_positive(self, HF_SIZES)
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must name {self.num_layers} layers as {SLIDING!r} or {FULL!r}")

    def sliding_window(self, layer_index: int) -> int | None:
        """Local layers see the last ``sliding_window_size`` positions, global layers everything."""
        return self.sliding_window_size if self.layer_types[layer_index] == SLIDING else None

    def layer_shapes(self, layer_index: int) -> Shapes:
        """Hugging Face keys of ``model.layers.N`` and their shapes (Llama's plus QK-norm and two MLP norms)."""
        del layer_index
        d, H = self.head_dim, self.hidden_size
        return decoder_shapes(self) | {
            "self_attn.q_norm.weight": (d,),
            "self_attn.k_norm.weight": (d,),
            "pre_feedforward_layernorm.weight": (H,),
            "post_feedforward_layernorm.weight": (H,),
        }

    def resident_shapes(self) -> dict[ModuleKind, Shapes]:
        """The token embedding (also the LM head) and the final norm."""
        return {
            "embedding": {"embed_tokens.weight": (self.vocab_size, self.hidden_size)},
            "output": {"norm.weight": (self.hidden_size,)},
        }

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON serialisable)."""
        data = dataclasses.asdict(self)
        data["layer_types"] = list(self.layer_types)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Gemma3Config:
        """Build from :meth:`to_dict` output."""
        config: Gemma3Config = from_fields(cls, data)
        return config

    @classmethod
    def from_gguf(cls, common: dict[str, Any], get: Callable[..., Any], names: set[str]) -> Gemma3Config:
        """From a GGUF file's metadata: ``common`` (the sizes every family reads), ``get(key, default)`` (this
        architecture's fields), ``names`` (its tensors)."""
        window = int(get("attention.sliding_window"))
        # llama.cpp (and transformers' default) make every sixth layer global.
        types = tuple(SLIDING if (i + 1) % 6 else FULL for i in range(common["num_layers"]))
        return cls(
            **common,
            layer_types=types,
            sliding_window_size=window,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 1_000_000.0)),
            rope_scaling_factor=float(get("rope.scaling.factor", 1.0)),
            # llama.cpp scales Gemma 3 queries by 1/sqrt(head_dim) (the 27B model aside).
            query_pre_attn_scalar=float(common["head_dim"]),
        )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Gemma3Config:
        """From a Hugging Face ``config.json`` of a Gemma 3 text model (``text_config`` of a multimodal one)."""
        hf = hf.get("text_config", hf)
        layers = hf["num_hidden_layers"]
        pattern = hf.get("sliding_window_pattern", 6)
        types = hf.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
        theta, scaling = hf_rope(hf, FULL)
        local_theta, _ = hf_rope(hf, SLIDING)
        if (scaling or {}).get("rope_type", (scaling or {}).get("type", "linear")) != "linear":
            raise ValueError(f"Gemma 3 rope scaling {scaling} is not supported (only linear)")
        return cls(
            num_layers=layers,
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf["num_key_value_heads"],
            head_dim=hf["head_dim"],
            max_position_embeddings=hf["max_position_embeddings"],
            vocab_size=hf["vocab_size"],
            layer_types=tuple(types),
            sliding_window_size=hf.get("sliding_window", 512),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta or 1_000_000.0,
            rope_local_base_freq=local_theta or hf.get("rope_local_base_freq", 10_000.0),
            rope_scaling_factor=float((scaling or {}).get("factor", 1.0)),
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            attn_logit_softcapping=hf.get("attn_logit_softcapping"),
        )


#: Named Gemma 3 configs (for the planner; a converted store carries its own config).
PRESETS: dict[str, Gemma3Config] = {
    "gemma-3-270m": Gemma3Config(
        num_layers=18,
        hidden_size=640,
        intermediate_size=2048,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        max_position_embeddings=32768,
        vocab_size=262144,
        layer_types=tuple(SLIDING if (i + 1) % 6 else FULL for i in range(18)),
    ),
}


#: The registry's handle on this family's config (:mod:`robot_llm.llm.families.registry`).
CONFIG = Gemma3Config
FAMILY = Family(name="gemma3", rope=rope, embed=embed, layer=transformer_layer, head=output_head)
