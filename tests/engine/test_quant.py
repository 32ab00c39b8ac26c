"""int4/int8 in the fused CPU kernels' layouts: packing, round trips, fused == dequantized, dispatch, engines."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from robot_llm.llm.engine.memory import InMemoryModel
from robot_llm.llm.engine.streaming import StreamingModel
from robot_llm.llm.families.config import ModelConfig, ModuleKind, module_plan
from robot_llm.llm.families.family import Params, Weights, linear, random_weights
from robot_llm.llm.families.gemma3 import Gemma3Config
from robot_llm.llm.families.llama import LlamaConfig
from robot_llm.llm.store import int8act
from robot_llm.llm.store.gemv import MATMUL_ROWS, kernels, matmul_serves
from robot_llm.llm.store.int8act import (
    int8_activations_on_cpu,
    rotate,
    rotate_input,
    rotate_int8_in_place,
    rotate_weights,
    rotated_int8_copy,
    rotation_block,
)
from robot_llm.llm.store.layout import SCALE_SUFFIX, StoreError
from robot_llm.llm.store.qhead import QuantizedTable
from robot_llm.llm.store.quant import (
    FUSED_MAX_ROWS,
    PackedInt4,
    PackedInt8,
    dequantize_int4_into,
    dequantize_int8_into,
    int4_bytes,
    int4_kernel_codes,
    int4_kernel_reads_stored_layout,
    int4_linear,
    int8_bytes,
    int8_linear,
    quantize_int4,
    quantize_int8,
    unpack_int4_codes,
)
from robot_llm.llm.store.reader import MANIFEST, Store, read_manifest, verify
from robot_llm.llm.store.writer import convert, write_store

#: Rows of a call past every few- and many-row kernel of its dtype (torch's fused ones, gemv.c, gemm.c): dense.
PAST_KERNELS = {d: max(FUSED_MAX_ROWS[d], MATMUL_ROWS[d][1]) + 1 for d in ("int4", "int8")}

# N not a multiple of 64 (padded rows), K not a multiple of the group (padded columns), both, neither.
SHAPES = [(64, 64), (172, 64), (64, 172), (172, 172), (200, 300), (7, 3)]


def _weight(shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def _bf16_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What bf16 activations (8 significant bits) and bf16 accumulation may cost: 2^-7 of sum |x_i w_i|."""
    return 2**-7 * (x.float().abs().reshape(-1, x.shape[-1]) @ w.abs().T).reshape(*x.shape[:-1], w.shape[0]) + 1e-6


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_codes_are_the_kernel_layout(shape: tuple[int, int], group: int) -> None:
    codes, scales_and_zeros = quantize_int4(_weight(shape), group)
    rows, half = codes.shape
    assert rows % 64 == 0 and (2 * half) % group == 0 and rows >= shape[0] and 2 * half >= shape[1]
    assert scales_and_zeros.dtype == torch.bfloat16 and scales_and_zeros.shape == (2 * half // group, rows, 2)
    assert codes.numel() + scales_and_zeros.nbytes == int4_bytes(shape, group)
    # Unpack with scale 1 and zero 8 (plain torch ops) and let torch pack the codes again: the same bytes.
    identity = torch.stack([torch.ones(scales_and_zeros.shape[:2]), torch.full(scales_and_zeros.shape[:2], 8.0)], -1)
    unpacked = dequantize_int4_into(codes, identity.bfloat16(), torch.empty(rows, 2 * half))
    assert unpacked.min() >= 0 and unpacked.max() <= 15
    assert torch.equal(unpack_int4_codes(codes), unpacked.to(torch.uint8))
    # torch packs for its kernel per instruction set: the stored bytes are its AVX512 layout; where this
    # CPU's kernel reads another one, the codes are repacked for it, and that is torch's own packing.
    kernel = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpacked.int(), 1)
    assert torch.equal(kernel, codes) == int4_kernel_reads_stored_layout()
    assert torch.equal(int4_kernel_codes(codes), kernel)


