"""Grouped-query attention as every family computes it: the query heads of one KV head folded onto its keys and
values (views of the cache, never a copy per query head), a decode step read where and as the cache stores it by
``attend.c`` (bf16, fp32, or int8 codes with their scales), the rest through torch's fused or eager attention."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import Tensor

from robot_llm.llm.engine.kvquant import QuantKV, materialize
from robot_llm.llm.plan.cpu import cpu_has_native_bf16
from robot_llm.llm.store.gemv import kernels

#: Scores (elements) above which :func:`grouped_attention` keeps torch's fused attention even for many
#: query rows: its eager path writes the scores out (in fp32 for the softmax), 64 MiB at this bound.
EAGER_MAX_SCORES = 1 << 24


#: Query positions a prefill's fused attention takes at a time (:func:`_chunked_attention`): each chunk sees only the
#: keys its queries may, so the causal triangle's upper half is skipped. torch 2.13's CPU flash kernel takes 512 keys
#: a block and so skips nothing at a prompt of 512 (4 rows, 4 query heads over 1 KV head of 256, fp32, AVX2 kernels,
#: ms at 1 / 2 threads: 40 / 19 whole, 25 / 14 in chunks of 64, 27 / 14 of 128; 2,048 positions, 2 threads: 391
#: against 192).
QUERY_CHUNK = 64

#: Per thread, the buffer :func:`grouped_attention`'s eager path packs a step's keys, then its values, into.
_packed = threading.local()


def _contiguous(x: Tensor) -> Tensor:
    """``x`` (a view of the cache) as a contiguous tensor in this thread's reused buffer, where torch's bf16
    matmul would copy it itself: that copy (9.4 MB a layer at batch 32 over 580 keys) grows by a few KB every
    decode step, so glibc's heap never reuses the last step's hole and grows (17.7 MB a step, a 512 + 128
    night at batch 32 peaking at 3.4 GiB against 1.2), and it is slower (5.5 against 7.2 s, 88 steps x 18
    layers). fp32 is multiplied in place; a copy over 32 MiB is left to torch: glibc maps those whatever its
    threshold, and a buffer that size would stay resident."""
    if x.is_contiguous() or x.dtype == torch.float32 or x.device.type != "cpu" or x.nbytes > 1 << 25:
        return x
    buffer = getattr(_packed, "buffer", None)
    if buffer is None or buffer.dtype != x.dtype or buffer.numel() < x.numel():
        buffer = _packed.buffer = torch.empty(x.numel() + x.numel() // 4, dtype=x.dtype)  # room to grow
    return buffer[: x.numel()].view(x.shape).copy_(x)


def _fast_matmul(q: Tensor) -> bool:
    """Whether plain matmuls in ``q``'s dtype are fast here: not for bf16/fp16 on a CPU without native bf16
    (a bf16 cache read in place under fp32 compute, :func:`~robot_llm.llm.engine.kv_cache.reads_in_place`:
    the eager decode path then takes 21 ms a layer against the fused kernel's 2.7, AVX2 kernels)."""
    return q.dtype == torch.float32 or q.device.type != "cpu" or cpu_has_native_bf16()


def _stored(t: Tensor | QuantKV) -> tuple[Tensor, Tensor | None]:
    """A cache tensor as ``attend.c`` takes it: the values themselves, or an int8 cache's codes and scales."""
    if isinstance(t, QuantKV):
        return t.codes, t.scale
    return t, None


def _attention_kernel_serves(q: Tensor, k: Tensor | QuantKV, v: Tensor | QuantKV, mask: Tensor) -> bool:
    """Whether ``attend.c`` reads these operands: CPU, fp32 or bf16 queries, the query contiguous, the keys and
    values fp32, bf16 or an int8 cache (not int4), alike in layout with their head dimension contiguous (a multiple
    of 8 wide), a bool mask of one query position."""
    (kc, ks), (vc, vs) = _stored(k), _stored(v)
    int8 = isinstance(k, QuantKV) and isinstance(v, QuantKV) and k.low is None and v.low is None
    if int8 and (ks is None or vs is None or ks.stride() != vs.stride() or kc.dtype != torch.int8):
        return False
    return (
        q.device.type == kc.device.type == vc.device.type == mask.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and kc.dtype == vc.dtype
        and (kc.dtype in (torch.float32, torch.bfloat16) or int8)
        and q.is_contiguous()
        and kc.stride() == vc.stride()
        and kc.stride(-1) == 1
        and q.shape[-1] % 8 == 0
        and mask.dtype == torch.bool
        and mask.shape == (q.shape[0], 1, 1, kc.shape[1])
    )


def grouped_attention(
    q: Tensor, k: Tensor | QuantKV, v: Tensor | QuantKV, mask: Tensor, scale: float, softcap: float | None = None
) -> Tensor:
    """Attention of ``q [B, T, n, hd]`` over ``k``/``v`` ``[B, S, kv, hd]``, query head ``j`` using KV head
    ``j // (n / kv)``; ``mask [B, 1, T, S]`` True where forbidden. Returns ``[B, T, n * hd]``.

    The keys and values are read where and as they are (views of the cache, never a copy per query head). A
    decode step our kernel reads (:func:`_attention_kernel_serves`) is ``attend.c``'s, an int8 cache's codes and
    scales read as stored; a compressed cache it does not read is dequantized first. Otherwise the ``n / kv``
    query heads of a KV head are folded into its query rows (one product serves ``n / kv * T`` rows); a decode
    step of several rows whose scores fit in :data:`EAGER_MAX_SCORES`, and every soft-capped layer, runs as
    transformers' eager attention (scores scaled after the first matmul, tanh-capped where the family caps,
    softmax in float32, probabilities cast back, masked scores the dtype's minimum so that a fully masked row
    stays finite: 1.5 ms against 2.9 for torch 2.13's CPU flash kernel at batch 32 over 580 keys, bf16), and
    the rest (a prefill) torch's fused attention, where a fully masked row (a pad slot) comes out zero, in chunks of
    query positions (:func:`_chunked_attention`, which takes a bf16 chunk the eager way where bf16 is native).
    """
    B, T, n, hd = q.shape
    kv = k.shape[2]
    group = n // kv
    if T == 1 and _attention_kernel_serves(q, k, v, mask) and (lib := kernels()) is not None:
        (kc, ks), (vc, vs) = _stored(k), _stored(v)
        return lib.decode_attention(q, kc, vc, mask, scale, softcap, None if ks is None or vs is None else (ks, vs))
    if isinstance(k, QuantKV) or isinstance(v, QuantKV):
        k, v = materialize(k, k.shape[1], q.device, q.dtype), materialize(v, v.shape[1], q.device, q.dtype)
    elif q.dtype != k.dtype:  # a query the kernel would have read as it is (attend_with): torch's ops want one dtype
        q = q.to(k.dtype)
    eager = T == 1 < B and B * n * k.shape[1] <= EAGER_MAX_SCORES and _fast_matmul(q)
    if softcap is None and not eager and T >= 2 * QUERY_CHUNK and q.device.type == "cpu":
        return _chunked_attention(q, k, v, mask, scale)
    # [B, T, kv, group, hd] -> [B, kv, group * T, hd]: the rows of one KV head's query heads, head-major.
    rows = q.view(B, T, kv, group, hd).permute(0, 2, 3, 1, 4).reshape(B, kv, group * T, hd)
    keys, values = k.transpose(1, 2), v.transpose(1, 2)
    forbidden = mask if group == 1 else mask[:, :, None].expand(-1, -1, group, -1, -1).reshape(B, 1, group * T, -1)
    if softcap is None and not eager:
        out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=~forbidden, scale=scale)
    else:
        out = _eager(rows, keys, values, forbidden, scale, softcap)
    return out.view(B, kv, group, T, hd).permute(0, 3, 1, 2, 4).reshape(B, T, n * hd)


