"""A decode step's decoder layer in one call of ours (``layer.c``): the same kernels the family's Python path calls,
in the same order on the same operands (so the same output, to the bit), without the Python between them.

A batch-1 decode step of Gemma 3 270M made some 15 kernel calls a layer; the Python between them (each call's
checks, views, a new tensor) took about 5 ms of a 31 ms step at 1 thread and of a 20 ms one at 2 (2-core Emerald
Rapids VM, AVX512-VNNI, fp32 compute): time no thread count shrinks. Now it is one call a layer and under 1 ms a
step. :func:`decode_layer` takes a layer whole where every part of it is one of our kernels' (its list), and says
None otherwise: the family then runs its Python path, which handles every case. ``ROBOT_LLM_ONE_CALL_LAYER=0``
turns it off."""

from __future__ import annotations

import ctypes
import functools
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from robot_llm.llm.engine.kv_cache import LayerKV, int8_on_cpu, reads_in_place
from robot_llm.llm.engine.kvquant import QuantKV
from robot_llm.llm.families.family import GATE_UP, QKV, Params, StepInfo, int8_activations_form
from robot_llm.llm.families.gated import ACTIVATIONS
from robot_llm.llm.families.norm import gain_serves
from robot_llm.llm.store.gemv import Kernels, int8_products, kernels, plain_rows
from robot_llm.llm.store.int8act import int8_activations_for, int8_kernels_for

ENV = "ROBOT_LLM_ONE_CALL_LAYER"
_I64, _I32, _F32, _PTR = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p


class _Products(ctypes.Structure):
    """``layer.c``'s ``products``: matrices that meet one input."""

    _fields_ = [("mats", _I64 * 18), ("width", _I64), ("rotation", _I64)]


class _Layer(ctypes.Structure):
    """``layer.c``'s ``decode_layer``, field for field."""

    _fields_ = [
        ("x", _PTR), ("out", _PTR),
        *[(name, _I64) for name in ("rows", "hidden", "heads", "kv_heads", "hd", "intermediate")],
        *[(name, _I32) for name in ("dtype", "norm_dtype", "gain_rounded", "act", "levels", "threads")],
        *[(name, _F32) for name in ("eps", "offset", "scale", "softcap")],
        *[(name, _PTR) for name in ("input_norm", "q_norm", "k_norm", "post_attention_norm", "pre_mlp_norm")],
        ("post_mlp_norm", _PTR),
        *[(name, _Products) for name in ("qkv", "o", "gate_up", "down")],
        ("k_cache", _PTR), ("v_cache", _PTR),
        *[(name, _I64) for name in ("sb", "ss", "sh", "slot", "S", "mb", "ms")],
        ("kv_dtype", _I32), ("pad", _I32),
        ("mask", _PTR), ("cos", _PTR), ("sin", _PTR),
        ("k_scales", _PTR), ("v_scales", _PTR), *[(name, _I64) for name in ("tb", "ts", "th")],
    ]  # fmt: skip


@dataclass(frozen=True)
class LayerSpec:
    """What a family's decoder layer is, for ``layer.c``: its norms' keys (``None``: that norm is not in the family's
    layer; the post norms then add their residual to the product as it is), how they scale (``offset``,
    ``gain_rounded``: :func:`~robot_llm.llm.families.norm.rms_norm`'s), the MLP's activation
    (:data:`~robot_llm.llm.families.gated.ACTIVATIONS`), the attention's score scale and soft-cap, the layer's
    sliding window (None: causal), rotary table and head size."""

    norms: tuple[str | None, ...]  # input, q, k, post-attention, pre-MLP, post-MLP
    eps: float
    offset: float
    gain_rounded: bool
    activation: str
    scale: float
    softcap: float | None
    window: int | None
    rotary: str
    head_dim: int


