"""Our decode kernel (gemv.c): built with the machine's compiler, exact against an fp32 product, on both bodies
(AVX512 and AVX2, whichever CPU runs the test), and used by the engine's few-row int8 products."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from robot_llm.llm.families.family import linear
from robot_llm.llm.plan.cpu import cpu_flags
from robot_llm.llm.plan.machine import cpu_kernels_path
from robot_llm.llm.store import gemv
from robot_llm.llm.store.gemv import AVX2_ACTIVATION_LEVELS, activation_levels
from robot_llm.llm.store.int8act import rotate
from robot_llm.llm.store.qhead import HEAD_FUSED_ROWS, QuantizedTable
from robot_llm.llm.store.quant import PackedInt8, quantize_int8

pytestmark = pytest.mark.skipif(not {"avx2", "fma"} <= cpu_flags(), reason="gemv.c needs AVX2 and FMA")

AVX2 = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]


def _exact(x: Tensor, q: Tensor, scale: Tensor, n: int) -> Tensor:
    weights = q[:n].double() * scale[:n].double()[:, None]
    return (F.pad(x.double(), (0, q.shape[1] - x.shape[-1])) @ weights.t()).float()


@pytest.mark.parametrize("flags", [None, AVX2], ids=["this-cpu", "avx2"])
def test_products_match_fp64_for_any_row_count_and_ragged_shapes(kernel_cache: Path, flags: list[str] | None) -> None:
    kernels = gemv.Kernels(gemv.build(flags))
    g = torch.Generator().manual_seed(0)
    # 1003 rows (not a multiple of the 4-row tile), 600 live columns of 640 stored (the store pads to 64).
    q = torch.randint(-127, 128, (1003, 640), dtype=torch.int8, generator=g)
    scale = (torch.rand(1003, generator=g) / 100).bfloat16()
    for m in (1, 2, 3, 4, 5, 9):
        x = torch.randn(m, 600, generator=g)
        for n in (1003, 1001):
            y = kernels.int8_gemv(x, q, scale, n)
            ref = _exact(x, q, scale, n)
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    # Leading dimensions are kept; a bf16 input is read as its exact values and the output is bf16, rounded once.
    x = torch.randn(2, 3, 640, generator=g).bfloat16()
    y, ref = kernels.int8_gemv(x, q, scale, 1003), _exact(x.view(6, 640), q, scale, 1003).view(2, 3, -1)
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    assert ((y.float() - ref).abs() <= 2**-8 * ref.abs() + 1e-6).all()  # each value within half a bf16 step
    # fp16 (no CPU fast path) is computed in fp32 and given back as fp16.
    assert kernels.int8_gemv(x.half(), q, scale, 10).dtype == torch.float16


@pytest.mark.parametrize("flags", [None, AVX2], ids=["this-cpu", "avx2"])
@pytest.mark.parametrize("block", [64, 128])
def test_a_rotated_matrix_meets_its_rotation_inside_the_kernel(
    kernel_cache: Path, flags: list[str] | None, block: int
) -> None:
    kernels = gemv.Kernels(gemv.build(flags))
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (77, 256), dtype=torch.int8, generator=g)
    scale = (torch.rand(77, generator=g) / 50).bfloat16()
    for m in (1, 3, 6):
        x = torch.randn(m, 200, generator=g)  # padded to 256 first, then rotated block by block
        y = kernels.int8_gemv(x, q, scale, 77, rotation=block)
        ref = _exact(rotate(F.pad(x, (0, 56)), block), q, scale, 77)
        assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    with pytest.raises(ValueError, match="rotation block of 96"):
        kernels.int8_gemv(x, q, scale, 77, rotation=96)


def test_each_build_is_cached_by_its_flags(fresh_kernel_cache: Path) -> None:
    native, avx2 = gemv.build(), gemv.build(AVX2)
    assert native != avx2 and {p.name for p in fresh_kernel_cache.iterdir()} == {native.name, avx2.name}
    stamp = native.stat().st_mtime_ns
    assert gemv.build() == native and native.stat().st_mtime_ns == stamp  # not rebuilt
    assert gemv.Kernels(avx2).lanes == 8


def test_the_avx2_kind_builds_the_avx2_body(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert "-mavx2" in gemv.compile_flags() and "-march=native" not in gemv.compile_flags()
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert "-march=native" in gemv.compile_flags()


def test_hidden_amx_tiles_build_the_vnni_body(monkeypatch: pytest.MonkeyPatch, fresh_kernel_cache: Path) -> None:
    # ROBOT_LLM_HIDE_CPU_FLAGS=amx_tile,amx_int8 on an AMX machine measures a Zen 4's int8 path beside its own
    real, tiles = cpu_flags("/proc/cpuinfo"), {"amx_tile", "amx_int8"}
    monkeypatch.setattr(gemv, "cpu_flags", lambda cpuinfo=None: real if cpuinfo else real - tiles)
    flags = gemv.compile_flags()
    assert ("-mno-amx-tile" in flags and "-mno-amx-int8" in flags) == (tiles <= real)
    body = gemv.Kernels(gemv.build(flags)).int8_mm_body
    assert body == ("vnni" if {"avx512_vnni", "avx512bw"} <= real else "avx2")


def test_bad_operands_are_refused_with_what_was_given(kernel_cache: Path) -> None:
    kernels = gemv.Kernels(gemv.build())
    q = torch.zeros(8, 100, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"codes \(8, 100\)"):
        kernels.int8_gemv(torch.zeros(1, 100), q, torch.ones(8).bfloat16(), 8)
    with pytest.raises(ValueError, match="float32 scales"):
        kernels.int8_gemv(torch.zeros(1, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8), 8)


def test_off_or_without_a_compiler_the_torch_kernels_stay(
    fresh_kernel_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ROBOT_LLM_GEMV", "0")
    assert not gemv.gemv_available()
    monkeypatch.delenv("ROBOT_LLM_GEMV")
    gemv.kernels.cache_clear()
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger=gemv.log.name):
        assert not gemv.gemv_available()
    assert "no C compiler" in caplog.text and "torch's kernels" in caplog.text
    assert not fresh_kernel_cache.exists() or not any(fresh_kernel_cache.iterdir())
    # The engine's products still run (torch's fused kernel) and agree with the kernel's to bf16 rounding.
    w = torch.randn(96, 64)
    packed = PackedInt8(*quantize_int8(w), shape=(96, 64))
    x = torch.randn(1, 64)
    assert torch.allclose(linear(x, packed), x @ packed.dense(torch.float32).t(), rtol=0.02, atol=0.05)


def test_few_row_products_of_int8_matrices_and_the_head_run_the_kernel(kernel_cache: Path) -> None:
    assert gemv.gemv_available()
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 200, generator=g)
    packed = PackedInt8(*quantize_int8(w), shape=(300, 200))
    table = QuantizedTable.quantize(torch.randn(5000, 200, generator=g), torch.float32)
    for m in range(1, HEAD_FUSED_ROWS + 1):
        x = torch.randn(m, 200, generator=g)
        # Exact to fp32 rounding: torch's fused kernel would round the activations to bf16 first.
        exact = _exact(x, packed.q, packed.scale, 300)
        assert (linear(x, packed) - exact).abs().max() <= 1e-5 * exact.abs().max()
        head = _exact(x, table.q, table.scale, 5000)
        assert (table.linear(x) - head).abs().max() <= 1e-5 * head.abs().max()


def test_doctor_says_which_kernel_serves_few_rows(kernel_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = "AVX512" if gemv.Kernels(gemv.build()).lanes == 16 else "AVX2"
    described = cpu_kernels_path()
    assert f"through our kernel (gemv.c, its {body} body)" in described
    assert "decode norms and attention ours (norm.c, attend.c)" in described
    assert "the gated MLP's activation ours (gated.c)" in described
    assert ("rows ours too (gemm.c)" in described) == gemv.matmul_available()
    monkeypatch.setenv("ROBOT_LLM_GEMV", "0")
    gemv.kernels.cache_clear()
    described = cpu_kernels_path()
    assert "through torch's fused kernel; norms, attention, gated activation torch's (not built" in described


def test_activation_levels_are_asked_of_the_avx2_body_only(kernel_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ROBOT_LLM_ACTIVATION_LEVELS`` sets the AVX2 body's activation codes (its narrow product from 63 down), the
    VNNI and AMX bodies keep 127, doctor names the product, and a value out of range names the variable."""
    assert activation_levels("avx2") == AVX2_ACTIVATION_LEVELS
    monkeypatch.setenv("ROBOT_LLM_ACTIVATION_LEVELS", " 63 ")
    assert (activation_levels("avx2"), activation_levels("vnni"), activation_levels("amx")) == (63, 127, 127)
    lib = gemv.kernels()
    assert lib is not None and lib.activation_levels == (63 if lib.int8_mm_body == "avx2" else 127)
    assert lib.narrow_levels == (63 if lib.int8_mm_body == "avx2" else 0)
    if lib.int8_mm_body == "avx2":
        assert "activation codes to +-63: offset trick" in cpu_kernels_path()
    for bad in ("0", "128", "7-bit", "-3", "63.5"):
        monkeypatch.setenv("ROBOT_LLM_ACTIVATION_LEVELS", bad)
        with pytest.raises(ValueError, match=f"ROBOT_LLM_ACTIVATION_LEVELS='{bad}': give a whole number"):
            activation_levels("avx2")
