"""Our decode-step kernels beside gemv.c: the RMSNorm (norm.c: torch's op chain, each op rounded as torch stores
it, but for the sum of squares) and the attention of one new position (attend.c: fp64's to fp32 rounding, the
cache read in place); torch's ops wherever they cannot read the operands, whole models computing as with
torch's; and RAM-homed layers whose weights are built once even where their norm gains are stored in another
dtype."""

from __future__ import annotations

import dataclasses
import itertools
import os
from pathlib import Path

import pytest
import torch
from torch import Tensor

from robot_llm.llm.engine import stream_slots
from robot_llm.llm.engine.kvquant import QuantKV
from robot_llm.llm.engine.memory import InMemoryModel
from robot_llm.llm.engine.streaming import StreamingModel
from robot_llm.llm.families import attention, family, norm
from robot_llm.llm.families.attention import grouped_attention
from robot_llm.llm.families.family import QKV, apply_rotary, random_weights
from robot_llm.llm.families.gemma3 import Gemma3Config
from robot_llm.llm.families.llama import LlamaConfig
from robot_llm.llm.plan.cpu import cpu_flags, cpu_has_amx
from robot_llm.llm.store import int8act, qhead
from robot_llm.llm.store.gemv import kernels
from robot_llm.llm.store.int8act import (
    ONE_CALL_ROWS,
    int8_dynamic_linear,
    int8_kernels_for,
    our_int8_mm_max_rows,
    quantize_activations,
    rotate,
    rotate_int8_in_place,
    rotated_int8_copy,
    vnni_pack,
)
from robot_llm.llm.store.qhead import QuantizedTable
from robot_llm.llm.store.quant import PackedInt4, PackedInt8, quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(not {"avx2", "fma"} <= cpu_flags(), reason="built where gemv.c is (AVX2, FMA)")


def _torch_chain(
    x: Tensor, w: Tensor, gain_rounded: bool, rotary: tuple[Tensor, Tensor] | None, residual: Tensor | None
) -> Tensor:
    """The families' norms as they were written in torch ops (Gemma: gain 1 + w in fp32; Llama: w after the cast)."""
    if gain_rounded:
        y = w * torch.rms_norm(x.float(), x.shape[-1:], None, 1e-6).to(x.dtype)
    else:
        y = torch.rms_norm(x.float(), x.shape[-1:], 1.0 + w.float(), 1e-6).type_as(x)
    if rotary is not None:
        y = apply_rotary(y, *rotary)
    return y if residual is None else residual + y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_kernel_computes_torchs_chain(dtype: torch.dtype) -> None:
    lib = kernels()
    assert lib is not None
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 1, 4, 256), (3, 5, 1, 64), (2, 7, 2, 90)]  # decode, prefill, an odd head size
    weight_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    for shape, w_dtype, gain_rounded, rotated, added in itertools.product(
        shapes, weight_dtypes, (False, True), (False, True), (False, True)
    ):
        if gain_rounded and w_dtype != dtype:
            continue  # Llama's weight is applied in x's dtype: another dtype goes to torch (below)
        x = (torch.randn(shape, generator=g) * 3).to(dtype)
        w = (torch.randn(shape[-1], generator=g) * 0.3).to(w_dtype)
        tables = [torch.randn(*shape[:2], 1, shape[-1], generator=g).to(dtype) for _ in range(2)]
        rotary = (tables[0], tables[1]) if rotated else None
        residual = torch.randn(shape, generator=g).to(dtype) if added else None
        offset = 0.0 if gain_rounded else 1.0
        got = lib.rms_norm(x, w, 1e-6, offset=offset, gain_rounded=gain_rounded, rotary=rotary, residual=residual)
        want = _torch_chain(x, w, gain_rounded, rotary, residual)
        assert got.shape == want.shape and got.dtype == dtype
        # The sum of squares in double against torch's fp32 moves the scale a unit in fp32's last place at most,
        # which flips a bf16 rounding now and then: one bf16 unit, rarely.
        unit = 2**-7 if dtype == torch.bfloat16 else 1e-6
        assert (got.float() - want.float()).abs().max() <= unit * want.float().abs().max()
        if dtype == torch.bfloat16:
            assert (got != want).float().mean() <= 0.02, (shape, w_dtype, gain_rounded, rotated, added)
    # A batch-32 step's q norm with its rotary is split over threads (from 8,192 values): the same bits as one thread.
    x, w = torch.randn(32, 1, 4, 256, generator=g).to(dtype), torch.randn(256, generator=g).to(dtype)
    tables = tuple(torch.randn(32, 1, 1, 256, generator=g).to(dtype) for _ in range(2))
    before = torch.get_num_threads()
    outs = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        outs.append(lib.rms_norm(x, w, 1e-6, offset=1.0, rotary=tables))
    torch.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs)
    # No norm (weight None): the rotary alone, Llama without a q/k norm.
    x = torch.randn(2, 3, 2, 8, generator=g).to(dtype)
    cos, sin = (torch.randn(2, 3, 1, 8, generator=g).to(dtype) for _ in range(2))
    assert torch.equal(lib.rms_norm(x, None, 1e-6, rotary=(cos, sin)), apply_rotary(x, cos, sin))


