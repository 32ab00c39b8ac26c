"""Our many-row products (gemm.c): int4 and int8 matrices times many fp32 (or bf16) rows, exact against an fp64
product of the dense way's weights on both builds, and the calls of a batched decode step that take them on a
CPU without native bf16."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from robot_llm.llm.families import family
from robot_llm.llm.plan.cpu import cpu_flags
from robot_llm.llm.store import gemv
from robot_llm.llm.store.int8act import rotate
from robot_llm.llm.store.qhead import QuantizedTable
from robot_llm.llm.store.quant import (
    PackedInt4,
    PackedInt8,
    dequantize_int4_into,
    int4_kernel_codes,
    int4_kernel_reads_stored_layout,
    quantize_int4,
    quantize_int8,
)

pytestmark = pytest.mark.skipif(not {"avx2", "fma"} <= cpu_flags(), reason="gemm.c needs AVX2 and FMA")


@pytest.fixture(params=["this-cpu", "avx2"])
def kernels(request: pytest.FixtureRequest, kernel_cache: Path, monkeypatch: pytest.MonkeyPatch) -> gemv.Kernels:
    """The kernels as this CPU builds them, and as the AVX2 kind does (``ATEN_CPU_CAPABILITY=avx2``'s flags)."""
    if request.param == "avx2":
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    flags = gemv.compile_flags()
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    return gemv.Kernels(gemv.build(flags))


def _close(y: Tensor, ref: Tensor, rel: float = 1e-5) -> bool:
    return bool((y.double() - ref).abs().max() <= rel * ref.abs().max())


def test_int4_products_are_the_dense_weights_products(kernels: gemv.Kernels) -> None:
    g = torch.Generator().manual_seed(0)
    # Rows not a multiple of the 64-row block, columns padded to the group, more columns than one tile (256),
    # row counts of the one-pass kernel (up to 7) and around the 6-row tile.
    for n, k, group in ((100, 300, 32), (64, 640, 64), (130, 600, 128)):
        codes, sz = quantize_int4(torch.randn(n, k, generator=g), group)
        dense = dequantize_int4_into(codes, sz, torch.empty(n, k)).double()
        for m in (1, 5, 6, 7, 13, 33):
            x = torch.randn(m, k, generator=g)
            y = kernels.int4_matmul(x, codes, sz, n)
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert _close(y, x.double() @ dense.T)
    # Leading dimensions kept; bf16 rows read exactly and the output rounded once to bf16 (a few rows: the one-pass
    # kernel; more: the tiles).
    for lead in ((1, 3), (2, 4)):
        x = torch.randn(*lead, 600, generator=g).bfloat16()
        y = kernels.int4_matmul(x, codes, sz, n)
        ref = (x.double() @ dense.T).float()
        assert y.shape == (*lead, n) and y.dtype == torch.bfloat16
        assert ((y.float() - ref).abs() <= 2**-8 * ref.abs() + 1e-5).all()


def test_int8_products_match_the_few_row_kernel_and_fp64(kernels: gemv.Kernels) -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (1003, 640), dtype=torch.int8, generator=g)  # 1003: not a multiple of the 3-row tile
    scale = (torch.rand(1003, generator=g) / 100).bfloat16()
    weights = q.double() * scale.double()[:, None]
    for m in (1, 3, 4, 5, 11, 33):
        x = torch.randn(m, 600, generator=g)
        for n in (1003, 1001):
            y = kernels.int8_matmul(x, q, scale, n)
            assert y.shape == (m, n)
            assert _close(y, F.pad(x.double(), (0, 40)) @ weights[:n].T)
    x = torch.randn(12, 200, generator=g)  # a rotated matrix: padded to 256, then rotated in blocks of 64
    r = torch.randint(-63, 64, (77, 256), dtype=torch.int8, generator=g)
    rs = (torch.rand(77, generator=g) / 50).bfloat16()
    ref = rotate(F.pad(x, (0, 56)), 64).double() @ (r.double() * rs.double()[:, None]).T
    assert _close(kernels.int8_matmul(x, r, rs, 77, rotation=64), ref)