@pytest.mark.parametrize("shape", SHAPES)
def test_int4_dequantized_in_a_gpu_sized_pass_equals_cpu_sized_passes(shape: tuple[int, int]) -> None:
    # A GPU dequantizes a whole matrix in a few passes (kernel launches cost more than the work); the
    # result must not depend on how the 64-row blocks are grouped into passes, padded rows and columns too.
    codes, scales_and_zeros = quantize_int4(_weight(shape, 3), 32)
    one_block = dequantize_int4_into(codes, scales_and_zeros, torch.empty(shape, dtype=torch.float16), 1)
    whole = dequantize_int4_into(codes, scales_and_zeros, torch.empty(shape, dtype=torch.float16), 1 << 24)
    assert torch.equal(one_block, whole)
    assert torch.equal(whole, dequantize_int4_into(codes, scales_and_zeros, torch.empty(shape, dtype=torch.float16)))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_round_trip_is_within_half_a_step(shape: tuple[int, int], dtype: torch.dtype) -> None:
    w = _weight(shape, 1)
    codes, scales_and_zeros = quantize_int4(w, 32)
    out = dequantize_int4_into(codes, scales_and_zeros, torch.full(shape, float("nan"), dtype=dtype))

    def per_weight(t: torch.Tensor) -> torch.Tensor:
        return t.float().t().repeat_interleave(32, dim=1)[: shape[0], : shape[1]]

    scale, zero = per_weight(scales_and_zeros[..., 0]), per_weight(scales_and_zeros[..., 1])
    # The grid may clip a group's tails (int4_grid): within half a step of the value clamped to the grid.
    clamped = torch.minimum(torch.maximum(w, zero - 8 * scale), zero + 7 * scale)
    # bf16 arithmetic rounds the product and the sum to 8 significant bits: a few half-ulps of the range.
    slack = 1e-7 if dtype == torch.float32 else 2**-7 * w.abs().max()
    assert bool(((out.float() - clamped).abs() <= scale / 2 + slack).all())


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_round_trip_is_within_half_a_step_and_pads_k_with_zeros(shape: tuple[int, int]) -> None:
    w = _weight(shape, 2)
    q, scale = quantize_int8(w)
    assert q.shape == (shape[0], -(-shape[1] // 64) * 64) and scale.shape == (shape[0],)
    assert q.numel() + scale.nbytes == int8_bytes(shape)
    assert not q[:, shape[1] :].any()
    out = dequantize_int8_into(q, scale, torch.empty(shape))
    assert bool(((out - w).abs() <= scale.float()[:, None] / 2 + 1e-7).all())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("rows", [1, 5, FUSED_MAX_ROWS["int4"]])
def test_fused_kernels_equal_the_dequantized_weights_within_bf16(shape: tuple[int, int], group: int, rows: int) -> None:
    w = _weight(shape, 3)
    x = torch.randn(rows, 1, shape[1], generator=torch.Generator().manual_seed(4)).bfloat16()
    codes, scales_and_zeros = quantize_int4(w, group)
    packed4 = PackedInt4(codes, scales_and_zeros, shape)
    dense4 = dequantize_int4_into(codes, scales_and_zeros, torch.empty(shape))
    y = int4_linear(x, packed4)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 1, shape[0])
    assert bool(((y.float() - x.float() @ dense4.T).abs() <= _bf16_bound(x, dense4)).all())
    q, scale = quantize_int8(w)
    dense8 = dequantize_int8_into(q, scale, torch.empty(shape))
    y = int8_linear(x, PackedInt8(q, scale, shape))
    assert bool(((y.float() - x.float() @ dense8.T).abs() <= _bf16_bound(x, dense8)).all())


def test_linear_runs_the_fused_kernel_only_for_few_rows_on_the_cpu(weight_only: None) -> None:
    w, bias = _weight((172, 172), 5), torch.randn(172).bfloat16()
    codes, scales_and_zeros = quantize_int4(w, 32)
    buffer = torch.empty(172, 172, dtype=torch.bfloat16)
    few = torch.randn(2, 3, 172).bfloat16()
    # As the engine hands a RAM-homed matrix over: in the layout this CPU's kernel reads.
    kernel_codes = None if int4_kernel_reads_stored_layout() else int4_kernel_codes(codes)
    packed = PackedInt4(codes, scales_and_zeros, (172, 172), buffer, kernel_codes=kernel_codes)
    y = linear(few, packed, bias)
    assert packed._dense is None  # never dequantized
    assert torch.equal(y, int4_linear(few, packed) + bias)
    many = torch.randn(PAST_KERNELS["int4"], 172).bfloat16()  # past torch's fused kernel and gemm.c
    y = linear(many, packed, bias)
    assert packed._dense is buffer  # dequantized once, into the buffer it was given
    assert torch.equal(y, torch.nn.functional.linear(many, buffer, bias))
    # fp32 activations meet the fused kernels cast to bf16 (fed fp32 they are 30-100x slower), the result
    # cast back: nothing is dequantized at decode sizes on a CPU without native bf16 either.
    fp32 = PackedInt4(codes, scales_and_zeros, (172, 172), torch.empty(172, 172), kernel_codes=kernel_codes)
    fused = linear(few.float(), fp32)
    assert fused.dtype == torch.float32 and fp32._dense is None
    assert torch.equal(fused, int4_linear(few, fp32).float())
    # ... and past the row limit, a dense fp32 product with the weights dequantized once into fp32.
    dense = linear(many.float(), fp32)
    exact = many.float() @ dequantize_int4_into(codes, scales_and_zeros, torch.empty(172, 172)).T
    assert fp32._dense is fp32.buffer and (dense - exact).abs().max() <= 1e-5
    plain = torch.randn(172, 172)
    assert torch.equal(linear(few.float(), plain), torch.nn.functional.linear(few.float(), plain))


def _relative_error(y: torch.Tensor, exact: torch.Tensor) -> float:
    return float((y.float() - exact).norm() / exact.norm())


@pytest.mark.skipif(not int8_activations_on_cpu(), reason="int8 activations off here (no fast, exact int8 GEMM)")
def test_many_rows_of_an_int4_matrix_meet_its_rotated_int8_copy_with_int8_activations() -> None:
    w = _weight((172, 300), 5)
    codes, scales_and_zeros = quantize_int4(w, 32)
    exact_w = dequantize_int4_into(codes, scales_and_zeros, torch.empty(172, 300))
    packed = PackedInt4(codes, scales_and_zeros, (172, 300), torch.empty(172, 300))
    few = torch.randn(FUSED_MAX_ROWS["int4"], 300)
    # Without native bf16 gemm.c's int4 product serves those calls (its values the dense fp32 GEMM's up to the
    # order of the sums), with it torch's fused kernel.
    ours = matmul_serves("int4", few.shape[0])
    want = torch.nn.functional.linear(few, exact_w) if ours else int4_linear(few, packed).float()
    got = linear(few, packed)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5) if ours else torch.equal(got, want)
    assert packed.int8_copy is None
    many = torch.randn(FUSED_MAX_ROWS["int4"] + 1, 300)
    # One heavy channel per row, as real activations have: without the rotation one int8 scale per row
    # would leave the rest of the row a few levels.
    many[:, 7] *= 40
    # A streamed matrix (no copy prepared) is made dense (or given to gemm.c, which widens a tile at a time), as
    # without int8 activations: a copy per pass costs more.
    got, want = linear(many, packed), torch.nn.functional.linear(many, exact_w)
    if matmul_serves("int4", many.shape[0]):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(got, want) and packed._dense is packed.buffer
    assert packed.int8_copy is None
    copy = rotated_int8_copy(packed)  # what the engine prepares once for a RAM-homed matrix
    assert copy.rotation == 64 and copy.shape == (172, 320)  # 300 padded to 320 = 5 x 64
    assert rotated_int8_copy(packed) is copy and packed.int8_copy is copy
    y = linear(many, packed)
    assert _relative_error(y, many @ exact_w.T) < 0.02


