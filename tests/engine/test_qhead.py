"""The int8 output head and tied embedding (qhead), and attention that reads grouped KV heads without copies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from robot_llm.llm.engine.streaming import StreamingModel
from robot_llm.llm.families.attention import grouped_attention
from robot_llm.llm.families.config import module_plan
from robot_llm.llm.families.family import embedding, linear, random_weights
from robot_llm.llm.families.gemma3 import Gemma3Config
from robot_llm.llm.plan.machine import cpu_compute_path
from robot_llm.llm.store import gemv
from robot_llm.llm.store.gemv import gemv_available
from robot_llm.llm.store.int8act import int8_activations_for, weight_levels
from robot_llm.llm.store.qhead import HEAD_FUSED_ROWS, HEAD_GEMV_ROWS_AVX2, QuantizedTable
from robot_llm.llm.store.quant import ALIGN
from robot_llm.llm.store.writer import write_store

TINY = Gemma3Config(
    num_layers=2,
    hidden_size=64,
    intermediate_size=100,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=64,
    vocab_size=1000,
    layer_types=("sliding_attention", "full_attention"),
    sliding_window_size=4,
    query_pre_attn_scalar=32,
)


def _table(v: int = 1000, k: int = 72, seed: int = 0) -> torch.Tensor:
    return torch.randn(v, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def _dequantized(table: QuantizedTable) -> torch.Tensor:
    return table.codes()[:, : table.shape[1]].float() * table.scale.float()[:, None]


def test_a_rotated_table_looks_up_the_same_rows_and_computes_the_same_logits() -> None:
    w = _table(k=72)
    plain = QuantizedTable.quantize(w, torch.float32)
    rotated = QuantizedTable.quantize(w, torch.float32, rotate=True)
    assert rotated.rotation == 128 and rotated.shape == (1000, 128) and rotated.width == 72
    ids = torch.tensor([[0, 999, 5]])
    looked_up = embedding(ids, rotated)
    assert looked_up.shape == (1, 3, 72)
    # Rounded in the rotated basis, rotated back: within int8's error of the rows (the plain table's: 0.6 %),
    # twice that where the CPU's int8 GEMM needs 7-bit weights (weight_levels).
    assert float((looked_up - w[ids]).norm() / w[ids].norm()) < 0.01 * 127 / weight_levels()
    for rows in (1, HEAD_FUSED_ROWS, HEAD_FUSED_ROWS + 1, 40):
        x = torch.randn(rows, 72)
        x[:, 5] *= 30
        exact = x @ w.T
        for table in (plain, rotated):
            y = linear(x, table)
            assert y.shape == (rows, 1000) and float((y - exact).norm() / exact.norm()) < 0.02, rows


def test_the_table_is_int8_per_row_within_half_a_step_and_aligned() -> None:
    w = _table()
    table = QuantizedTable.quantize(w.half(), torch.float32)  # as the store keeps it: fp16
    assert table.q.dtype == torch.int8 and table.q.data_ptr() % ALIGN == 0 and table.q.shape == (1000, 128)
    assert table.nbytes == 1000 * 128 + 2 * 1000  # codes padded to the kernel's 64-column multiple, bf16 scales
    step = table.scale.float()[:, None]
    assert bool(((_dequantized(table) - w.half().float()).abs() <= step / 2 + 1e-6).all())
    ids = torch.tensor([[0, 999, 5], [5, 5, 17]])
    looked_up = embedding(ids, table)
    assert looked_up.dtype == torch.float32 and looked_up.shape == (2, 3, 72)
    assert torch.equal(looked_up, _dequantized(table)[ids])


@pytest.mark.parametrize("rows", [1, 7, HEAD_FUSED_ROWS, HEAD_FUSED_ROWS + 1, 200])
def test_head_logits_equal_the_dequantized_table_within_bf16(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    w = _table(v=20000, k=64)  # more than one widening block of the vocabulary
    table = QuantizedTable.quantize(w, torch.float32)
    x, bias = torch.randn(rows, 64), torch.randn(20000)
    calls = []
    real = torch.ops.aten._weight_int8pack_mm
    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", lambda *a: calls.append(1) or real(*a))
    y = linear(x, table, bias)
    exact = F.linear(x, _dequantized(table), bias)
    assert y.dtype == torch.float32 and y.shape == (rows, 20000)
    # Our kernel (gemv.c, where built) up to the fused limit, and past it: fp32 throughout; torch's fused kernel
    # (where ours is not built): bf16 activations (2^-8 relative each) times the codes.
    fused = rows <= HEAD_FUSED_ROWS and not gemv_available()
    bound = 2**-7 * (x.abs() @ _dequantized(table).abs().T) + 1e-4 if fused else 1e-4
    assert bool(((y - exact).abs() <= bound).all())
    assert bool(calls) == fused


def test_the_avx2_body_reads_a_heads_few_rows_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = gemv.kernels()
    assert lib is not None
    rotated = QuantizedTable.quantize(_table(v=4096, k=72), torch.float32, rotate=True)
    calls: list[str] = []
    for name in ("int8_gemv", "int8_mm"):
        real = getattr(lib, name)
        monkeypatch.setattr(lib, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    for rows in (1, HEAD_GEMV_ROWS_AVX2 - 1, HEAD_GEMV_ROWS_AVX2):
        calls.clear()
        y = linear(torch.randn(rows, 72, generator=torch.Generator().manual_seed(rows)), rotated)
        assert y.shape == (rows, 4096)
        quantized = int8_activations_for(rows, torch.float32) and (
            lib.int8_mm_body != "avx2" or rows >= HEAD_GEMV_ROWS_AVX2
        )
        # ours multiplies the quantized rows (int8_mm) where torch's does not (a VNNI build past its rows)
        assert (calls == ["int8_gemv"]) == (not quantized), (rows, lib.int8_mm_body, calls)


def test_a_batchs_logits_buffer_is_reused_only_once_nothing_views_it() -> None:
    rotated = QuantizedTable.quantize(_table(v=4096, k=72), torch.float32, rotate=True)
    x = torch.randn(32, 1, 72, generator=torch.Generator().manual_seed(1))
    first = linear(x, rotated)
    if not rotated._logits:
        pytest.skip("this CPU's int8 products are torch's (no kernel of ours writes the logits)")
    kept, at = first.clone(), first.data_ptr()
    second = linear(2 * x, rotated)  # the first logits are still held: another buffer
    assert second.data_ptr() != at and torch.equal(first, kept)
    last = first[:, -1]  # a view outlives the logits it came from: their buffer stays taken
    del first
    third = linear(3 * x, rotated)
    assert third.data_ptr() not in (at, second.data_ptr()) and torch.equal(last, kept[:, -1])
    del last, second, third
    again = linear(x, rotated)  # every view gone: a kept buffer, the same values as a fresh one
    assert again.data_ptr() in [b.data_ptr() for b in rotated._logits] and torch.equal(again, kept)
    fewer = linear(x[:5], rotated)  # fewer rows: the first rows of a kept buffer
    assert fewer.shape == (5, 1, 4096) and torch.equal(fewer, kept[:5])
    assert len(rotated._logits) <= 2


def test_an_int4_store_on_the_cpu_holds_its_tied_head_int8(tmp_path: Path) -> None:
    weights = random_weights(TINY, seed=2)
    modules = (
        (kind, index, weights.layers[index] if kind == "layer" else weights.resident[kind])
        for kind, index, _ in module_plan(TINY)
    )
    write_store(tmp_path / "store", TINY, modules, dtype="int4")
    quantized = StreamingModel(tmp_path / "store", home="ram", device="cpu")
    kept = StreamingModel(tmp_path / "store", home="ram", device="cpu", quantized_head=False)
    table = quantized.resident["embedding"]["embed_tokens.weight"]
    assert isinstance(table, QuantizedTable) and quantized.quantized_head and not kept.quantized_head
    floats = kept.resident["embedding"]["embed_tokens.weight"]
    assert table.nbytes < floats.numel() * 4 / 2  # 64 wide rows: int8 codes and a scale against fp32
    ids = torch.randint(3, 1000, (2, 9), generator=torch.Generator().manual_seed(4))
    # Lookups read the stored rows exactly (fp16 in the store, as the float engine holds them).
    assert torch.equal(embedding(ids, table), floats[ids])
    ours, want = quantized.forward(ids), kept.forward(ids)
    # The int8 head moves a logit by at most half a step of each weight of its row times |hidden|
    # (measured 0.0098 on logits up to 1.4 here); the greedy choices follow the float head's.
    assert (ours - want).abs().max() <= 0.03
    assert (ours.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    quantized.close()
    kept.close()


class _Largest(TorchDispatchMode):
    """Records the largest tensor any aten op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _eager_reference(q, k, v, mask, scale, softcap):
    """transformers' eager attention: K/V repeated for every query head."""
    group = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
    out = torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype) @ v
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


