"""YaLM forward pass (docs/yalm-model.md §3-§4) as pure functions: the ``yalm`` :class:`Family`.

Weights are plain ``dict[str, Tensor]`` per module, keyed by the *release* key
names with the module prefix stripped (exactly the keys of one
``layer_NN-model_00-model_states.pt`` file, see :mod:`robot_llm.llm.store.checkpoint`
and :meth:`YalmConfig.layer_shapes`):

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
given. The step machinery (KV cache, masks, rotary factors, left padding) is
shared by all families: :mod:`robot_llm.llm.families.family`. :class:`Yalm` is the
in-memory model loaded from a release checkpoint.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from robot_llm.llm.engine.kv_cache import LayerKV, attend_with
from robot_llm.llm.families.config import YalmConfig
from robot_llm.llm.families.family import (
    Family,
    Params,
    Resident,
    StepInfo,
    apply_rotary,
    embedding,
    linear,
)

#: Score written over masked attention logits (masked_fill, as the original does).
MASK_VALUE = -10000.0


def rope(cfg: YalmConfig) -> dict[str, Tensor]:
    """Inverse frequencies exactly as the original computes them (§3.4.3): ``float32(1e-4) ** (2i / hn)``."""
    hn = cfg.head_dim
    return {"rope": torch.tensor(1e-4, dtype=torch.float32) ** (torch.arange(0, hn, 2, dtype=torch.float32) / hn)}


# --------------------------------------------------------------------------- the pieces


def _layer_norm(x: Tensor, params: Params, prefix: str, eps: float) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), params[f"{prefix}.weight"], params[f"{prefix}.bias"], eps)


def embed(ids: Tensor, resident: Resident, cfg: YalmConfig) -> Tensor:
    """Word embedding (§3.1) and projector (§3.2): ``ids [B, T]`` -> ``x [B, T, H]``.

    Computes in the dtype of ``word_embeddings.weight``; ``ids`` must be on its device.
    """
    e = embedding(ids, resident["embedding"]["word_embeddings.weight"])
    p = _layer_norm(e, resident["projector"], "input_layernorm", cfg.layernorm_epsilon)
    if cfg.embedding_size == cfg.hidden_size:
        return p
    return F.pad(p, (0, cfg.hidden_size - cfg.embedding_size))


def attention(a_in: Tensor, params: Params, cfg: YalmConfig, step: StepInfo, kv: LayerKV | None) -> Tensor:
    """Self-attention (§3.4) without the output bias: returns ``A`` of ``h = x + (A + b_o)``."""
    B, T, H = a_in.shape
    n, hn = cfg.num_attention_heads, cfg.head_dim
    c = linear(a_in, params["attention.query_key_value.weight"], params["attention.query_key_value.bias"])
    # Fused layout is per-head interleaved [n, 3, hn] (§3.4.2).
    q, k, v = c.view(B, T, n, 3, hn).unbind(dim=3)
    cos, sin = step.rotary["rope"]
    q = apply_rotary(q, cos, sin)
    k = apply_rotary(k, cos, sin)
    mask = step.mask
    if kv is not None:
        k, v = kv.update(k, v)
        q, mask = attend_with(q, mask, k)
    S = k.shape[1]
    q = q.transpose(1, 2).reshape(B * n, T, hn)
    k = k.permute(0, 2, 3, 1).reshape(B * n, hn, S)
    v = v.transpose(1, 2).reshape(B * n, S, hn)
    # Scale applied as the GEMM's alpha, like the original (matters for fp16 rounding).
    scores = torch.baddbmm(
        torch.empty(B * n, T, S, dtype=q.dtype, device=q.device), q, k, beta=0.0, alpha=1.0 / math.sqrt(hn)
    ).view(B, n, T, S)
    scores = scores.masked_fill(mask, MASK_VALUE)
    probs = torch.softmax(scores, dim=-1)
    o = torch.bmm(probs.view(B * n, T, S), v).view(B, n, T, hn).transpose(1, 2).reshape(B, T, H)
    o = o.to(a_in.device, a_in.dtype)
    return linear(o, params["attention.dense.weight"])


def geglu_mlp(m_in: Tensor, params: Params) -> Tensor:
    """GeGLU MLP (§3.5) without the output bias: returns ``M`` of ``x' = h + (M + b_out)``."""
    u = linear(m_in, params["mlp.dense_ffn_hidden.weight"])
    r = F.gelu(u + params["mlp.dense_ffn_hidden.bias"])
    g = linear(m_in, params["mlp.dense_ffn_gate.weight"], params["mlp.dense_ffn_gate.bias"])
    return linear(r * g, params["mlp.dense_ffn_output.weight"])


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


def output_head(x: Tensor, resident: Resident, cfg: YalmConfig) -> Tensor:
    """Output layer and tied LM head (§3.6): ``x [B, T, H]`` -> logits ``[B, T, V]`` in x's dtype."""
    eps = cfg.layernorm_epsilon
    out_params, word_embeddings = resident["output"], resident["embedding"]["word_embeddings.weight"]
    y = _layer_norm(x, out_params, "input_layer_norm", eps)
    z = F.linear(y, out_params["dense.weight"]) + out_params["dense.bias"]
    z = _layer_norm(F.gelu(z), out_params, "output_layer_norm", eps)
    return linear(z, word_embeddings, out_params["output_bias"])


FAMILY = Family(name="yalm", rope=rope, embed=embed, layer=transformer_layer, head=output_head)