def test_bad_int4_operands_are_refused(kernel_cache: Path) -> None:
    kernels = gemv.Kernels(gemv.build())
    codes, sz = quantize_int4(torch.randn(64, 64), 32)
    with pytest.raises(ValueError, match="float32"):
        kernels.int4_matmul(torch.zeros(8, 64), codes, sz.float(), 64)
    with pytest.raises(ValueError, match=r"codes \(32, 32\)"):
        kernels.int4_matmul(torch.zeros(8, 64), codes[:32], sz, 64)


def test_a_batched_step_without_native_bf16_takes_them(kernel_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where bf16 is not native, int4 and int8 matrices and the int8 head at a batch's rows go through gemm.c:
    exact to fp32 rounding (torch's fused int4 kernel rounds the rows to bf16: about 1e-3 off) and counted."""
    monkeypatch.setattr(gemv, "cpu_has_native_bf16", lambda: False)
    calls: list[str] = []

    def counted(name: str) -> Callable[..., Tensor]:
        real = getattr(gemv.Kernels, name)

        def spy(self: gemv.Kernels, *args: object, **kwargs: object) -> Tensor:
            calls.append(name)
            return real(self, *args, **kwargs)

        return spy

    monkeypatch.setattr(gemv.Kernels, "int4_matmul", counted("int4_matmul"))  # the layers' and the head's calls
    monkeypatch.setattr(gemv.Kernels, "int8_matmul", counted("int8_matmul"))
    g = torch.Generator().manual_seed(2)
    w4 = PackedInt4(*quantize_int4(torch.randn(200, 320, generator=g), 64), shape=(200, 320))
    w8 = PackedInt8(*quantize_int8(torch.randn(150, 320, generator=g)), shape=(150, 320))
    table = QuantizedTable.quantize(torch.randn(3000, 320, generator=g), torch.float32)
    low4, high4 = gemv.MATMUL_ROWS["int4"]
    low8, high8 = gemv.MATMUL_ROWS["int8"]
    for m, int4_ours, int8_ours in ((low4, True, low8 <= low4), (32, True, True), (high8 + 1, True, False)):
        calls.clear()
        x = torch.randn(m, 320, generator=g)
        assert _close(family.linear(x, w4), x.double() @ w4.dense(torch.float64).T)
        assert _close(family.linear(x, w8), x.double() @ w8.dense(torch.float64).T)
        assert _close(table.linear(x), x.double() @ (table.q.double() * table.scale.double()[:, None]).T)
        assert calls.count("int4_matmul") == int4_ours and calls.count("int8_matmul") == 2 * int8_ours
    # A few rows: one pass over the codes up to INT4_FEW_ROWS; between that and the many-row range torch's fused
    # kernel where it reads the codes as given (a RAM-homed matrix repacked for it), else ours again.
    repacked = PackedInt4(w4.codes, w4.scales_and_zeros, w4.shape, kernel_codes=_torch_codes(w4))
    for m in (1, gemv.INT4_FEW_ROWS, gemv.INT4_FEW_ROWS + 1):
        calls.clear()
        x = torch.randn(m, 320, generator=g)
        y = family.linear(x, w4)
        # Exact where ours served; torch's fused kernel (it reads the stored codes on an AVX512 CPU) rounds to bf16.
        assert _close(y, x.double() @ w4.dense(torch.float64).T, 1e-5 if calls else 1e-2)
        family.linear(x, repacked)
        ours = m <= gemv.INT4_FEW_ROWS
        assert calls.count("int4_matmul") == 1 + ours or repacked.kernel_codes is None
        assert calls.count("int4_matmul") >= ours  # the few-row pass is ours on either kind of CPU
    # Past the highest row count (a prefill) the dense GEMM serves.
    calls.clear()
    family.linear(torch.randn(high4 + 1, 320, generator=g), w4)
    assert calls == []
    # With native bf16 torch's bf16 kernels keep these calls.
    monkeypatch.setattr(gemv, "cpu_has_native_bf16", lambda: True)
    family.linear(torch.randn(32, 320, generator=g), w4)
    table.linear(torch.randn(32, 320, generator=g))
    assert calls == []


def _torch_codes(w: PackedInt4) -> Tensor | None:
    """``w``'s codes in the layout this CPU's fused int4 kernel reads (None: the stored one)."""
    return None if int4_kernel_reads_stored_layout() else int4_kernel_codes(w.codes)