@pytest.mark.parametrize("heads", [(4, 1), (4, 2), (3, 3)])
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("tokens", [1, 5])
def test_grouped_attention_equals_eager_attention_and_never_copies_the_keys_per_head(
    heads: tuple[int, int], softcap: float | None, tokens: int
) -> None:
    n, kv = heads
    g = torch.Generator().manual_seed(n * 10 + kv + tokens)
    B, S, hd = 3, 96, 64
    q = torch.randn(B, tokens, n, hd, generator=g)
    k, v = torch.randn(B, S, kv, hd, generator=g), torch.randn(B, S, kv, hd, generator=g)
    mask = torch.zeros(B, 1, tokens, S, dtype=torch.bool)
    mask[1, :, :, :40] = True  # a left-padded row
    mask[2, :, :, 60:] = True  # a row that ends early
    watch = _Largest()
    with watch:
        out = grouped_attention(q, k, v, mask, hd**-0.5, softcap)
    want = _eager_reference(q, k, v, mask, hd**-0.5, softcap)
    assert out.shape == (B, tokens, n * hd)
    assert (out - want).abs().max() <= 1e-5
    # Nothing larger than the keys themselves is ever made: never the keys repeated for every query head
    # (eager's repeat_interleave, n / kv times their size).
    assert watch.largest <= k.numel()


