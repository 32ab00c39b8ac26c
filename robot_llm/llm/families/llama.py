"""The Llama family forward pass (Llama 2/3.x, Mistral, Qwen 2/2.5/3) in plain PyTorch: the ``llama`` :class:`Family`.

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

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from robot_llm.llm.engine.kv_cache import LayerKV, attend_with
from robot_llm.llm.families.config_hf import LlamaConfig
from robot_llm.llm.families.family import (
    Family,
    Params,
    Resident,
    StepInfo,
    apply_rotary,
    embedding,
    grouped_attention,
    linear,
    rope_inv_freq,
)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama's RMSNorm: statistics in float32, weight applied in the input dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


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
    q = linear(a_in, p["self_attn.q_proj.weight"], p.get("self_attn.q_proj.bias")).view(B, T, -1, d)
    k = linear(a_in, p["self_attn.k_proj.weight"], p.get("self_attn.k_proj.bias")).view(B, T, -1, d)
    v = linear(a_in, p["self_attn.v_proj.weight"], p.get("self_attn.v_proj.bias")).view(B, T, -1, d)
    if cfg.qk_norm:
        q = rms_norm(q, p["self_attn.q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, p["self_attn.k_norm.weight"], cfg.rms_norm_eps)
    cos, sin = step.rotary["rope"]
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    mask = step.mask_for(cfg.sliding_window_size)
    if kv is not None:
        k, v = kv.update(k, v)
        q, mask = attend_with(q, mask, k)
    o = grouped_attention(q, k, v, mask, 1.0 / math.sqrt(d)).to(a_in.device, a_in.dtype)
    return linear(o, p["self_attn.o_proj.weight"], p.get("self_attn.o_proj.bias"))


def transformer_layer(
    x: Tensor, p: Params, cfg: LlamaConfig, layer_index: int, step: StepInfo, kv: LayerKV | None = None
) -> Tensor:
    """One pre-RMSNorm decoder layer with a SwiGLU MLP."""
    del layer_index
    h = x + attention(rms_norm(x, p["input_layernorm.weight"], cfg.rms_norm_eps), p, cfg, step, kv)
    m = rms_norm(h, p["post_attention_layernorm.weight"], cfg.rms_norm_eps)
    gated = F.silu(linear(m, p["mlp.gate_proj.weight"])) * linear(m, p["mlp.up_proj.weight"])
    return h + linear(gated, p["mlp.down_proj.weight"])


def output_head(x: Tensor, resident: Resident, cfg: LlamaConfig) -> Tensor:
    """Final RMSNorm and the LM head (the token embedding when tied)."""
    out = resident["output"]
    head = out["lm_head.weight"] if "lm_head.weight" in out else resident["embedding"]["embed_tokens.weight"]
    return linear(rms_norm(x, out["norm.weight"], cfg.rms_norm_eps), head)


FAMILY = Family(name="llama", rope=rope, embed=embed, layer=transformer_layer, head=output_head)
