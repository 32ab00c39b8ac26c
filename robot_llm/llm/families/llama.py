"""The Llama family (Llama 2/3.x, Mistral, Qwen 2/2.5/3) in one file: its config (:class:`LlamaConfig`, the
importer's names, the presets) and its forward pass in plain PyTorch: the ``llama`` :class:`Family`.

Written from transformers' ``modeling_llama`` / ``modeling_qwen2`` / ``modeling_qwen3`` /
``modeling_mistral`` behaviour. Per layer (keys of :meth:`LlamaConfig.layer_shapes`)::

    h = x + o_proj(attention(rope(q_norm?(q_proj(rms(x)))), rope(k_norm?(k_proj(rms(x)))), v_proj(rms(x))))
    x' = h + down_proj(silu(gate_proj(rms(h))) * up_proj(rms(h)))

RMSNorm normalises in float32 and multiplies the weight after casting back
(``weight * x.to(dtype)``); grouped-query attention shares each KV head among
``n / kv`` query heads; Mistral's sliding window masks keys ``window`` or more
positions back. Logits are ``norm(x) @ lm_head`` (the embedding when tied).
"""

from __future__ import annotations

import dataclasses
import math
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


def norm(x: Tensor, weight: Tensor | None, eps: float, rotary: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Llama's RMSNorm: statistics in float32, weight applied in the input dtype; then the rotary where given
    (``weight`` None: the rotary alone; :func:`rms_norm`: one call)."""
    return rms_norm(x, weight, eps, gain_rounded=True, rotary=rotary)


def rope(cfg: LlamaConfig) -> dict[str, Tensor]:
    """Inverse frequencies with the config's rotary scaling (``default``, ``linear`` or ``llama3``)."""
    inv_freq = rope_inv_freq(cfg.rope_theta, cfg.head_dim)
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: long wavelengths slowed down by `factor`, short ones kept, the band between interpolated.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return {"rope": inv_freq}


def embed(ids: Tensor, resident: Resident, cfg: LlamaConfig) -> Tensor:
    """Token embedding lookup: ``ids [B, T]`` -> ``[B, T, H]``."""
    del cfg
    return embedding(ids, resident["embedding"]["embed_tokens.weight"])


def attention(a_in: Tensor, p: Params, cfg: LlamaConfig, step: StepInfo, kv: LayerKV | None) -> Tensor:
    """Grouped-query self-attention with rotary (and Qwen 3's per-head q/k RMSNorm) before ``o_proj``."""
    B, T, _ = a_in.shape
    d = cfg.head_dim
    q, k, v = qkv_projections(a_in, p, step)
    q, k, v = q.view(B, q.shape[1], -1, d), k.view(B, T, -1, d), v.view(B, T, -1, d)
    qk_norm = cfg.qk_norm
    q = norm(q, p["self_attn.q_norm.weight"] if qk_norm else None, cfg.rms_norm_eps, step.query_rotary("rope"))
    k = norm(k, p["self_attn.k_norm.weight"] if qk_norm else None, cfg.rms_norm_eps, step.rotary["rope"])
    mask = step.mask_for(cfg.sliding_window_size)
    if kv is not None:
        k, v = kv.update(k, v, fused=True)
        q, mask = attend_with(q, mask, k, keep_dtype=True)
    o = grouped_attention(q, k, v, mask, 1.0 / math.sqrt(d)).to(a_in.device, a_in.dtype)
    return linear(o, p["self_attn.o_proj.weight"], p.get("self_attn.o_proj.bias"))


def transformer_layer(
    x: Tensor, p: Params, cfg: LlamaConfig, layer_index: int, step: StepInfo, kv: LayerKV | None = None
) -> Tensor:
    """One pre-RMSNorm decoder layer with a SwiGLU MLP (a decode step's in one call of ours where it can,
    :func:`~robot_llm.llm.families.decode_layer.decode_layer`: the same values)."""
    del layer_index
    if (fused := decode_layer(x, p, kv, step, layer_spec(cfg))) is not None:
        return fused
    h = step.kept(x) + attention(norm(x, p["input_layernorm.weight"], cfg.rms_norm_eps), p, cfg, step, kv)
    m = norm(h, p["post_attention_layernorm.weight"], cfg.rms_norm_eps)
    hidden = gated(*linears(m, p, *GATE_UP), "silu")
    return h + linear(hidden, p["mlp.down_proj.weight"])


def layer_spec(cfg: LlamaConfig) -> LayerSpec:
    """Every layer as :func:`transformer_layer` computes it, for ``layer.c``: no norm after the attention or the MLP
    (their residual added as it is), Qwen 3's q/k norms where the config has them."""
    qk = ("self_attn.q_norm.weight", "self_attn.k_norm.weight") if cfg.qk_norm else (None, None)
    return LayerSpec(
        norms=("input_layernorm.weight", *qk, None, "post_attention_layernorm.weight", None),
        eps=cfg.rms_norm_eps,
        offset=0.0,
        gain_rounded=True,
        activation="silu",
        scale=1.0 / math.sqrt(cfg.head_dim),
        softcap=None,
        window=cfg.sliding_window_size,
        rotary="rope",
        head_dim=cfg.head_dim,
    )


def output_head(x: Tensor, resident: Resident, cfg: LlamaConfig) -> Tensor:
    """Final RMSNorm and the LM head (the token embedding when tied)."""
    out = resident["output"]
    head = out["lm_head.weight"] if "lm_head.weight" in out else resident["embedding"]["embed_tokens.weight"]
    return linear(norm(x, out["norm.weight"], cfg.rms_norm_eps), head)


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class LlamaConfig:
    """Llama 2/3.x, Mistral and Qwen 2/2.5/3: pre-RMSNorm decoder, SwiGLU MLP, grouped-query attention.

    ``qkv_bias`` (Qwen 2) adds biases to the q/k/v projections; ``o_bias`` to the
    output projection (Llama's ``attention_bias`` sets both); ``qk_norm`` (Qwen 3)
    RMS-normalises each query and key head before the rotary; ``rope_scaling`` is
    the ``config.json`` dict (``llama3`` and ``linear`` are computed);
    ``sliding_window_size`` (Mistral) limits every layer's attention span.
    """

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_window_size: int | None = None

    family: ClassVar[str] = "llama"
    #: Llama was trained in bf16; fp16 where the GPU lacks it.
    gpu_dtypes: ClassVar[tuple[str, str]] = ("bf16", "fp16")
    kv_read_as_stored: ClassVar[bool] = True
    gguf_architectures: ClassVar[tuple[str, ...]] = ("llama", "mistral", "qwen2", "qwen3")
    hf_model_types: ClassVar[tuple[str, ...]] = ("llama", "mistral", "qwen2", "qwen3")
    #: One norm before the MLP.
    gguf_norms: ClassVar[dict[str, str]] = {"ffn_norm.weight": "post_attention_layernorm.weight"}
    gguf_norm_offset: ClassVar[float] = 0.0
    #: llama.cpp's converter permutes these architectures' q/k rows for its interleaved rotary.
    gguf_permuted: ClassVar[tuple[str, ...]] = ("llama", "mistral")

    def __post_init__(self) -> None:
        check_positive(self, HF_SIZES)
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if kind not in ("default", "llama3", "linear"):
            raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")

    def sliding_window(self, layer_index: int) -> int | None:
        """Mistral-style models attend to the last ``sliding_window_size`` positions in every layer."""
        del layer_index
        return self.sliding_window_size

    def layer_shapes(self, layer_index: int) -> Shapes:
        """Hugging Face keys of ``model.layers.N`` and their shapes."""
        del layer_index
        shapes = decoder_shapes(self)
        n, kv, d = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        if self.qkv_bias:
            shapes |= {"self_attn.q_proj.bias": (n * d,), "self_attn.k_proj.bias": (kv * d,)}
            shapes["self_attn.v_proj.bias"] = (kv * d,)
        if self.qk_norm:
            shapes |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
        if self.o_bias:
            shapes["self_attn.o_proj.bias"] = (self.hidden_size,)
        return shapes

    def resident_shapes(self) -> dict[ModuleKind, Shapes]:
        """The token embedding; the final norm and, unless tied to the embedding, the LM head."""
        output: Shapes = {"norm.weight": (self.hidden_size,)}
        if not self.tie_word_embeddings:
            output["lm_head.weight"] = (self.vocab_size, self.hidden_size)
        return {"embedding": {"embed_tokens.weight": (self.vocab_size, self.hidden_size)}, "output": output}

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON serialisable)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LlamaConfig:
        """Build from :meth:`to_dict` output."""
        config: LlamaConfig = from_fields(cls, data)
        return config

    @classmethod
    def from_gguf(cls, common: dict[str, Any], get: Callable[..., Any], names: set[str]) -> LlamaConfig:
        """From a GGUF file's metadata: ``common`` (the sizes every family reads), ``get(key, default)`` (this
        architecture's fields), ``names`` (its tensors)."""
        window = get("attention.sliding_window", required=False)
        if "rope_freqs.weight" in names:
            raise ValueError(
                "per-frequency rope factors (Llama 3.1 rope scaling) are not read from GGUF; "
                "convert the model's Hugging Face folder instead"
            )
        return cls(
            **common,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            qkv_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            tie_word_embeddings="output.weight" not in names,
            sliding_window_size=None if window is None else int(window),
        )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        """From a Hugging Face ``config.json`` of a Llama, Mistral, Qwen2 or Qwen3 model."""
        model_type = hf.get("model_type", "llama")
        n = hf["num_attention_heads"]
        theta, scaling = hf_rope(hf)
        window = hf.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
            window = None
        return cls(
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_attention_heads=n,
            num_key_value_heads=hf.get("num_key_value_heads") or n,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n,
            max_position_embeddings=hf["max_position_embeddings"],
            vocab_size=hf["vocab_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=theta or 10000.0,
            rope_scaling=scaling,
            qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(hf.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window_size=window,
        )


#: Llama 3.1's rotary scaling (its config.json's rope_scaling).
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

#: Named Llama-family configs (for the planner; a converted store carries its own config).
PRESETS: dict[str, LlamaConfig] = {
    "llama-3.1-70b": LlamaConfig(
        num_layers=80,
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        vocab_size=128256,
        rope_theta=500000.0,
        rope_scaling=LLAMA31_ROPE,
    ),
}


#: The registry's handle on this family's config (:mod:`robot_llm.llm.families.registry`).
CONFIG = LlamaConfig
FAMILY = Family(name="llama", rope=rope, embed=embed, layer=transformer_layer, head=output_head)