@pytest.mark.parametrize("ours", [True, False], ids=["our-int8-product", "torch-int8-product"])
def test_doctor_says_which_matrix_path_a_cpu_night_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ours: bool
) -> None:
    # gemv.c's int8 x int8 product takes every call; without it torch's int8 GEMM takes only calls of a few rows
    monkeypatch.setattr(gemv, "kernels", object if ours else lambda: None)
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 f16c\n")
    fused = cpu_compute_path("int4", "bf16", str(info), int8_activations=False)
    assert fused.startswith("CPU (AVX2 yes, AVX512 no, AVX512-BF16 no, AMX no)")
    assert "fused kernels" in fused and "LM head int8" in fused and "dense bf16 past that" in fused
    every = "int8 activations for every call (" if ours else "int8 activations from 8 rows"
    assert every in cpu_compute_path("int4", "bf16", str(info), int8_activations=True)
    widened = cpu_compute_path("int8", "fp32", str(info))
    assert "fused kernels" in widened and "activations cast to bf16" in widened
    assert "dequantized into float buffers every pass" in cpu_compute_path("int8", "fp16", str(info))
    info.write_text("processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16\n")
    native = cpu_compute_path("int8", "bf16", str(info))
    assert "AMX yes" in native and "cast to bf16" not in native
    # AMX's bf16 tiles keep a prefill's calls bf16: int8 activations up to 128 rows there, every row count elsewhere
    capped = "for every call of up to 128 rows" if ours else "from 8 to 128 rows"
    assert f"int8 activations {capped}" in cpu_compute_path("int8", "bf16", str(info), int8_activations=True)
    assert every in cpu_compute_path("int8", "fp32", str(info), int8_activations=True)
    assert cpu_compute_path("fp32", "fp32", str(info)).endswith("fp32 matrices computed in fp32")