def _eager(
    rows: Tensor, keys: Tensor, values: Tensor, forbidden: Tensor, scale: float, softcap: float | None
) -> Tensor:
    """transformers' eager attention of ``rows [B, kv, R, hd]`` over ``keys``/``values`` ``[B, kv, S, hd]`` (views of
    the cache), ``forbidden [B, 1, R, S]``: the scores scaled after the first matmul, tanh-capped where the family
    caps, masked to the dtype's minimum (a row that sees no key stays finite), softmax in fp32, the probabilities
    cast back to the rows' dtype."""
    # keys @ rows^T, read transposed: the keys are a view of the cache (rows strided by its length), which torch's
    # CPU bmm copies whole when it is the transposed operand (5.1 against 0.6 ms for a batch-32 decode step's 580
    # keys), not when it is the plain one.
    scores = torch.matmul(_contiguous(keys), rows.transpose(2, 3)).transpose(2, 3) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(forbidden, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(rows.dtype)
    return torch.matmul(probs, _contiguous(values))  # the keys' buffer, free again


def _chunked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """:func:`grouped_attention` through torch's fused attention, :data:`QUERY_CHUNK` query positions at a time, each
    chunk over the span of keys any of its queries may see (the mask's first to last allowed key): a prefill's
    causal triangle is not computed in full, and a sliding window's far keys are skipped. The values are the unchunked
    call's: a key outside the span is masked for every query of the chunk, and a chunk none of whose queries sees a
    key (all pad slots) comes out zero, as a fully masked row does. In bf16 on a CPU with native bf16, a chunk every
    query of which sees a key is transformers' eager attention (:func:`_eager`) instead: the same values up to bf16's
    rounding of the probabilities, which transformers' own eager attention makes too."""
    B, T, n, hd = q.shape
    kv = k.shape[2]
    group = n // kv
    out = q.new_zeros(B, T, n * hd)
    # bf16 where the CPU has it: the eager way (:func:`_eager`) for a chunk every query of which sees a key (the
    # fused kernel makes a row that sees none zero): 4 rows of 64 positions x 4 query heads over 512 keys of 256,
    # 1 thread, Zen 5, 6.0 against 3.0 ms fused (fp32 the other way: 5.8 against 8.7).
    eager = q.dtype == torch.bfloat16 and q.device.type == "cpu" and cpu_has_native_bf16()
    for t0 in range(0, T, QUERY_CHUNK):
        t1 = min(T, t0 + QUERY_CHUNK)
        part = mask[:, :, t0:t1]
        seen = (~part).any(dim=2).any(dim=1).any(dim=0).nonzero()
        if seen.numel() == 0:
            continue
        lo, hi = int(seen[0]), int(seen[-1]) + 1
        c = t1 - t0
        rows = q[:, t0:t1].reshape(B, c, kv, group, hd).permute(0, 2, 3, 1, 4).reshape(B, kv, group * c, hd)
        part = part[..., lo:hi]
        forbidden = part if group == 1 else part[:, :, None].expand(-1, -1, group, -1, -1).reshape(B, 1, group * c, -1)
        keys, values = k[:, lo:hi].transpose(1, 2), v[:, lo:hi].transpose(1, 2)
        allowed = ~forbidden
        if eager and bool(allowed.any(dim=-1).all()) and forbidden.numel() * kv <= EAGER_MAX_SCORES:
            o = _eager(rows, keys, values, forbidden, scale, None)
        else:
            o = F.scaled_dot_product_attention(rows, keys, values, attn_mask=allowed, scale=scale)
        out[:, t0:t1] = o.view(B, kv, group, c, hd).permute(0, 3, 1, 2, 4).reshape(B, c, n * hd)
    return out