@pytest.mark.parametrize("shape", [(172, 256), (96, 192), (64, 640)])
def test_an_int8_matrix_rotated_in_place_gives_the_same_products(shape: tuple[int, int]) -> None:
    w = _weight(shape, 9)
    q, scale = quantize_int8(w)
    exact_w = dequantize_int8_into(q, scale, torch.empty(shape))
    block = rotate_int8_in_place(q, scale)
    assert block == rotation_block(q.shape[1]) and block in (64, 128)
    rotated = PackedInt8(q, scale, tuple(q.shape), rotation=block)
    for rows in (1, FUSED_MAX_ROWS["int8"], 40):
        x = torch.randn(rows, shape[1])
        x[:, 3] *= 30
        y = linear(x, rotated)
        assert y.shape == (rows, shape[0])
        # bf16 activations at decode sizes, int8 activations beyond: both within 1-2 % of the product.
        assert _relative_error(y, x @ exact_w.T) < 0.02, rows


def test_the_rotation_is_orthogonal_and_the_weights_take_its_inverse() -> None:
    x, w = torch.randn(5, 256), torch.randn(7, 256)
    for block in (64, 128):
        assert torch.allclose(rotate(x, block) @ rotate_weights(w, block).T, x @ w.T, atol=1e-4)
        assert torch.allclose(rotate(rotate(x, block), block) / block, x, atol=1e-5)
    assert rotation_block(640) == 128 and rotation_block(27328) == 64 and rotation_block(100) == 0
    # A bf16 row goes through fp32 (cheaper for small inputs) and comes back bf16.
    small = x.bfloat16()
    assert rotate(small, 128).dtype == torch.bfloat16
    assert torch.allclose(rotate(small, 128).float(), rotate(small.float(), 128), rtol=2**-7, atol=1e-2)