def test_torch_serves_what_the_kernel_cannot_read(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, 32, generator=g).bfloat16()
    w = torch.randn(32, generator=g)
    strided = x.transpose(0, 1)  # not contiguous
    fp32_weight_llama = (strided.contiguous(), w, True)  # Llama's weight in another dtype: torch's promotion
    for operand, weight, gain_rounded in ((strided, w.bfloat16(), False), fp32_weight_llama):
        assert not norm._norm_kernel_serves(operand, weight, gain_rounded, None, None)
        got = norm.rms_norm(operand, weight, 1e-6, offset=0.0 if gain_rounded else 1.0, gain_rounded=gain_rounded)
        assert torch.equal(got, _torch_chain(operand, weight, gain_rounded, None, None))
        assert got.dtype == (torch.float32 if gain_rounded else torch.bfloat16)
    # A rotary table of another layout than [..., 1, n] per position, and a residual of another dtype.
    rows = torch.randn(4, 6, 2, 32, generator=g).bfloat16()
    assert not norm._norm_kernel_serves(rows, w, False, (rows, rows), None)
    assert not norm._norm_kernel_serves(x, w, False, None, x.float())
    # Without the kernel (ROBOT_LLM_GEMV=0, or no compiler) every norm is torch's.
    monkeypatch.setattr(norm, "kernels", lambda: None)
    assert not norm._norm_kernel_serves(x, w, False, None, None)
    assert torch.equal(norm.rms_norm(x, w, 1e-6, offset=1.0, residual=x), _torch_chain(x, w, False, None, x))


def _gemma() -> Gemma3Config:
    return Gemma3Config(
        num_layers=2,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        vocab_size=300,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window_size=5,
        query_pre_attn_scalar=16.0,
    )


def _qwen3() -> LlamaConfig:
    return LlamaConfig(
        num_layers=2,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        vocab_size=300,
        qk_norm=True,
    )


