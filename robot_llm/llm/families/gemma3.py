"""Gemma 3 (text) forward pass in plain PyTorch: the ``gemma3`` :class:`Family`.

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

import torch
import torch.nn.functional as F
from torch import Tensor

from robot_llm.llm.engine.kv_cache import LayerKV, attend_with
from robot_llm.llm.families.config_hf import FULL, SLIDING, Gemma3Config
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
    """Gemma's RMSNorm: float32 throughout, gain ``1 + weight``, then back to the input dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


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
    q = rms_norm(linear(a_in, p["self_attn.q_proj.weight"]).view(B, T, -1, d), p["self_attn.q_norm.weight"], eps)
    k = rms_norm(linear(a_in, p["self_attn.k_proj.weight"]).view(B, T, -1, d), p["self_attn.k_norm.weight"], eps)
    v = linear(a_in, p["self_attn.v_proj.weight"]).view(B, T, -1, d)
    cos, sin = step.rotary[cfg.layer_types[index]]
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    mask = step.mask_for(cfg.sliding_window(index))
    if kv is not None:
        k, v = kv.update(k, v)
        q, mask = attend_with(q, mask, k)
    o = grouped_attention(q, k, v, mask, cfg.query_pre_attn_scalar**-0.5, cfg.attn_logit_softcapping)
    o = o.to(a_in.device, a_in.dtype)
    return linear(o, p["self_attn.o_proj.weight"])


def transformer_layer(
    x: Tensor, p: Params, cfg: Gemma3Config, layer_index: int, step: StepInfo, kv: LayerKV | None = None
) -> Tensor:
    """One Gemma 3 decoder layer: four norms, attention, GeGLU MLP with the tanh GELU."""
    eps = cfg.rms_norm_eps
    a = attention(rms_norm(x, p["input_layernorm.weight"], eps), p, cfg, layer_index, step, kv)
    h = x + rms_norm(a, p["post_attention_layernorm.weight"], eps)
    m = rms_norm(h, p["pre_feedforward_layernorm.weight"], eps)
    gated = F.gelu(linear(m, p["mlp.gate_proj.weight"]), approximate="tanh") * linear(m, p["mlp.up_proj.weight"])
    return h + rms_norm(linear(gated, p["mlp.down_proj.weight"]), p["post_feedforward_layernorm.weight"], eps)


def output_head(x: Tensor, resident: Resident, cfg: Gemma3Config) -> Tensor:
    """Final norm, the tied LM head, and the optional final soft-capping."""
    y = rms_norm(x, resident["output"]["norm.weight"], cfg.rms_norm_eps)
    logits = linear(y, resident["embedding"]["embed_tokens.weight"])
    if cfg.final_logit_softcapping is not None:
        logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return logits


FAMILY = Family(name="gemma3", rope=rope, embed=embed, layer=transformer_layer, head=output_head)