@functools.cache
def enabled() -> bool:
    """False where ``ROBOT_LLM_ONE_CALL_LAYER`` turns the one-call layer off (e.g. to measure one path against the
    other), else True."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def decode_layer(x: Tensor, p: Params, kv: LayerKV | None, step: StepInfo, spec: LayerSpec) -> Tensor | None:
    """The decoder layer ``spec`` over ``x [B, 1, H]`` in one call of ``layer.c`` (the step's keys and values written
    into ``kv``), or None where a part of it is not one of our kernels' and the family's Python path must run it:

    * a decode step (one position a row) with a cache (:func:`_cache_tensors`): plain fp32 or bf16 tensors in x's dtype
      or bf16 under fp32 compute (:func:`~robot_llm.llm.engine.kv_cache.reads_in_place`), or an int8 cache's codes and
      scales; no int4 codes, no shared prefix;
    * x contiguous fp32 or bf16 on the CPU, of at most :data:`~robot_llm.llm.store.int8act.ONE_CALL_ROWS` rows;
    * every matrix multiplied with int8 activations (:func:`~robot_llm.llm.families.family.int8_activations_form`),
      no biases, and each group (q, k, v; gate, up) of one width and rotation;
    * the norms' gains contiguous and in one float dtype, the rotary and the mask as the step makes them.

    What comes of the weights alone is made once per layer and kept while they live (:func:`_weights`)."""
    if x.shape[1] != 1 or kv is None or step.last_only or not plain_rows(x) or not enabled():
        return None
    lib, dtype, rows = kernels(), x.dtype, x.shape[0]
    ours = int8_kernels_for(rows)
    if lib is None or ours is None or ours.linears is None or not int8_activations_for(rows, dtype):
        return None
    cache = _cache_tensors(kv, x)
    held = _weights(x, p, spec, lib) if cache is not None else None
    if cache is None or held is None:
        return None
    kc, vc, scales = cache
    (cos, sin), mask, S, hd = step.rotary[spec.rotary], step.mask_for(spec.window), kv.start + 1, spec.head_dim
    shape = (rows, 1, 1, hd)
    if kc.shape[2] != held.kv_heads or kc.shape[3] != hd or kc.shape[1] < S:
        return None
    if cos.dtype is not dtype or sin.dtype is not dtype or cos.shape != shape or sin.shape != shape:
        return None
    if not (cos.is_contiguous() and sin.is_contiguous() and mask.dtype is torch.bool and mask.shape == (rows, 1, 1, S)):
        return None
    out, layer = torch.empty_like(x), _Layer.from_buffer_copy(held)
    layer.x, layer.out, layer.rows, layer.threads = x.data_ptr(), out.data_ptr(), rows, torch.get_num_threads()
    layer.k_cache, layer.v_cache, layer.kv_dtype = kc.data_ptr(), vc.data_ptr(), lib.dtype_codes[kc.dtype]
    layer.sb, layer.ss, layer.sh = kc.stride()[:3]
    layer.slot, layer.S, layer.mb, layer.ms = kv.start, S, mask.stride(0), mask.stride(3)
    layer.mask, layer.cos, layer.sin = mask.data_ptr(), cos.data_ptr(), sin.data_ptr()
    if scales is not None:
        layer.k_scales, layer.v_scales = scales[0].data_ptr(), scales[1].data_ptr()
        layer.tb, layer.ts, layer.th = scales[0].stride()[:3]
    if lib.lib.rl_decode_layer(ctypes.byref(layer)):
        raise MemoryError(f"decode_layer: no memory for the buffers of {rows} rows")
    return out


#: :func:`_weights`' answers by the id of the layer's down projection: weak references to every weight it read (the
#: answer stands while they are these), x's dtype, the spec, and the answer. An entry goes with that matrix.
_HELD: dict[int, tuple[tuple[weakref.ref[Any], ...], torch.dtype, LayerSpec, _Layer | None]] = {}


def _weights(x: Tensor, p: Params, spec: LayerSpec, lib: Kernels) -> _Layer | None:
    """The layer's fields that come of its weights and x's dtype (the products, norms, sizes and constants), the
    rest zero; None where they are not what ``layer.c`` multiplies and norms. Made once per layer: checking and
    gathering them took some 150 us a layer, 2-3 ms of a batch-1 step (Gemma 3 270M, 1 thread)."""
    weights = [p[key] for key in (*QKV, "self_attn.o_proj.weight", *GATE_UP, "mlp.down_proj.weight")]
    weights += [p[key] for key in spec.norms if key is not None]
    down = weights[6]
    known = _HELD.get(id(down))
    if known is not None and known[1] is x.dtype and known[2] == spec and len(known[0]) == len(weights):
        if all(ref() is w for ref, w in zip(known[0], weights, strict=True)):
            return known[3]
    elif known is None:
        weakref.finalize(down, _HELD.pop, id(down), None)
    answer = _fields(x, p, spec, lib)
    _HELD[id(down)] = (tuple(weakref.ref(w) for w in weights), x.dtype, spec, answer)
    return answer


def _fields(x: Tensor, p: Params, spec: LayerSpec, lib: Kernels) -> _Layer | None:
    """:func:`_weights`' answer, made."""
    rows, H, hd, dtype = x.shape[0], x.shape[-1], spec.head_dim, x.dtype
    qkv, gate_up = _products(x, p, QKV, rows, H), _products(x, p, GATE_UP, rows, H)
    if qkv is None or gate_up is None:
        return None
    (q_n, k_n, v_n), (inter, up_n) = qkv[1], gate_up[1]
    o = _products(x, p, ("self_attn.o_proj.weight",), rows, q_n)
    down = _products(x, p, ("mlp.down_proj.weight",), rows, inter)
    if o is None or down is None or o[1] != [H] or down[1] != [H] or up_n != inter or k_n != v_n:
        return None
    heads, kv_heads = q_n // hd, k_n // hd
    if heads * hd != q_n or kv_heads * hd != k_n or heads % kv_heads or hd % 8:
        return None
    norms, sizes = [None if key is None else p[key] for key in spec.norms], (H, hd, hd, H, H, H)
    gains = {w.dtype for w in norms if w is not None}
    if len(gains) != 1 or not all(
        w is None or gain_serves(w, n, dtype, spec.gain_rounded) for w, n in zip(norms, sizes, strict=True)
    ):
        return None
    codes = lib.dtype_codes
    return _Layer(
        0, 0, 0, H, heads, kv_heads, hd, inter, codes[dtype], codes[gains.pop()], spec.gain_rounded,
        ACTIVATIONS[spec.activation], lib.activation_levels, 0, spec.eps, spec.offset, spec.scale, spec.softcap or 0.0,
        *[0 if w is None else w.data_ptr() for w in norms], qkv[0], o[0], gate_up[0], down[0],
    )  # fmt: skip