@pytest.mark.parametrize("make", [_gemma, _qwen3], ids=["gemma3", "qwen3-qk-norm"])
def test_a_bf16_model_computes_as_with_torchs_ops(make: type, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make()
    weights = random_weights(cfg, seed=3, std=0.2)
    ids = torch.randint(3, 300, (3, 9), generator=torch.Generator().manual_seed(2))
    pad = torch.tensor([0, 2, 4])

    def night(dtype: str) -> Tensor:
        model = InMemoryModel(cfg, weights, dtype=dtype)
        cache = model.new_cache(3, 14, pad)
        out = [model.forward(ids, cache)] + [model.forward(torch.full((3, 1), 7 + s), cache) for s in range(4)]
        return torch.cat([o.reshape(3, -1) for o in out], dim=1)

    calls: list[int] = []
    real = norm.kernels
    monkeypatch.setattr(norm, "kernels", lambda: calls.append(1) or real())
    ours = night("bf16")
    assert calls  # the kernels served
    monkeypatch.setattr(norm, "kernels", lambda: None)
    monkeypatch.setattr(attention, "kernels", lambda: None)
    torchs, exact = night("bf16"), night("fp32")
    # The norms are torch's to the bit on the CPUs measured, the attention fp32 throughout (torch's eager decode
    # attention rounds its scores to bf16): as close to the fp32 model as torch's ops in bf16 come.
    assert (ours - exact).abs().max() <= 1.25 * (torchs - exact).abs().max()
    assert (ours - exact).abs().mean() <= 1.1 * (torchs - exact).abs().mean()


def test_ram_homed_layers_are_built_once_with_gains_in_another_dtype(
    stores: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The int8 store keeps its norm weights in fp16; compute in bf16 converts them, into the slot's buffers.
    built: list[int] = []
    real = StreamingModel._to_compute
    monkeypatch.setattr(StreamingModel, "_to_compute", lambda self, *a: built.append(1) or real(self, *a))
    ids = torch.randint(5, 600, (2, 6), generator=torch.Generator().manual_seed(4))

    def night() -> list[Tensor]:
        model = StreamingModel(stores["int8"], home="ram", device="cpu", dtype="bf16")
        cache = model.new_cache(2, 12)
        out = [model.forward(ids, cache)] + [model.forward(torch.full((2, 1), 9 + s), cache) for s in range(3)]
        model.close()
        assert model.stats.forwards == 4
        return out

    reused = night()
    assert len(built) == 2  # each of the fixture's layers once, for four passes
    # Once a layer has run, what its matrices made dense is dropped (a prefill's widened copies would stay resident).
    model = StreamingModel(stores["int8"], home="ram", device="cpu", dtype="bf16")
    model.forward(torch.randint(5, 600, (3, 60), generator=torch.Generator().manual_seed(5)))  # 180 rows: widened
    packed = [p for params in model.ram_params.values() for p in params.values() if isinstance(p, PackedInt8)]
    assert packed and all(p._widened is None and p._dense is None for p in packed)
    model.close()
    # Rebuilt every pass (as before), the passes compute the same.
    monkeypatch.setattr("robot_llm.llm.engine.streaming.kept_for_reuse", lambda params, buffers: None)
    built.clear()
    for got, want in zip(reused, night(), strict=True):
        assert torch.equal(got, want)
    assert len(built) == 8
    # A large tensor converted into a slot's buffer is not copied: that layer is rebuilt each pass.
    big = torch.empty(stream_slots.OWN_COPY_MAX + 1)
    assert stream_slots.kept_for_reuse({"w": big}, {"w": big}) is None
    assert stream_slots.kept_for_reuse({"g": big[:8]}, {"g": big})["g"].data_ptr() != big.data_ptr()


def _attention_in_fp64(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float | None) -> Tensor:
    """Attention of ``q [B, 1, n, hd]`` over ``k``/``v`` ``[B, S, kv, hd]`` in float64, a fully masked row zero."""
    B, T, n, hd = q.shape
    kv = k.shape[2]
    rows = q.double().view(B, T, kv, n // kv, hd)
    scores = torch.einsum("btgjd,bsgd->bgjts", rows, k.double()) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(mask.view(B, 1, 1, T, -1), float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("bgjts,bsgd->btgjd", probs, v.double()).reshape(B, T, n * hd)


@pytest.mark.parametrize("cache", ["float", "bf16", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_attention_reads_the_cache_in_place_and_matches_fp64(dtype: torch.dtype, cache: str) -> None:
    """``cache`` float: in the query's dtype; bf16: a bf16 cache whatever the query's (the plan's under fp32 compute,
    widened by unpacking where the head size allows); int8: codes and their scales."""
    lib = kernels()
    assert lib is not None
    g = torch.Generator().manual_seed(5)
    # (B, query heads, KV heads, head size, keys, softcap, threads): Gemma 3 270M at batch 1 and 32, a group of 8
    # (two blocks of heads), a head size of 8 (no 16-wide step), multi-head attention with a softcap; and with more
    # threads than (row, KV head) pairs, each pair's keys split between threads and merged (a part may get no live key).
    cases = [(1, 4, 1, 256, 600, None, 1), (32, 4, 1, 256, 45, None, 1), (3, 16, 2, 64, 37, None, 1)]
    cases += [(2, 4, 2, 8, 9, None, 1), (2, 4, 4, 16, 9, 30.0, 1)]
    cases += [(1, 4, 1, 256, 600, None, 2), (1, 16, 2, 64, 37, 30.0, 3), (2, 4, 1, 32, 5, None, 7)]
    for B, n, kv, hd, S, softcap, threads in cases:
        # views of a longer cache, as the engine's: float values in the query's dtype, or int8 codes with their scales
        stored = [torch.randn(B, S + 20, kv, hd, generator=g) for _ in range(2)]
        if cache == "int8":
            quant = [QuantKV.empty((B, S + 20, kv, hd), "int8", "cpu") for _ in range(2)]
            for c, x in zip(quant, stored, strict=True):
                c.write(0, x)
            k, v = (c.head(S) for c in quant)
            operands, scales = (k.codes, v.codes), (k.scale, v.scale)
            exact = k.read(S, "cpu", torch.float64), v.read(S, "cpu", torch.float64)  # what the codes mean
        else:
            kv_dtype = dtype if cache == "float" else torch.bfloat16
            operands = exact = stored[0].to(kv_dtype)[:, :S], stored[1].to(kv_dtype)[:, :S]
            scales = None
        q = torch.randn(B, 1, n, hd, generator=g).to(dtype)
        mask = torch.rand(B, 1, 1, S, generator=g) < 0.3
        if B > 1:
            mask[-1] = True  # a pad row: every key forbidden
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            got = lib.decode_attention(q, *operands, mask, hd**-0.5, softcap, scales)
        finally:
            torch.set_num_threads(before)
        want = _attention_in_fp64(q, *exact, mask, hd**-0.5, softcap)
        assert got.shape == (B, 1, n * hd) and got.dtype == dtype
        # bf16: its one rounding of the output; int8: the query and the probabilities as int16 codes (steps of 2^-15
        # of each head's largest, through a few hundred products: ~2e-4 here, against the cache's own ~4e-3) where
        # the head size is a whole number of the integer passes, else the codes' products in fp32
        tolerance = 2**-8 if dtype == torch.bfloat16 else 1e-6 if cache == "float" else 5e-4
        assert (got.double() - want).abs().max() <= tolerance * want.abs().max() + 1e-7, (B, n, kv, hd, S)
        if B > 1:
            assert not got[-1].any()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_int8_caches_integer_products_keep_a_non_finite_query(bad: float) -> None:
    """The int16 codes of a query holding a NaN or an infinity cannot say so: that head's output comes out NaN, as the
    float products make it, for the watch to find; the other heads' are as before."""
    lib = kernels()
    assert lib is not None
    g = torch.Generator().manual_seed(8)
    B, n, S, hd = 2, 4, 33, 256  # a head size the integer products take on either build
    quant = [QuantKV.empty((B, S, 1, hd), "int8", "cpu") for _ in range(2)]
    for c in quant:
        c.write(0, torch.randn(B, S, 1, hd, generator=g))
    q = torch.randn(B, 1, n, hd, generator=g)
    mask = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    args = (quant[0].codes, quant[1].codes, mask, hd**-0.5, None, (quant[0].scale, quant[1].scale))
    clean = lib.decode_attention(q, *args).view(B, n, hd)
    q[1, 0, 2, 7] = bad
    got = lib.decode_attention(q, *args).view(B, n, hd)
    assert got[1, 2].isnan().all()
    others = torch.ones(B, n, dtype=torch.bool)
    others[1, 2] = False
    assert torch.equal(got[others], clean[others])


def test_grouped_attention_takes_the_kernel_for_decode_steps_only(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = kernels()
    assert lib is not None
    calls: list[int] = []
    real = lib.decode_attention
    monkeypatch.setattr(lib, "decode_attention", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(6)
    k, v = torch.randn(2, 7, 1, 32, generator=g), torch.randn(2, 7, 1, 32, generator=g)
    mask = torch.zeros(2, 1, 1, 7, dtype=torch.bool)
    decode = torch.randn(2, 1, 4, 32, generator=g)
    out = grouped_attention(decode, k, v, mask, 0.2)
    assert calls == [1]
    # The same step through torch (the kernel off) agrees to fp32 rounding.
    monkeypatch.setattr(attention, "kernels", lambda: None)
    assert (grouped_attention(decode, k, v, mask, 0.2) - out).abs().max() <= 1e-6
    monkeypatch.setattr(attention, "kernels", lambda: lib)
    # A prefill (several query positions), an fp16 cache and a head size that is not a multiple of 8 stay torch's.
    grouped_attention(torch.randn(2, 7, 4, 32, generator=g), k, v, torch.zeros(2, 1, 7, 7, dtype=torch.bool), 0.2)
    grouped_attention(decode.half(), k.half(), v.half(), mask, 0.2)
    grouped_attention(decode[..., :12], k[..., :12], v[..., :12], mask, 0.2)
    assert calls == [1]
    # An int8 cache (LayerKV.update hands it over as stored at a decode step): read in place by the kernel; with
    # the kernel off, dequantized and attended by torch, to the same numbers within the kernel's int16 codes of the
    # query and the probabilities (a head size of 32 takes them on an AVX2 build).
    quant = [QuantKV.empty((2, 7, 1, 32), "int8", "cpu") for _ in range(2)]
    for c, x in zip(quant, (k, v), strict=True):
        c.write(0, x)
    out8 = grouped_attention(decode, *quant, mask, 0.2)
    assert calls == [1, 1] and (out8 - out).abs().max() <= 0.05  # int8's own error against the float cache
    monkeypatch.setattr(attention, "kernels", lambda: None)
    assert (grouped_attention(decode, *quant, mask, 0.2) - out8).abs().max() <= 5e-4 * out8.abs().max()


def test_the_heads_int8_product_comes_out_in_fp32_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = kernels()
    assert lib is not None
    g = torch.Generator().manual_seed(7)
    acc = torch.randint(-(2**20), 2**20, (5, 1003), dtype=torch.int32, generator=g)
    scale, row_scale = torch.rand(1003, generator=g), torch.rand(5, 1, generator=g)
    assert torch.equal(lib.scale_int32(acc, scale, row_scale), acc.float().mul_(scale).mul_(row_scale))
    want = acc.float().mul_(scale).mul_(row_scale).bfloat16()  # rounded once, to nearest even, as torch's cast
    assert torch.equal(lib.scale_int32(acc, scale, row_scale, bf16=True), want)
    with pytest.raises(ValueError, match="products"):
        lib.scale_int32(acc.t(), scale, row_scale)
    # The int8 head at a batch-32 decode step with int8 activations (on wherever the CPU has VNNI; taken here on
    # any CPU): its logits are fp32, the values the torch epilogue had before it rounded them to the compute dtype
    # (which the forward pass then made fp32 again).
    monkeypatch.setattr(qhead, "int8_activations_for", lambda rows, dtype: True)
    table = QuantizedTable.quantize(torch.randn(3000, 640, generator=g) * 0.02, torch.bfloat16, rotate=True)
    x = torch.randn(32, 640, generator=g).bfloat16()
    logits = table.linear(x)
    rowwise = dataclasses.replace(table, q=table.codes(), offset=None)  # where packed (vnni.c), its codes in row order
    monkeypatch.setattr(qhead, "kernels", lambda: None)
    rounded = rowwise.linear(x)
    assert logits.dtype == torch.float32 and rounded.dtype == torch.bfloat16
    assert torch.equal(logits.bfloat16(), rounded)


@pytest.mark.parametrize("levels", [127, 63], ids=["wide", "narrow"])
def test_our_int8_product_is_the_exact_integers_where_it_serves(levels: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every body's product is torch's integers for codes within the activation levels it is told (the AVX2 body
    multiplies codes within 63 by offset weights, wider ones with the sign trick)."""
    lib = kernels()
    assert lib is not None
    monkeypatch.setattr(lib, "activation_levels", levels)
    vnni = {"avx512_vnni", "avx512bw"} <= cpu_flags() and os.environ.get("ATEN_CPU_CAPABILITY") != "avx2"
    amx = vnni and {"amx_tile", "amx_int8"} <= cpu_flags()
    assert lib.int8_mm_body == ("amx" if amx else "vnni" if vnni else "avx2")
    most = our_int8_mm_max_rows()
    assert most == (15 if cpu_has_amx() else 32)
    assert int8_kernels_for(most).matmul == lib.int8_mm
    # VNNI: oneDNN's AMX/VNNI GEMM past a few rows; AMX tiles and AVX2: ours at every size (torch's is slower, or
    # on AVX2 a slow or saturating one)
    assert (int8_kernels_for(most + 1).matmul is None) == (vnni and not amx)
    assert int8_kernels_for(512).matmul == (None if vnni and not amx else lib.int8_mm)
    g = torch.Generator().manual_seed(9)
    # rows 1 to past a decode step's and past a chunk of 64, odd row counts (a tile's second row repeated; an odd
    # number of AMX activation tiles), weight rows not a multiple of the tile's 4, of AMX's 16 nor of a block's 64,
    # fewer than 16, a stored matrix's row stride, codes at the int8 extremes (-128 in the weights meets the VNNI
    # offset of 128, the AVX2 body's |w| of 128 or its offset to 0); activations within the levels (the AVX2 body's
    # tricks need them)
    low = -128 if vnni and levels == 127 else -levels
    shapes = ((1, 5, 64), (3, 258, 640), (8, 1027, 128), (15, 64, 2048), (16, 33, 64), (33, 130, 192))
    for m, n, k in (*shapes, (48, 100, 256), (70, 67, 128), (130, 40, 64)):
        a = torch.randint(low, levels + 1, (m, k), dtype=torch.int8, generator=g)
        a[0, : k // 2] = levels
        a[-1, : k // 2] = low
        stored = torch.randint(-128, 128, (n, k + 64), dtype=torch.int8, generator=g)
        stored[0, :k] = -128
        stored[-1, :k] = 127
        codes = stored[:, :k]
        want = (a.long() @ codes.long().t()).int()
        assert torch.equal(lib.int8_mm(a, codes), want), (m, n, k)
        out = torch.empty(m, n, dtype=torch.int32)
        assert lib.int8_mm(a, codes, out).data_ptr() == out.data_ptr() and torch.equal(out, want)
        # with the scales: the torch epilogue's fp32 values, in the product's own pass
        scale, row_scale = torch.rand(n, generator=g), torch.rand(m, 1, generator=g)
        scaled = lib.int8_mm(a, codes, None, scale, row_scale)
        assert scaled.dtype == torch.float32 and torch.equal(scaled, want.float().mul_(scale).mul_(row_scale))
    with pytest.raises(ValueError, match="both scales"):
        lib.int8_mm(a, codes, None, torch.ones(codes.shape[0]))
    with pytest.raises(ValueError, match="multiple of 64"):
        lib.int8_mm(torch.zeros(2, 40, dtype=torch.int8), torch.zeros(4, 40, dtype=torch.int8))
    x, w = torch.randn(6, 640, generator=g), PackedInt8(*quantize_int8(torch.randn(300, 640, generator=g)), (300, 640))
    ours = int8_dynamic_linear(x, w, int8_kernels_for(6))
    q, row_scale = quantize_activations(x, 640, levels)
    assert q.abs().max() == levels
    exact = (q.long() @ w.q.long().t()).float().mul_(w.scale32()).mul_(row_scale)
    assert torch.equal(ours, exact)


def test_shares_of_blocks_and_items_taken_as_threads_come_free_give_the_same_bits() -> None:
    """A product's blocks and the attention's (row, KV head) items go to whichever thread comes free, in shares that
    differ from call to call: the outputs are the same bits at 1 to 4 threads (more than this machine's cores, so
    that threads fall behind), row-major and packed codes alike, and rows attending different numbers of keys."""
    lib = kernels()
    assert lib is not None
    g = torch.Generator().manual_seed(11)
    m, n, k = 32, 64 * 37 + 5, 192  # many blocks, a short last one
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale, row_scale = torch.rand(n, generator=g), torch.rand(m, 1, generator=g)
    want = (a.long() @ codes.long().t()).int()
    packed = vnni_pack(codes, n) if lib.int8_mm_body == "vnni" else None
    B, heads, hd, S = 9, 4, 64, 70
    q = torch.randn(B, 1, heads, hd, generator=g).bfloat16()
    keys, values = (torch.randn(B, S, 1, hd, generator=g).bfloat16() for _ in range(2))
    mask = torch.arange(S)[None, :] >= torch.randint(1, S + 1, (B, 1), generator=g)  # each row its own live keys
    mask = mask[:, None, None, :]
    before, seen = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            product = lib.int8_mm(a, codes, None, scale, row_scale)
            assert torch.equal(lib.int8_mm(a, codes), want), threads
            if packed is not None:
                assert torch.equal(lib.int8_mm(a, packed[0], offset=packed[1]), want), threads
                assert torch.equal(lib.int8_mm(a, packed[0], None, scale, row_scale, packed[1]), product), threads
            seen.append((product, lib.decode_attention(q, keys, values, mask, hd**-0.5)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(seen[0][0], want.float().mul_(scale).mul_(row_scale))
    for product, attended in seen[1:]:
        assert torch.equal(product, seen[0][0]) and torch.equal(attended, seen[0][1])


@pytest.mark.parametrize("levels", [127, 63], ids=["wide", "narrow"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_our_activation_quantization_is_torchs_to_the_bit(
    dtype: torch.dtype, levels: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    lib = kernels()
    assert lib is not None
    monkeypatch.setattr(lib, "activation_levels", levels)
    g = torch.Generator().manual_seed(12)
    # a decode row, a batch of rows with an outlier channel and a zero row, widths past a multiple of 8, padding
    for m, k, width in ((1, 640, 640), (32, 2048, 2048), (7, 600, 640), (5, 1152, 1216), (3, 13, 64)):
        x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 50).to(dtype)
        x[0, k // 2] = 3e4
        x[-1] = 0
        want_q, want_scale = quantize_activations(x, width, levels)
        q, scale = lib.quantize_rows(x, width)
        assert m == 1 or q.abs().max() == levels
        assert torch.equal(q, want_q) and torch.equal(scale, want_scale), (m, k, width)
    x = torch.randn(3, 64, generator=g).to(dtype)
    x[1, 60], x[2, 3] = float("nan"), float("inf")
    q, scale = lib.quantize_rows(x, 64)
    assert torch.isfinite(scale[0]) and scale[1:].isnan().all() and not q[1:].any()  # the product stays non-finite
    w = PackedInt8(*quantize_int8(torch.randn(300, 64, generator=g)), (300, 64))
    y = int8_dynamic_linear(x.float(), w, int8_kernels_for(3))
    assert torch.isfinite(y[0]).all() and not torch.isfinite(y[1:]).any(dim=1).any()


@pytest.mark.parametrize("levels", [127, 63], ids=["wide", "narrow"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_linear_in_one_call_is_the_chain_of_quantize_product_and_cast(
    dtype: torch.dtype, levels: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our one-call int8 linear (a decode step's few rows) gives what its steps give one after another: the rows
    quantized (padded, rotated) to the activation levels, the exact integer product, both scales, the cast to the
    compute dtype."""
    lib = kernels()
    assert lib is not None
    monkeypatch.setattr(lib, "activation_levels", levels)
    g = torch.Generator().manual_seed(14)
    # one row and a batch, padding, both rotation blocks and none, outputs not a multiple of a tile or a block
    for m, k, n, width, block in ((1, 640, 1024, 640, 128), (32, 600, 67, 640, 64), (3, 2048, 640, 2048, 0)):
        q, scale = quantize_int8(torch.randn(n, width, generator=g))
        x = (torch.randn(m, k, generator=g) * 4).to(dtype)
        x[0, 1] = 300
        if m > 1:
            x[-1, 5] = float("nan")  # its row's outputs stay non-finite
        codes, row_scale = lib.quantize_rows(x, width, block)
        assert codes.abs().max() == levels
        want = (codes.long() @ q.long().t()).float().mul_(scale.float()).mul_(row_scale).to(dtype)
        got = lib.int8_linears(x[None], ((q, scale.float(), None),), block)[0]
        assert got.shape == (1, m, n) and got.dtype == dtype
        assert torch.equal(got[0].isnan(), want.isnan()) and (m == 1 or got[0, -1].isnan().all())
        assert torch.equal(torch.nan_to_num(got[0]), torch.nan_to_num(want)), (m, k, n, block)
    few, many = int8_kernels_for(ONE_CALL_ROWS), int8_kernels_for(ONE_CALL_ROWS + 1)
    assert few is not None and few.linears == lib.int8_linears
    assert many is not None and many.linears is None  # past a decode step's rows: quantized once, shared
    packed = PackedInt8(q, scale, (n, width))
    chained = int8_dynamic_linear(x, packed, dataclasses.replace(few, linears=None))
    assert torch.equal(torch.nan_to_num(int8_dynamic_linear(x, packed, few)), torch.nan_to_num(chained))
    with pytest.raises(ValueError, match="int8_linear"):
        lib.int8_linears(torch.zeros(2, 96), ((torch.zeros(4, 96, dtype=torch.int8), torch.ones(4), None),), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_linears_in_one_call_are_each_matrix_alone_to_the_bit(dtype: torch.dtype) -> None:
    """Matrices that meet one input (q, k and v; gate and up) in one call: each output is that matrix's own call,
    whatever the rows, the outputs' sizes (none a multiple of a block, one a single row), the codes' row strides;
    more than four matrices, or two widths, are refused."""
    lib = kernels()
    assert lib is not None
    g = torch.Generator().manual_seed(15)
    for m, k, width, block, sizes in (
        (1, 640, 640, 128, (1024, 256, 256)),
        (16, 600, 640, 64, (67, 130)),
        (3, 2048, 2048, 0, (640, 64, 1, 200)),
    ):
        wide = [quantize_int8(torch.randn(n, width + 64, generator=g)) for n in sizes]
        mats = tuple((q[:, :width], scale.float(), None) for q, scale in wide)  # rows width + 64 apart
        x = (torch.randn(2, m, k, generator=g) * 3).to(dtype)
        got = lib.int8_linears(x, mats, block)
        assert [y.shape for y in got] == [(2, m, n) for n in sizes] and all(y.dtype == dtype for y in got)
        for (q, scale, _), y in zip(mats, got, strict=True):
            assert torch.equal(y, lib.int8_linears(x, ((q.contiguous(), scale, None),), block)[0]), (m, k, q.shape)
        if lib.int8_mm_body == "vnni":  # every other matrix packed (vnni.c): the same outputs, in the same call
            mixed = []
            for i, (q, scale, _) in enumerate(mats):
                codes, offset = vnni_pack(q, q.shape[0])
                mixed.append((codes, scale, offset) if i % 2 == 0 else (q, scale, None))
            assert all(torch.equal(a, b) for a, b in zip(lib.int8_linears(x, tuple(mixed), block), got, strict=True))
    with pytest.raises(ValueError, match="at most 4"):
        lib.int8_linears(x, mats * 2, block)
    other = quantize_int8(torch.randn(8, width + 64, generator=g))
    with pytest.raises(ValueError, match="int8_linear"):
        lib.int8_linears(x, (mats[0], (other[0], other[1].float(), None)), block)


def test_the_projections_of_one_input_are_one_call_with_linears_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """``linears``: q, k and v as the engine holds them (rotated int8 in place, an int4 matrix's rotated int8 copy)
    give :func:`linear`'s values of each to the bit, biases added, in one call of ours at a decode step's rows;
    past those rows, or with a matrix that takes another path (a plain tensor), each matrix is its own call."""
    lib = kernels()
    assert lib is not None
    calls: list[int] = []
    alone = lib.int8_linears
    monkeypatch.setattr(lib, "int8_linears", lambda x, mats, block: calls.append(len(mats)) or alone(x, mats, block))
    monkeypatch.setattr(family, "int8_activations_for", lambda rows, dtype: True)  # as on every CPU with our kernel
    int8act._int8_kernels.cache_clear()  # its answers hold the kernels' bound methods
    try:
        g = torch.Generator().manual_seed(16)
        q, q_scale = quantize_int8(torch.randn(256, 320, generator=g))
        k_proj = PackedInt8(q, q_scale, (256, 320), rotation=rotate_int8_in_place(q, q_scale))
        v_proj = PackedInt4(*quantize_int4(torch.randn(64, 320, generator=g), 64), shape=(64, 320))
        rotated_int8_copy(v_proj)
        p = {key: w for key, w in zip(QKV, (k_proj, k_proj, v_proj), strict=True)}
        p["self_attn.v_proj.bias"] = torch.randn(64, generator=g)
        for rows, dtype in ((1, torch.float32), (ONE_CALL_ROWS, torch.bfloat16), (ONE_CALL_ROWS + 1, torch.float32)):
            x = torch.randn(rows, 320, generator=g).to(dtype)
            got = family.linears(x, p, *QKV)
            assert calls == ([3] if rows <= ONE_CALL_ROWS else []), rows
            want = [family.linear(x, p[key], p.get(key.removesuffix("weight") + "bias")) for key in QKV]
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), rows
            calls.clear()
        p[QKV[1]] = torch.randn(256, 320, generator=g)
        got = family.linears(x[:1], p, *QKV)
        assert torch.equal(got[1], torch.nn.functional.linear(x[:1], p[QKV[1]])) and 3 not in calls
    finally:
        int8act._int8_kernels.cache_clear()


def _butterflies(x: Tensor, block: int) -> Tensor:
    """Each run of ``block`` columns of fp32 rows times the Sylvester Hadamard matrix, as the fast transform's
    butterflies in torch ops (u + v, u - v; pairs h apart, h = 1, 2, 4, ...): the C kernel's order of fp32 ops."""
    y = x.clone()
    for h in (2**i for i in range(block.bit_length() - 1)):
        runs = y.reshape(y.shape[0], -1, 2, h)  # within each 2h run: u the first h columns, v the next
        u, v = runs[:, :, 0].clone(), runs[:, :, 1].clone()
        runs[:, :, 0], runs[:, :, 1] = u + v, u - v
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotated_quantization_is_the_fast_transform_then_the_rounding(dtype: torch.dtype) -> None:
    """A rotated matrix's activations, padded, rotated and quantized in one pass: the fp32 butterflies' values to
    the bit, within rounding of the rotation as torch's matmul computes it, and a rotated int8 product as close to
    the float one as the rotation makes it."""
    lib = kernels()
    assert lib is not None
    g = torch.Generator().manual_seed(13)
    for m, k, width, block in ((1, 640, 640, 128), (32, 2048, 2048, 128), (5, 600, 640, 64), (3, 300, 320, 64)):
        x = (torch.randn(m, k, generator=g) * 3).to(dtype)
        x[0, 5] = 400  # one heavy channel, which the rotation spreads
        padded = torch.nn.functional.pad(x.float(), (0, width - k))
        q, scale = lib.quantize_rows(x, width, block)
        want_q, want_scale = quantize_activations(_butterflies(padded, block), width, lib.activation_levels)
        assert torch.equal(q, want_q) and torch.equal(scale, want_scale), (m, k, width, block)
        by_matmul = quantize_activations(rotate(padded, block), width, lib.activation_levels)[0]
        assert (q.int() - by_matmul.int()).abs().max() <= 1
    with pytest.raises(ValueError, match="rotation"):
        lib.quantize_rows(torch.zeros(2, 96), 96, 64)
    # through the linear layer: int8 activations on a rotated int8 matrix
    w = torch.randn(200, 640, generator=g) * 0.05
    q, scale = quantize_int8(w)
    packed = PackedInt8(q, scale, (200, 640), rotation=rotate_int8_in_place(q, scale))
    x = torch.randn(9, 640, generator=g)
    x[:, 17] *= 30
    ours, torchs = int8_dynamic_linear(x, packed, int8_kernels_for(9)), int8_dynamic_linear(x, packed)
    exact = x @ w.T
    for y in (ours, torchs):
        assert float((y - exact).norm() / exact.norm()) < 0.02
    for dtype in (torch.float32, torch.bfloat16):  # torch's product (oneDNN's: a VNNI build's prefill), our epilogue
        q8, row_scale = int8act.quantize_input(x.to(dtype), packed.q.shape[1], packed.rotation, None)
        want = torch._int_mm(q8, packed.q.t()).float().mul_(packed.scale32()).mul_(row_scale).to(dtype)  # torch's ops
        assert torch.equal(int8_dynamic_linear(x.to(dtype), packed), want), dtype


def test_a_busy_probe_does_not_turn_int8_activations_off_where_ours_multiplies(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = kernels()
    assert lib is not None
    exact = int8act._int8_gemm_exact()
    monkeypatch.setattr(int8act, "_int8_gemm_fast", lambda: False)  # what a busy minute can make the timing say
    int8act.int8_activations_on_cpu.cache_clear()
    try:
        # Where ours multiplies (its AVX2 body every call; its VNNI or AMX body: the CPU has what makes oneDNN's int8
        # GEMM fast too), the timing is not asked: the same path whatever else the machine runs.
        assert int8act.int8_activations_on_cpu() == (lib.int8_mm_body == "avx2" or bool(exact))
        monkeypatch.setattr(int8act, "_ours_vnni", lambda: False)  # elsewhere the probe still decides
        int8act.int8_activations_on_cpu.cache_clear()
        assert int8act.int8_activations_on_cpu() == (lib.int8_mm_body == "avx2")
    finally:
        monkeypatch.undo()
        int8act.int8_activations_on_cpu.cache_clear()
