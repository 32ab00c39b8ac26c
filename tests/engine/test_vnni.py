"""int8 codes packed in VNNI order (vnni.c): the product over them is torch's integers, a packed table computes the
logits and looks up the rows a row-major one does, and its codes unpack to the row-major ones."""

from __future__ import annotations

import pytest
import torch

from robot_llm.llm.store import qhead
from robot_llm.llm.store.gemv import kernels
from robot_llm.llm.store.int8act import VNNI_GROUP, vnni_pack
from robot_llm.llm.store.qhead import QuantizedTable

pytestmark = pytest.mark.skipif(
    (kernels() is None or kernels().int8_mm_body != "vnni"),  # type: ignore[union-attr]
    reason="packed codes serve our AVX512-VNNI body only (an AMX or AVX2 build reads row-major codes)",
)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_packed_product_is_torchs_integers_and_its_epilogue(threads: int) -> None:
    lib = kernels()
    assert lib is not None
    g, before = torch.Generator().manual_seed(3), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # outputs fewer than a group, a group, one past it, a short last block (1 or 2 groups of 3), several blocks
        # split between threads; rows within a tile of 8, one past it, several tiles; widths of 1 to 32 quads of 4
        for m, n, k in ((1, 5, 64), (8, 16, 640), (9, 17, 128), (3, 47, 192), (33, 97, 64), (70, 1003, 256)):
            a = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
            stored = torch.randint(-128, 128, (n, k + 64), dtype=torch.int8, generator=g)
            stored[0], stored[-1] = -128, 127  # the extremes meet the activations' offset of 128
            codes = stored[:, :k]  # a stored matrix's row stride
            p, offset = vnni_pack(codes, n)
            assert torch.equal(offset, 128 * codes.long().sum(1).int())
            want = (a.long() @ codes.long().t()).int()
            assert torch.equal(lib.int8_mm(a, p, offset=offset), want), (m, n, k)
            scale, row_scale = torch.rand(n, generator=g), torch.rand(m, 1, generator=g)
            scaled = lib.int8_mm(a, p, None, scale, row_scale, offset)
            assert torch.equal(scaled, want.float().mul_(scale).mul_(row_scale)), (m, n, k)
            ids = torch.tensor([0, n - 1, n // 2, 0])
            back = torch.empty(4, k, dtype=torch.int8)
            lib.lib.rl_vnni_rows(p.data_ptr(), k, ids.data_ptr(), 4, back.data_ptr())
            assert torch.equal(back, codes[ids])
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="multiple of 16"):  # packed codes short of a whole last group
        lib.int8_mm(a, p[: n // VNNI_GROUP * VNNI_GROUP], offset=offset)


@pytest.mark.parametrize("threads", [1, 2])
def test_an_output_streamed_past_the_caches_holds_the_same_values(threads: int) -> None:
    """An fp32 output of half the CPU's largest cache or more is stored past it; every output streamed here (the
    bound set to 0 bytes) gives the same values, whole aligned groups streamed and the rest (a short last group, rows
    of an odd width) stored as before."""
    lib = kernels()
    assert lib is not None
    g, before = torch.Generator().manual_seed(4), torch.get_num_threads()
    bound = lib.lib.rl_vnni_stream_bytes(-1)
    assert bound >= 2**20  # the largest cache Linux tells of, or 32 MB
    torch.set_num_threads(threads)
    try:
        for m, n, k in ((1, 16, 64), (8, 48, 640), (33, 1003, 128), (32, 4096, 64)):
            a = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
            codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
            p, offset = vnni_pack(codes, n)
            scale, row_scale = torch.rand(n, generator=g), torch.rand(m, 1, generator=g)
            want = (a.long() @ codes.long().t()).int().float().mul_(scale).mul_(row_scale)
            lib.lib.rl_vnni_stream_bytes(0)
            streamed = lib.int8_mm(a, p, None, scale, row_scale, offset)
            lib.lib.rl_vnni_stream_bytes(bound)
            assert torch.equal(streamed, want), (m, n, k)
            assert torch.equal(lib.int8_mm(a, p, None, scale, row_scale, offset), want), (m, n, k)
    finally:
        lib.lib.rl_vnni_stream_bytes(bound)
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_packed_products_bf16_outputs_are_torchs_rounding_of_its_fp32_ones(threads: int) -> None:
    """Under bf16 compute the packed product rounds its outputs as it stores them: each is torch's rounding of the
    fp32 value (to nearest even; subnormals kept, where vcvtneps2bf16 would flush them; infinities; a row with a NaN
    NaN throughout), whatever the rows, the outputs (a short last group and block) and the threads."""
    lib = kernels()
    assert lib is not None
    g, before = torch.Generator().manual_seed(5), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m, k, n in ((1, 640, 1024), (3, 128, 67), (32, 640, 1003)):
            q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
            # scales from subnormal outputs (1e-41 times sums of thousands) to overflowing ones
            scale = torch.rand(n, generator=g) * torch.tensor([1e-41, 1e-3, 1.0, 1e35]).repeat(n)[:n]
            x = (torch.randn(m, k, generator=g) * 3).bfloat16()
            if m > 1:
                x[-1, 1] = float("nan")  # its row's outputs all NaN
            codes, row_scale = lib.quantize_rows(x, k)
            want = (codes.long() @ q.long().t()).float().mul_(scale).mul_(row_scale).bfloat16()
            packed, offset = vnni_pack(q, n)
            got = lib.int8_linears(x, ((packed, scale, offset),))[0]
            assert got.dtype == torch.bfloat16 and torch.equal(got.isnan(), want.isnan()), (m, k, n)
            assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want)), (m, k, n)
            tiny = want[:1].float().abs()
            assert bool(((tiny > 0) & (tiny < torch.finfo(torch.float32).tiny)).any())  # subnormals met
            assert bool(want[:1].isinf().any()) and (m == 1 or bool(want[-1].isnan().all()))
    finally:
        torch.set_num_threads(before)


def test_a_packed_table_computes_and_looks_up_what_a_row_major_one_does(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(1003, 200, generator=torch.Generator().manual_seed(5)) * 0.05  # 1003: a short last group
    packed = QuantizedTable.quantize(w, torch.float32, rotate=True)
    monkeypatch.setattr(qhead, "packs_codes", lambda: False)
    rowwise = QuantizedTable.quantize(w, torch.float32, rotate=True)
    assert packed.offset is not None and rowwise.offset is None
    assert packed.q.shape == (1008, 256) and packed.nbytes == rowwise.nbytes + 4 * 1003 + 5 * 256
    assert torch.equal(packed.codes(), rowwise.q)
    ids = torch.tensor([[0, 1002], [17, 16]])
    assert torch.equal(packed.codes(ids), rowwise.q[ids])
    assert torch.equal(packed.lookup(ids), rowwise.lookup(ids))
    with pytest.raises(IndexError, match="1003-row table"):
        packed.lookup(torch.tensor([5, 1003]))
    x = torch.randn(2, 19, 200, generator=torch.Generator().manual_seed(6))
    for rows in (x[:1, :1], x[:, :4], x):  # a decode row, a few, past our product's 32 rows of row-major codes
        got = packed.linear(rows)
        assert got.shape == (*rows.shape[:-1], 1003) and got.dtype == torch.float32
        assert torch.equal(got, rowwise.linear(rows))


def test_the_gemm_probe_measures_the_packed_product() -> None:
    from robot_llm.llm.plan.rates import int8_gemm_ops

    assert int8_gemm_ops(8, 128, 48, threads=1, seconds=0.02, packed=True) > 0


def test_an_int4_matrixs_int8_copy_is_packed_and_multiplies_as_a_row_major_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from robot_llm.llm.families.family import linear
    from robot_llm.llm.store import int8act
    from robot_llm.llm.store.int8act import int8_dynamic_linear, int8_kernels_for, rotated_int8_copy
    from robot_llm.llm.store.quant import PackedInt4, quantize_int4

    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(8)) * 0.05  # 200 rows: a short last group
    packed = rotated_int8_copy(PackedInt4(*quantize_int4(w), (200, 300)))
    monkeypatch.setattr(int8act, "packs_codes", lambda: False)
    rowwise = rotated_int8_copy(PackedInt4(*quantize_int4(w), (200, 300)))
    assert packed.offset is not None and rowwise.offset is None and packed.q.shape == (208, 320)
    with pytest.raises(AssertionError, match="packed"):
        packed.dense(torch.float32)
    x = torch.randn(48, 300, generator=torch.Generator().manual_seed(9))
    for rows in (1, 8, 33, 48):  # one call of ours up to 32 rows; past them the rows quantized, then the product
        for dtype in (torch.float32, torch.bfloat16):
            got = int8_dynamic_linear(x[:rows].to(dtype), packed, int8_kernels_for(rows))
            assert torch.equal(got, int8_dynamic_linear(x[:rows].to(dtype), rowwise, int8_kernels_for(rows)))
    int4 = PackedInt4(*quantize_int4(w), (200, 300), int8_copy=packed)
    assert torch.equal(linear(x, int4), int8_dynamic_linear(x, rowwise, int8_kernels_for(48)))


def test_a_ram_homed_int8_matrix_is_rotated_and_packed_in_place_and_multiplies_as_a_row_major_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from robot_llm.llm.families.family import linear
    from robot_llm.llm.store import int8act
    from robot_llm.llm.store.int8act import int8_dynamic_linear, int8_kernels_for, rotated_int8_in_place
    from robot_llm.llm.store.quant import quantize_int8

    q, scale = quantize_int8(torch.randn(96, 320, generator=torch.Generator().manual_seed(10)) * 0.05)
    held = q.clone()
    packed = rotated_int8_in_place(held, scale.clone())
    assert packed is not None and packed.offset is not None and packed.q.data_ptr() == held.data_ptr()
    odd = rotated_int8_in_place(*quantize_int8(torch.randn(90, 320)))  # 90 rows: not whole groups, left row-major
    assert odd is not None and odd.offset is None
    monkeypatch.setattr(int8act, "packs_codes", lambda: False)
    rowwise = rotated_int8_in_place(q, scale)
    assert rowwise is not None and rowwise.offset is None and not torch.equal(held, q)  # the same codes, packed
    x = torch.randn(40, 320, generator=torch.Generator().manual_seed(11))
    for rows in (1, 32, 40):
        got = linear(x[:rows], packed)
        assert torch.equal(got, int8_dynamic_linear(x[:rows], rowwise, int8_kernels_for(rows)))
    with pytest.raises(ValueError, match="packed int8 codes"):
        linear(x.half(), packed)


def test_doctor_says_the_codes_are_packed() -> None:
    from robot_llm.llm.plan.machine import cpu_kernels_path

    assert "packed in VNNI order (vnni.c)" in cpu_kernels_path()