def _cache_tensors(kv: LayerKV, x: Tensor) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None] | None:
    """This layer's keys and values as ``layer.c`` writes and reads them (with an int8 cache's scales, else None), or
    None where it cannot as the Python path does: plain CPU tensors alike in dtype and strides, their head dimension
    contiguous, in the compute dtype or bf16 under fp32, or an int8 cache's codes and scales
    (:func:`~robot_llm.llm.engine.kv_cache.int8_on_cpu`) alike so; no shared prefix."""
    k, v = kv.k, kv.v
    if kv.prefix_k is not None or kv.attend_where_stored:
        return None
    scales = None
    if isinstance(k, QuantKV) and isinstance(v, QuantKV):
        if not (int8_on_cpu(k, x) and int8_on_cpu(v, x)) or k.scale.stride() != v.scale.stride():
            return None
        (kc, vc), scales = (k.codes, v.codes), (k.scale, v.scale)
    elif isinstance(k, Tensor) and isinstance(v, Tensor) and (k.dtype is x.dtype or reads_in_place(k, x)):
        kc, vc = k, v
    else:
        return None
    serves = vc.dtype is kc.dtype and kc.is_cpu and vc.is_cpu and kc.stride() == vc.stride() and kc.stride(-1) == 1
    return (kc, vc, scales) if serves else None


def _products(x: Tensor, p: Params, keys: tuple[str, ...], rows: int, k: int) -> tuple[_Products, list[int]] | None:
    """The matrices ``keys`` of ``p`` as ``layer.c`` multiplies rows of ``k`` columns by them with int8 activations,
    and each one's outputs; None where one of them is not multiplied so, has a bias, or differs from the first in
    width or rotation."""
    forms = [int8_activations_form(x, p[key], rows) for key in keys]
    if any(f is None for f in forms) or any(key.removesuffix("weight") + "bias" in p for key in keys):
        return None
    first = forms[0]
    assert first is not None
    if any(f is None or (f.shape[1], f.rotation) != (first.shape[1], first.rotation) for f in forms):
        return None
    args = int8_products(k, tuple((f.q, f.scale32(), f.offset) for f in forms if f is not None), first.rotation)
    outputs = [f.shape[0] for f in forms if f is not None]
    return _Products((_I64 * 18)(*args), first.shape[1], first.rotation), outputs