def test_one_input_is_rotated_once_for_the_matrices_that_share_it() -> None:
    q, scale = quantize_int8(_weight((64, 256), 2))
    w = PackedInt8(q, scale, (64, 256), rotation=rotate_int8_in_place(q, scale))
    x, other = torch.randn(3, 256), torch.randn(3, 256)
    first = rotate_input(x, w)
    assert rotate_input(x, w) is first  # q, k and v of one layer: rotated once
    assert torch.equal(rotate_input(other, w), rotate(other, w.rotation))  # another input: its own
    assert rotate_input(x, w) is not first and torch.equal(rotate_input(x, w), first)


def test_int8_activations_can_be_switched_off(weight_only: None) -> None:
    assert not int8_activations_on_cpu()


@pytest.mark.parametrize("shape", [(172, 172), (96, 200)])
def test_int8_above_its_row_limit_widens_the_codes_once_and_scales_the_output(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(16)
    w, bias = _weight(shape, 6), torch.randn(shape[0], generator=g).bfloat16()
    q, scale = quantize_int8(w)
    exact = dequantize_int8_into(q, scale, torch.empty(shape))
    buffer = torch.empty(shape, dtype=torch.bfloat16)
    few = torch.randn(FUSED_MAX_ROWS["int8"], shape[1], generator=g).bfloat16()
    packed = PackedInt8(q, scale, shape, buffer)
    # Few rows: gemv.c's product where built (its own order of summation: a bf16 rounding apart), else torch's.
    got, fused = linear(few, packed, bias), int8_linear(few, packed) + bias
    assert (got.float() - fused.float()).abs().max() <= 2**-7 * fused.float().abs().max()
    assert packed._widened is None and packed._dense is None  # the kernel read the stored bytes
    many = torch.randn(2, PAST_KERNELS["int8"], shape[1], generator=g).bfloat16()  # past gemv.c and gemm.c
    y = linear(many, packed, bias)
    assert packed._widened is buffer and packed._dense is None  # widened once, into its buffer, unscaled
    assert torch.equal(buffer, q[:, : shape[1]].bfloat16())
    assert linear(many, packed) is not None and packed._widened is buffer  # the second call reuses it
    assert y.shape == (2, PAST_KERNELS["int8"], shape[0]) and y.dtype == torch.bfloat16
    # Two bf16 roundings of the output (the product, then the scale) on top of bf16 activations.
    bound = 2 * _bf16_bound(many, exact) + (bias.float().abs() + 1e-3) * 2**-7
    assert bool(((y.float() - (many.float() @ exact.T + bias.float())).abs() <= bound).all())
    # Any other dtype (fp32 compute, another device) takes the same dense path, exactly in fp32.
    y32 = linear(many.float(), PackedInt8(q, scale, shape))
    assert (y32 - many.float() @ exact.T).abs().max() <= 1e-4


def test_int4_group_sizes_are_the_kernels() -> None:
    for group in (16, 48, 256):
        with pytest.raises(ValueError, match=r"one of 32, 64, 128"):
            quantize_int4(torch.randn(4, 64), group)


# --------------------------------------------------------------------------- stores


def test_an_old_format_int4_store_is_refused_with_what_to_do(
    stores: dict[str, Path], tmp_path: Path, tiny_dir: Path
) -> None:
    for dtype in ("int4", "fp16"):
        old = tmp_path / dtype
        shutil.copytree(stores[dtype], old)
        manifest = json.loads((old / MANIFEST).read_text())
        # A store of that format had no checksums of its files or of itself.
        manifest = {k: v for k, v in manifest.items() if k not in ("checksums", "manifest_xxh3")}
        manifest["files"] = [{k: v for k, v in f.items() if k != "blocks"} for f in manifest["files"]]
        (old / MANIFEST).write_text(json.dumps(manifest | {"format": "robot-llm-store/1"}))
        if dtype == "fp16":  # a float store's bytes did not change: it still reads
            assert read_manifest(old).dtype == "fp16"
            continue
        with pytest.raises(StoreError, match=r"older robot-llm .* re-run `robot-llm model convert` with --dtype int4"):
            StreamingModel(old, device="cpu")
        with pytest.raises(StoreError, match="re-run `robot-llm model convert`"):
            convert(tiny_dir, old, dtype="int4")


def test_int4_store_holds_the_kernel_operands(stores: dict[str, Path]) -> None:
    store = Store(stores["int4"])
    assert store.manifest.group_size == 64 and store.manifest.to_json()["format"] == "robot-llm-store/2"
    layer = store.load("layer", 0)
    # Group 64, a float source's default. mlp.dense_ffn_hidden.weight is [172, 64]: rows padded to 192 (one group
    # per row); the output projection [64, 172]: columns to 192.
    assert layer["mlp.dense_ffn_hidden.weight"].shape == (192, 32)
    assert layer["mlp.dense_ffn_hidden.weight" + SCALE_SUFFIX].shape == (1, 192, 2)
    assert layer["mlp.dense_ffn_output.weight"].shape == (64, 96)
    assert store.layout("layer", 0).shape("mlp.dense_ffn_output.weight") == (64, 172)
    assert Store(stores["int8"]).load("layer", 0)["mlp.dense_ffn_output.weight"].shape == (64, 192)  # K to 64s


@pytest.mark.parametrize("dtype", ["int4", "int8"])
def test_quantized_matrices_start_aligned_in_their_files(stores: dict[str, Path], dtype: str) -> None:
    # The int8 kernel crashes on weights that are not 16-byte aligned (measured: offsets 2, 4 and 8 of an
    # aligned buffer); slots are 4096-aligned, RAM homes 64-aligned, so the file offsets must be.
    store = Store(stores[dtype])
    for i in range(store.config.num_layers):
        layout = store.layout("layer", i)
        assert layout.data_offset % 64 == 0
        quantized = [s for key, s in layout.tensors.items() if key + SCALE_SUFFIX in layout.tensors]
        assert len(quantized) == 5 and all(s.start % 64 == 0 for s in quantized)
    assert verify(stores[dtype]) == []
    # Still a safetensors file any reader takes.
    loaded = load_file(store.file("layer", 0))
    assert all(torch.equal(t, store.load("layer", 0)[k]) for k, t in loaded.items())


# --------------------------------------------------------------------------- engines


def _dequantized(store: Store) -> Weights:
    """Every layer of a quantized store dequantized to fp32 with the plain-torch path (what CUDA runs)."""
    layers = []
    for i in range(store.config.num_layers):
        raw, layout = store.load("layer", i), store.layout("layer", i)
        layer = {}
        for key, t in raw.items():
            if key.endswith(SCALE_SUFFIX):
                continue
            out = torch.empty(layout.shape(key))
            if t.dtype == torch.uint8:
                layer[key] = dequantize_int4_into(t, raw[key + SCALE_SUFFIX], out)
            elif t.dtype == torch.int8:
                layer[key] = dequantize_int8_into(t, raw[key + SCALE_SUFFIX], out)
            else:
                layer[key] = t.float()
        layers.append(layer)
    resident = {kind: store.load(kind) for kind in store.config.resident_shapes()}
    return Weights(resident=resident, layers=layers)


def _modules(cfg: ModelConfig) -> Iterator[tuple[ModuleKind, int, Params]]:
    weights = random_weights(cfg, seed=3)
    for kind, index, _ in module_plan(cfg):
        yield kind, index, weights.layers[index] if kind == "layer" else weights.resident[kind]


TINY = {
    # hidden 96 and MLP 120: rows padded to 128, the down projection's 120 columns to the group.
    "llama": LlamaConfig(
        num_layers=2,
        hidden_size=96,
        intermediate_size=120,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=64,
        vocab_size=300,
        qkv_bias=True,
    ),
    "gemma3": Gemma3Config(
        num_layers=2,
        hidden_size=64,
        intermediate_size=100,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=64,
        vocab_size=300,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window_size=4,
        query_pre_attn_scalar=32,
    ),
}


@pytest.fixture(scope="module")
def family_stores(tmp_path_factory: pytest.TempPathFactory, stores: dict[str, Path]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family-stores")
    out = {f"yalm-{dtype}": stores[dtype] for dtype in ("int4", "int8")}
    for name, cfg in TINY.items():
        for dtype in ("int4", "int8"):
            write_store(root / f"{name}-{dtype}", cfg, _modules(cfg), dtype=dtype)
            out[f"{name}-{dtype}"] = root / f"{name}-{dtype}"
    return out


@pytest.mark.parametrize("model", ["yalm", "llama", "gemma3"])
@pytest.mark.parametrize("dtype", ["int4", "int8"])
@pytest.mark.parametrize("home", ["disk", "ram"])
def test_fused_engine_equals_the_dequantized_model_within_bf16(
    family_stores: dict[str, Path], model: str, dtype: str, home: str, weight_only: None
) -> None:
    store = Store(family_stores[f"{model}-{dtype}"])
    weights = _dequantized(store)
    exact = InMemoryModel(store.config, weights)  # fp32: the quantized model's exact logits
    dense_bf16 = InMemoryModel(store.config, weights, dtype="bf16")  # bf16 compute, dense matrices
    # The layers' kernels are under test here; the int8 head has its own (tests/engine/test_qhead.py).
    engine = StreamingModel(store, home=home, device="cpu", dtype="bf16", quantized_head=False)
    assert engine.fused
    g = torch.Generator().manual_seed(7)
    # 3 x 6 prompt rows and the decode steps run the fused kernels; the 3 x 20 prompt (60 rows) dequantizes.
    for prompt in (6, 20):
        ids = torch.randint(3, store.config.vocab_size, (3, prompt), generator=g)
        caches = [m.new_cache(3, prompt + 3) for m in (engine, exact, dense_bf16)]
        for step in range(3):
            ours, want, bf16 = (m.forward(ids, c) for m, c in zip((engine, exact, dense_bf16), caches, strict=True))
            # bf16 compute is bf16 compute: the fused kernels stay as close to the exact logits as dense
            # bf16 matmuls do (measured: at most 1.5x their error, which is 0.003-0.17 here; often below it).
            err, bf16_err = (ours - want).abs().max(), (bf16 - want).abs().max()
            assert err <= 2 * bf16_err + 1e-3, (step, err, bf16_err)
            ids = want[:, -1:].argmax(-1)
    engine.close()


@pytest.mark.skipif(not int8_activations_on_cpu(), reason="int8 activations off here (no fast, exact int8 GEMM)")
@pytest.mark.parametrize("model", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", ["int4", "int8"])
def test_int8_activations_in_ram_stay_as_close_to_the_exact_logits_as_the_weight_only_path(
    family_stores: dict[str, Path], model: str, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(family_stores[f"{model}-{dtype}"])
    exact = InMemoryModel(store.config, _dequantized(store))
    engine = StreamingModel(store, home="ram", device="cpu", dtype="fp32")
    # RAM-homed int8 matrices were rotated in place, int4 ones got their rotated int8 copies, the head too.
    prepared = [p for layer in engine.ram_prepared for p in (layer[1] if dtype == "int8" else layer[2])]
    tables = [t for params in engine.resident.values() for t in params.values() if isinstance(t, QuantizedTable)]
    assert prepared and tables and all(t.rotation for t in tables)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, store.config.vocab_size, (3, 20), generator=g)  # 60 rows: int8 activations
    ours = engine.forward(ids, engine.new_cache(3, 20))
    want = exact.forward(ids, exact.new_cache(3, 20))
    engine.close()
    monkeypatch.setenv("ROBOT_LLM_INT8_ACTIVATIONS", "0")
    int8_activations_on_cpu.cache_clear()
    try:
        weight_only = StreamingModel(store, home="ram", device="cpu", dtype="fp32")
        assert not any(layer[1] or layer[2] for layer in weight_only.ram_prepared)
        theirs = weight_only.forward(ids, weight_only.new_cache(3, 20))
        weight_only.close()
    finally:
        monkeypatch.undo()
        int8_activations_on_cpu.cache_clear()
    # Random tiny weights (rows of 64 columns, no outliers to spare) are int8's worst case, and the rotated
    # copies are a second int8 rounding of already int8/int4 weights: measured 5.9 % (Gemma 3, whose norms
    # amplify it; 4.6 % of that with float activations over the same rotated weights) against 0.6 % weight-only.
    # On the real Gemma 3 270M the perplexity moves by under 1 % (benchmarks/quality.py, README).
    err, base = float((ours - want).norm() / want.norm()), float((theirs - want).norm() / want.norm())
    assert base < 0.02 and err < 0.1, (err, base)


def test_our_avx2_product_turns_int8_activations_on_at_full_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where every int8 x int8 product is gemv.c's AVX2 body (exact, and faster than fp32), torch's own int8 GEMM
    (slow on an AVX2 EPYC, saturating 8-bit codes on oneDNN's AVX2 kernels) no longer decides: int8 activations are
    on and rotated weights keep 127 levels."""
    monkeypatch.setattr(int8act, "_ours_multiply_every_call", lambda: True)
    monkeypatch.setattr(int8act, "_int8_gemm_exact", lambda: False)
    monkeypatch.setattr(int8act, "_int8_gemm_fast", lambda: False)
    int8_activations_on_cpu.cache_clear()
    try:
        assert int8_activations_on_cpu() and int8act.weight_levels() == 127
        monkeypatch.setenv("ROBOT_LLM_INT8_ACTIVATIONS", "0")
        int8_activations_on_cpu.cache_clear()
        assert not int8_activations_on_cpu()
    finally:
        monkeypatch.undo()
        int8_activations_on_cpu.cache_clear()
    lib = kernels()
    if lib is not None:
        assert int8act._ours_multiply_every_call() == (lib.int8_mm_body == "avx2")


def test_int8_activations_need_an_int8_gemm_faster_than_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exact is not enough: an exact but slow int8 GEMM (torch's fallback on an AVX2 EPYC, 20x under fp32) keeps
    the weight-only kernels unless they are asked for."""
    assert isinstance(int8act._int8_gemm_fast(), bool)
    monkeypatch.setattr(int8act, "_ours_multiply_every_call", lambda: False)  # none of ours: the timing decides
    monkeypatch.setattr(int8act, "_ours_vnni", lambda: False)
    monkeypatch.setattr(int8act, "_int8_gemm_exact", lambda: True)
    monkeypatch.setattr(int8act, "_int8_gemm_fast", lambda: False)
    int8_activations_on_cpu.cache_clear()
    try:
        assert not int8_activations_on_cpu()
        monkeypatch.setattr(int8act, "_int8_gemm_fast", lambda: True)
        int8_activations_on_cpu.cache_clear()
        assert int8_activations_on_cpu()
        monkeypatch.setattr(int8act, "_int8_gemm_fast", lambda: False)
        monkeypatch.setenv("ROBOT_LLM_INT8_ACTIVATIONS", "1")
        int8_activations_on_cpu.cache_clear()
        assert int8_activations_on_cpu()
    finally:
        monkeypatch.undo()
        int8_activations_on_cpu.cache_clear()


def test_only_amx_caps_the_rows_that_take_int8_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """AMX's bf16 tiles outrun the int8 path at prefill sizes, so there a bf16 call of many rows stays bf16;
    without AMX (a Zen 4 EPYC's AVX512-BF16, any fp32 CPU) the int8 GEMM wins at every size measured, and a
    prefill's calls quantize too."""
    from robot_llm.llm.plan import cpu
    from robot_llm.llm.store import gemv

    monkeypatch.setattr(int8act, "int8_activations_on_cpu", lambda: True)
    monkeypatch.setattr(gemv, "kernels", object)  # gemv.c's int8 x int8 product built: it takes every call
    for flags, cap in [({"avx512_bf16", "amx_bf16", "amx_tile"}, 128), ({"avx512_bf16", "avx512_vnni"}, None)]:
        monkeypatch.setattr(cpu, "_this_cpu_flags", lambda flags=flags: frozenset(flags))
        assert int8act.int8_activation_max_rows("bf16") == cap
        assert int8act.int8_activation_max_rows("fp32") is None
        assert int8act.int8_activations_for(2048, torch.float32)
        assert int8act.int8_activations_for(128, torch.bfloat16)
        assert int8act.int8_activations_for(129, torch.bfloat16) == (cap is None)
        assert int8act.int8_activations_for(1, torch.bfloat16)
    monkeypatch.setattr(gemv, "kernels", lambda: None)  # torch's int8 GEMM: from a few rows
    assert not int8act.int8_activations_for(int8act.INT8_ACTIVATION_MIN_ROWS - 1, torch.bfloat16)
    assert int8act.int8_activations_for(int8act.INT8_ACTIVATION_MIN_ROWS, torch.bfloat16)
