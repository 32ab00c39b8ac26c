"""Planner: refuses what cannot fit (with the reason), picks sensible placements."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from robot_llm.llm.families import gemma3, llama
from robot_llm.llm.families.yalm import PRESETS
from robot_llm.llm.plan.cpu import cpu_has_native_bf16
from robot_llm.llm.plan.machine import Machine, detect_machine, free_cores, gpu_has_native_bf16
from robot_llm.llm.plan.planner import (
    GB,
    PlanError,
    Work,
    auto_compute_dtype,
    gpu_compute_dtype,
    plan,
)
from robot_llm.llm.plan.sizes import layer_bytes, layer_params, pinned_bytes
from robot_llm.llm.plan.timing import FUSED_RATES, INT8_WIDEN_ELEMS_PER_S
from robot_llm.llm.store.quant import FUSED_COMPUTE_DTYPES, FUSED_MAX_ROWS

YALM = PRESETS["yalm-100b"]
JOB = Work(num_prompts=300, prompt_tokens=512, max_new_tokens=128)


def _fits(p) -> bool:
    return all(sum(p.memory[tier].values()) <= cap for tier, cap in p.capacity.items())


def test_layer_sizes_match_the_release() -> None:
    # docs/yalm-model.md §8: 2,516,957,872 bytes per fp16 layer.
    assert layer_bytes(YALM, "fp16") == 2_516_957_872
    assert 0.5 < layer_bytes(YALM, "int8") / layer_bytes(YALM, "fp16") < 0.55
    # int4 at group 64, the default for a float source: 4 bits + 32 bits of bf16 scale and zero per 64
    # weights = 4.5 bits (anchors: 0.71 GB); at group 32 (a GGUF source's): 5 bits. Padding for the fused
    # kernel (27308 -> 27328 rows/columns) adds 0.07 %.
    assert 0.705e9 < layer_bytes(YALM, "int4") == layer_bytes(YALM, "int4", 64) < 0.713e9
    assert 0.785e9 < layer_bytes(YALM, "int4", 32) < 0.788e9


def test_refuses_a_machine_too_small_for_one_sequence() -> None:
    with pytest.raises(PlanError, match=r"batch 1 needs .* of GPU memory"):
        plan(YALM, JOB, Machine(ram_bytes=16 * 2**30, gpu_bytes=4 * 2**30))


def test_refuses_more_tokens_than_the_model_has_positions() -> None:
    with pytest.raises(PlanError, match="exceeds the model's 1024 positions"):
        plan(YALM, Work(10, 1000, 100), Machine(ram_bytes=256 * 2**30))


def test_refuses_ram_home_when_the_weights_do_not_fit() -> None:
    with pytest.raises(PlanError, match="of RAM"):
        plan(YALM, JOB, Machine(ram_bytes=64 * 2**30, gpu_bytes=24 * 2**30), weight_home="ram")


def test_small_gpu_streams_from_disk_with_kv_in_ram() -> None:
    p = plan(YALM, JOB, Machine(ram_bytes=int(64 * GB), gpu_bytes=int(8 * GB), disk_read_bps=3.5 * GB))
    # 64 GB cannot hold 188 GiB of fp16 layers: the RAM left next to the KV cache holds the first ones.
    assert (p.device, p.weight_home, p.kv_home) == ("cuda", "split", "cpu")
    assert 0 < p.ram_layers < YALM.num_layers
    assert p.memory["ram"]["weights (RAM part)"] == p.ram_layers * layer_bytes(YALM, "fp16")
    assert 1 <= p.micro_batch <= p.batch_size <= 300 and _fits(p)


def test_pinned_staging_slots_are_planned_as_torch_allocates_them() -> None:
    # On CUDA the engine's two staging slots are pinned, and torch's caching host allocator rounds each up
    # to a power of two: a 2.35 GiB fp16 YaLM-100B layer pins 4 GiB per slot (8 GiB, not 4.7, of RAM).
    gpu = Machine(ram_bytes=int(64 * GB), gpu_bytes=int(8 * GB), disk_read_bps=3.5 * GB)
    assert plan(YALM, JOB, gpu, weight_home="disk").memory["ram"]["staging slots"] == 2 * 4 * 2**30
    cpu = plan(YALM, JOB, replace(gpu, gpu_bytes=0), weight_home="disk")  # not pinned on the CPU: as stored
    assert cpu.memory["ram"]["staging slots"] == 2 * layer_bytes(YALM, "fp16")
    assert [pinned_bytes(n) for n in (1, 4096, 4097, 2**32)] == [1, 4096, 8192, 2**32]


def test_model_that_fits_in_ram_is_homed_there() -> None:
    # int8 weights (~100 GiB) fit a 256 GB box next to the KV cache: no disk traffic per step.
    p = plan(YALM, JOB, Machine(ram_bytes=int(256 * GB), gpu_bytes=int(24 * GB)), weight_dtype="int8")
    assert p.weight_home == "ram" and _fits(p)
    assert p.total_seconds > 0 and p.tokens_per_second > 0


def test_batch_grows_with_memory_and_respects_the_caps() -> None:
    small = plan(YALM, JOB, Machine(ram_bytes=int(128 * GB)), kv_dtype="fp32")
    large = plan(YALM, JOB, Machine(ram_bytes=int(512 * GB)), kv_dtype="fp32")
    assert small.device == "cpu" and small.batch_size < large.batch_size
    assert plan(YALM, JOB, Machine(ram_bytes=int(512 * GB)), max_batch_size=16).batch_size <= 16
    assert plan(YALM, Work(3, 64, 16), Machine(ram_bytes=int(512 * GB))).batch_size == 3
    budget = plan(YALM, JOB, Machine(ram_bytes=int(512 * GB)), memory_budget_bytes=int(64 * GB))
    assert sum(budget.memory["ram"].values()) <= 64 * GB


def test_describe_shows_every_tier_and_the_estimate() -> None:
    text = plan(YALM, JOB, Machine(ram_bytes=int(64 * GB), gpu_bytes=int(8 * GB))).describe()
    for word in ("batch size", "gpu:", "ram:", "disk:", "KV cache", "estimated time"):
        assert word in text


def test_cpu_compute_dtype_is_bf16_where_native_and_never_fp16() -> None:
    work = Work(8, 64, 16)
    bf16_cpu = Machine(ram_bytes=int(512 * GB), cpu_bf16=True)
    assert plan(YALM, work, bf16_cpu, weight_dtype="int4").compute_dtype == "bf16"
    assert plan(YALM, work, Machine(ram_bytes=int(512 * GB))).compute_dtype == "fp32"
    assert plan(YALM, work, Machine(ram_bytes=int(512 * GB), gpu_bytes=int(80 * GB))).compute_dtype == "fp16"
    # bf16's native GEMM rate is what the estimate uses.
    slow = plan(YALM, work, Machine(ram_bytes=int(512 * GB), cpu_bf16=True, cpu_bf16_flops=0.25e12))
    assert slow.prefill_seconds > plan(YALM, work, bf16_cpu).prefill_seconds


LLAMA, GEMMA = llama.PRESETS["llama-3.1-70b"], gemma3.PRESETS["gemma-3-270m"]


@pytest.mark.parametrize(
    ("cfg", "with_bf16", "without"), [(YALM, "fp16", "fp16"), (LLAMA, "bf16", "fp16"), (GEMMA, "bf16", "fp32")]
)
def test_gpu_compute_dtype_follows_the_family_and_the_gpus_bf16(cfg, with_bf16: str, without: str) -> None:
    # YaLM computes as released (fp16); Llama was trained in bf16; Gemma 3 overflows fp16, so never fp16.
    gpu = Machine(ram_bytes=int(64 * GB), gpu_bytes=int(24 * GB))
    assert auto_compute_dtype(replace(gpu, gpu_bf16=True), cfg) == gpu_compute_dtype(cfg, True) == with_bf16
    assert auto_compute_dtype(gpu, cfg) == gpu_compute_dtype(cfg, False) == without
    # The CPU's rule is the family's alike: bf16 where native, else fp32 (the GPU's bf16 plays no part).
    cpu = Machine(ram_bytes=int(64 * GB), gpu_bf16=True)
    assert auto_compute_dtype(cpu, cfg) == "fp32"
    assert auto_compute_dtype(replace(cpu, cpu_bf16=True), cfg) == "bf16"
    if cfg is GEMMA:
        assert "fp16" not in {gpu_compute_dtype(cfg, native) for native in (True, False)}


def test_on_the_cpu_an_fp32_night_keeps_a_bf16_kv_cache_where_the_family_attends_it_as_stored() -> None:
    work, cpu = Work(32, 512, 128), Machine(ram_bytes=int(64 * GB))
    fp32, native = plan(GEMMA, work, cpu), plan(GEMMA, work, replace(cpu, cpu_bf16=True))
    assert (fp32.compute_dtype, fp32.kv_dtype, native.kv_dtype) == ("fp32", "bf16", "bf16")
    pinned = plan(GEMMA, work, cpu, kv_dtype="fp32")
    assert fp32.memory["ram"]["KV cache"] * 2 == pinned.memory["ram"]["KV cache"]
    assert plan(YALM, Work(4, 64, 8), Machine(ram_bytes=int(512 * GB))).kv_dtype == "fp32"  # YaLM casts it up


def test_a_gemma_plan_on_a_gpu_computes_in_bf16_or_fp32_and_its_memory_follows() -> None:
    work = Work(64, 512, 128)
    gpu = Machine(ram_bytes=int(64 * GB), gpu_bytes=int(24 * GB))
    bf16 = plan(GEMMA, work, replace(gpu, gpu_bf16=True), kv_dtype="auto")
    fp32 = plan(GEMMA, work, gpu, kv_dtype="auto")
    assert (bf16.device, bf16.compute_dtype, fp32.compute_dtype) == ("cuda", "bf16", "fp32")
    pinned = plan(GEMMA, work, gpu, compute_dtype="bf16", kv_dtype="auto")
    assert pinned.batch_size == bf16.batch_size  # the same placement, only the dtype differs
    # fp32 doubles the GPU's resident modules and the fp16 store's conversion buffers against bf16.
    for item in ("resident modules", "compute buffers"):
        assert fp32.memory["gpu"][item] == 2 * bf16.memory["gpu"][item] > 0
    # A pinned compute dtype wins over the family's on the GPU as it always did.
    assert plan(GEMMA, work, gpu, compute_dtype="bf16").compute_dtype == "bf16"


def test_yalm_plans_on_a_gpu_stay_fp16_whatever_the_gpus_bf16() -> None:
    for machine in (
        Machine(ram_bytes=int(64 * GB), gpu_bytes=int(8 * GB), disk_read_bps=3.5 * GB),
        Machine(ram_bytes=int(256 * GB), gpu_bytes=int(24 * GB), disk_read_bps=3.5 * GB),
    ):
        for dtype in ("fp16", "int4"):
            old, new = (
                plan(YALM, JOB, machine, weight_dtype=dtype),
                plan(YALM, JOB, replace(machine, gpu_bf16=True), weight_dtype=dtype),
            )
            assert old.compute_dtype == "fp16" and old.describe() == new.describe()


def test_fp16_pinned_for_gemma_on_a_gpu_warns_of_the_overflow(caplog: pytest.LogCaptureFixture) -> None:
    work = Work(8, 64, 16)
    gpu = Machine(ram_bytes=int(64 * GB), gpu_bytes=int(24 * GB), gpu_bf16=True)
    with caplog.at_level(logging.WARNING, logger="robot_llm.llm.plan.planner"):
        assert plan(GEMMA, work, gpu, compute_dtype="fp16").compute_dtype == "fp16"  # a warning, not an error
    assert any("gemma3" in r.message and "65504" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="robot_llm.llm.plan.planner"):
        plan(GEMMA, work, gpu)  # auto: bf16, no warning
        plan(GEMMA, work, Machine(ram_bytes=int(64 * GB)), compute_dtype="fp16")  # the CPU: not the GPU's risk
        plan(YALM, work, Machine(ram_bytes=int(512 * GB), gpu_bytes=int(80 * GB)), compute_dtype="fp16")
        plan(LLAMA, work, Machine(ram_bytes=int(512 * GB), gpu_bytes=int(80 * GB)), compute_dtype="fp16")
    assert not caplog.records


def test_gpu_bf16_is_false_without_cuda() -> None:
    # No GPU here (CPU-only torch): detection answers False, never raises.
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert gpu_has_native_bf16() is False and gpu_has_native_bf16("cuda:0") is False
    assert detect_machine().gpu_bf16 is False


def test_stance_scoring_and_logits_are_counted() -> None:
    machine = Machine(ram_bytes=int(64 * GB), gpu_bytes=int(8 * GB), disk_read_bps=3.5 * GB)
    without = plan(YALM, JOB, machine, weight_dtype="int4", kv_dtype="int4", max_batch_size=30)
    scored = plan(
        YALM, replace(JOB, stance_tokens=16), machine, weight_dtype="int4", kv_dtype="int4", max_batch_size=30
    )
    # The stance rides on each row's cache: one more weight stream per batch, not per request.
    assert scored.decode_seconds <= scored.stance_seconds < 2 * scored.prefill_seconds
    extra = scored.total_seconds - without.total_seconds
    assert scored.num_batches * scored.stance_seconds * 0.99 <= extra < 300 * scored.decode_seconds
    # Every row keeps 16 more slots, and the pass's fp32 logits (and their log-softmax) come back to RAM.
    # (Per row: the extra RAM can cost a row or two of batch.)
    kv_row, kv_row_without = (p.memory["ram"]["KV cache"] / p.batch_size for p in (scored, without))
    assert kv_row > kv_row_without
    assert scored.memory["ram"]["logits"] == 2 * scored.batch_size * 16 * YALM.vocab_size * 4
    assert "stance" in scored.describe()


def test_threads_follow_the_free_cores(tmp_path: Path) -> None:
    assert free_cores(2, load=1.4) == 1 and free_cores(16, load=0.2) == 16 and free_cores(2, load=9.0) == 1
    p = plan(YALM, Work(4, 64, 8), Machine(ram_bytes=int(512 * GB), cores=16, threads=12))
    assert p.threads == 12 and "12 compute thread(s)" in p.describe()
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile\n")
    assert cpu_has_native_bf16(info)
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 f16c\n")
    assert not cpu_has_native_bf16(info)


def _kv(p) -> int:
    return sum(items.get("KV cache", 0) for items in p.memory.values())


def test_a_shared_prefix_is_counted_once_per_batch() -> None:
    # Rows that share a P-token template head keep (T - P) slots of their own; the head is stored once.
    machine = Machine(ram_bytes=int(512 * GB), gpu_bytes=int(80 * GB))
    alone = plan(YALM, Work(32, 512, 128), machine, max_batch_size=32, kv_dtype="fp16")
    shared = plan(YALM, Work(32, 512, 128, shared_prefix_tokens=384), machine, max_batch_size=32, kv_dtype="fp16")
    assert alone.batch_size == shared.batch_size == 32
    slots = 512 + 128 - 1
    want = (32 * (slots - 384) + 384) / (32 * slots)
    assert _kv(shared) / _kv(alone) == pytest.approx(want)
    # More rows fit in the same memory when they share their head.
    tight = Machine(ram_bytes=int(200 * GB), gpu_bytes=int(24 * GB))
    assert plan(YALM, Work(300, 512, 128, 384), tight).batch_size > plan(YALM, Work(300, 512, 128), tight).batch_size


def test_a_compressed_kv_cache_is_chosen_when_memory_bounds_the_batch() -> None:
    machine = Machine(ram_bytes=int(64 * GB), gpu_bytes=int(8 * GB), disk_read_bps=3.5 * GB)
    plain = plan(YALM, JOB, machine, weight_dtype="int4", kv_dtype="fp16")
    auto = plan(YALM, JOB, machine, weight_dtype="int4")
    assert auto.kv_dtype in ("int8", "int4") and auto.batch_size > plain.batch_size
    assert auto.total_seconds < plain.total_seconds and f"as {auto.kv_dtype}" in auto.describe()
    # 4 bits + an fp16 step and minimum per 80-wide head and slot: 4.4 bits against fp16's 16.
    int4 = plan(YALM, JOB, machine, weight_dtype="int4", kv_dtype="int4", max_batch_size=8)
    fp16 = plan(YALM, JOB, machine, weight_dtype="int4", kv_dtype="fp16", max_batch_size=8)
    assert int4.memory["ram"]["KV cache"] / fp16.memory["ram"]["KV cache"] == pytest.approx(4.4 / 16, rel=1e-3)
    # Where memory is plentiful nothing is gained by compressing: the least compressed ties win.
    assert plan(YALM, Work(4, 64, 8), Machine(ram_bytes=int(512 * GB))).kv_dtype == "fp32"


def test_cpu_int4_and_int8_decode_with_the_fused_kernels() -> None:
    # bf16 on the CPU: decode steps read the stored bytes with torch's fused kernels (FUSED_RATES); fp16 compute
    # dequantizes every weight first (1 G values/s per
    # thread), which costs ~20x more at batch 1.
    machine = Machine(ram_bytes=int(512 * GB), cpu_bf16=True, cores=8, ram_bps=400 * GB)  # compute-bound, not RAM-bound
    work = Work(1, 64, 16)
    for dtype in ("int4", "int8"):
        values_per_s, flops = FUSED_RATES[dtype]
        matmuls = YALM.num_layers * layer_params(YALM) * (1 / values_per_s + 2 / flops) / 8
        for compute in FUSED_COMPUTE_DTYPES:
            fused = plan(YALM, work, machine, weight_dtype=dtype, compute_dtype=compute, weight_home="ram")
            assert matmuls < fused.decode_seconds < 1.05 * matmuls
        dequantized = plan(YALM, work, machine, weight_dtype=dtype, compute_dtype="fp16", weight_home="ram")
        assert dequantized.decode_seconds > 10 * fused.decode_seconds


def test_cpu_int8_past_the_kernels_row_limit_widens_then_multiplies_densely() -> None:
    # Past FUSED_MAX_ROWS["int8"] the int8 kernel costs more than widening the codes once (a copy) and a bf16
    # GEMM; int4 keeps its kernel up to its own limit (dequantizing int4 is far slower than widening int8).
    machine = Machine(ram_bytes=int(512 * GB), cpu_bf16=True, cores=8, ram_bps=400 * GB)  # compute-bound, not RAM-bound
    rows = FUSED_MAX_ROWS["int8"] + 1
    assert rows <= FUSED_MAX_ROWS["int4"]
    steps = {
        dtype: plan(YALM, Work(rows, 64, 16), machine, weight_dtype=dtype, compute_dtype="bf16", weight_home="ram")
        for dtype in ("int8", "int4")
    }
    params = YALM.num_layers * layer_params(YALM)
    widen = params / INT8_WIDEN_ELEMS_PER_S / 8
    gemm = 2 * rows * params / (machine.cpu_rate("bf16") * machine.compute_threads / machine.cores)
    assert widen + gemm < steps["int8"].decode_seconds < 1.05 * (widen + gemm)
    values_per_s, flops = FUSED_RATES["int8"]
    assert steps["int8"].decode_seconds < params * (1 / values_per_s + 2 * rows / flops) / 8  # cheaper than fused
    values_per_s, flops = FUSED_RATES["int4"]
    int4_fused = params * (1 / values_per_s + 2 * rows / flops) / 8
    assert int4_fused < steps["int4"].decode_seconds < 1.05 * int4_fused


def test_cpu_int8_activations_past_the_kernels_row_limit_cost_one_int8_gemm_on_ram_homed_layers() -> None:
    # Where calls of many rows quantize their activations, a RAM-homed layer's matrices (rotated once) cost one
    # int8 GEMM at the measured int8 rate; a streamed layer keeps the widened path.
    machine = Machine(ram_bytes=int(512 * GB), cpu_bf16=True, cores=8, ram_bps=400 * GB, cpu_int8_ops=4e12)
    rows = FUSED_MAX_ROWS["int8"] + 1
    work = Work(rows, 64, 16)
    params = YALM.num_layers * layer_params(YALM)
    for dtype in ("int8", "int4"):
        # int4 through its rotated int8 copy: the same GEMM, from the same row count.
        ram = plan(YALM, work, machine, weight_dtype=dtype, compute_dtype="bf16", weight_home="ram")
        gemm = 2 * rows * params / machine.cpu_int8_ops
        assert gemm < ram.decode_seconds < 1.05 * gemm
        without = plan(
            YALM, work, replace(machine, cpu_int8_ops=0), weight_dtype=dtype, compute_dtype="bf16", weight_home="ram"
        )
        assert ram.decode_seconds < without.decode_seconds  # int8 widened, int4 fused: both slower


def test_decode_attention_runs_in_ram_only_where_that_beats_copying_the_cache_up() -> None:
    # FlexGen's CPU attention: worth it when RAM is read much faster than the host link copies.
    work = Work(300, 512, 128)
    desktop = Machine(ram_bytes=int(256 * GB), gpu_bytes=int(8 * GB), disk_read_bps=3.5 * GB)
    server = replace(desktop, ram_bps=200 * GB, h2d_bps=4 * GB, cores=32)
    pinned = {"weight_dtype": "int4", "weight_home": "ram", "kv_dtype": "fp16"}
    copy_up, in_ram = plan(YALM, work, desktop, **pinned), plan(YALM, work, server, **pinned)
    assert copy_up.kv_home == in_ram.kv_home == "cpu"
    assert copy_up.attention_home == "compute" and in_ram.attention_home == "kv"
    assert "decode attention computed there" in in_ram.describe()
    assert "decode attention" not in copy_up.describe()
    # The same server copying the cache up: the GPU must hold the whole batch's K/V of a layer for
    # each decode step, so the batch is smaller, and the night longer.
    copying = plan(YALM, work, replace(server, ram_bps=1 * GB), **pinned)
    assert copying.attention_home == "compute" and "decode attention K/V" not in copying.memory["ram"]
    assert in_ram.memory["ram"]["decode attention K/V"] > 0
    assert in_ram.batch_size > copying.batch_size and in_ram.total_seconds < copying.total_seconds
    cpu_only = plan(YALM, work, Machine(ram_bytes=int(512 * GB), ram_bps=200 * GB))
    assert cpu_only.attention_home == "compute"  # no GPU: attention already runs where the cache is


def test_cpu_weights_in_ram_are_read_at_ram_speed_so_batch_1_is_not_free() -> None:
    # A step of a small batch on the CPU is bound by reading the weights from RAM; under a budget that
    # holds the model only with batch 1, streaming part of it at batch 32 is the faster night.
    machine = Machine(ram_bytes=int(512 * GB), cores=8, ram_bps=20 * GB)
    one = plan(YALM, Work(1, 64, 16), machine, weight_home="ram")
    assert one.decode_seconds >= YALM.num_layers * layer_bytes(YALM, "fp16") / (20 * GB)
    work = Work(32, 64, 16)
    whole = plan(YALM, work, machine, weight_home="ram", max_batch_size=1)
    budget = sum(whole.memory["ram"].values()) / 0.9
    tight = plan(YALM, work, machine, memory_budget_bytes=int(budget), max_batch_size=32)
    assert tight.batch_size > 1 and tight.total_seconds < whole.total_seconds


def test_cpu_int4_night_of_a_few_batches_runs_them_at_the_kernels_size_when_that_is_faster() -> None:
    # 60 prompts in one batch decode densely (each step dequantizes every weight); two batches of 30 decode
    # with the fused kernel. The planner tries both and keeps the faster.
    machine = Machine(ram_bytes=int(512 * GB), cpu_bf16=True, cores=8)
    work = Work(60, 64, 64)
    chosen = plan(YALM, work, machine, weight_dtype="int4")
    assert chosen.batch_size == 30 and chosen.num_batches == 2
    largest = plan(YALM, work, machine, weight_dtype="int4", compute_dtype="bf16", max_batch_size=60)
    assert largest.batch_size == 30  # the cap is a ceiling, not a pin
    one_batch = plan(YALM, Work(60, 64, 64), machine, weight_dtype="int4", max_batch_size=60, compute_dtype="fp32")
    assert one_batch.batch_size == 60  # no kernel in fp32: the largest batch stays
    # Its decode steps are the fused kernel's at 30 rows.
    values_per_s, flops = FUSED_RATES["int4"]
    matmuls = YALM.num_layers * layer_params(YALM) * (1 / values_per_s + 2 * 30 / flops) / machine.compute_threads
    assert matmuls < chosen.decode_seconds < 1.05 * matmuls


def test_a_mixed_int4_store_times_its_int8_matrices_on_int8s_own_path() -> None:
    # An int4 store of a GGUF file keeps some matrices int8: their share of the parameters is timed with int8's
    # kernel and row limit (10), the rest with int4's (48). Same bytes per layer: only the time model differs.
    # bf16 GEMMs slow enough that widened int8 costs more than int4's kernel at 32 rows (at the default 1 TFLOP/s
    # it costs a little less), fast enough that 32 rows still beat 4 batches of 8 within int8's limit.
    machine = Machine(ram_bytes=int(512 * GB), cpu_bf16=True, cores=8, ram_bps=400 * GB, cpu_bf16_flops=0.6e12)
    sizes = [layer_bytes(YALM, "int4")] * YALM.num_layers
    pinned = dict(weight_dtype="int4", compute_dtype="bf16", weight_home="ram", kv_dtype="bf16", layer_sizes=sizes)
    params, share, threads = YALM.num_layers * layer_params(YALM), 0.25, machine.compute_threads

    def fused(dtype: str, rows: int) -> float:
        values_per_s, flops = FUSED_RATES[dtype]
        return share * params * (1 / values_per_s + 2 * rows / flops) / threads

    rows = 32
    assert FUSED_MAX_ROWS["int8"] < rows <= FUSED_MAX_ROWS["int4"]
    work = Work(rows, 64, 16)
    int4 = plan(YALM, work, machine, **pinned)
    assert plan(YALM, work, machine, **pinned, int8_share=0.0) == int4  # nothing int8: today's numbers
    mixed = plan(YALM, work, machine, **pinned, int8_share=share)
    assert (mixed.batch_size, int4.batch_size) == (rows, rows)
    # Past int8's limit its codes are widened (a copy) and multiplied densely in bf16, here slower than int4's kernel.
    widened = share * params * (2 * rows / machine.cpu_rate("bf16") + 1 / (INT8_WIDEN_ELEMS_PER_S * threads))
    assert widened > fused("int4", rows)
    assert mixed.decode_seconds - int4.decode_seconds == pytest.approx(widened - fused("int4", rows), rel=1e-6)
    # Within int8's limit both take their fused kernels; int8's reads and multiplies slower.
    small = Work(FUSED_MAX_ROWS["int8"], 64, 16)
    gap = plan(YALM, small, machine, **pinned, int8_share=share).decode_seconds
    gap -= plan(YALM, small, machine, **pinned).decode_seconds
    assert gap == pytest.approx(fused("int8", small.num_prompts) - fused("int4", small.num_prompts), rel=1e-6)
    assert gap > 0
    # What model plan prints says the store is mixed.
    assert "weights stored as int4 (25% of the layer matrices' parameters int8)" in mixed.describe()
    assert "parameters int8" not in int4.describe()
    for dtype, bad in (("int4", 1.5), ("int4", -0.1), ("int8", 0.25), ("fp16", 0.25)):
        with pytest.raises(PlanError, match="int8 share"):
            plan(YALM, work, machine, **{**pinned, "weight_dtype": dtype, "layer_sizes": None}, int8_share=bad)


def test_a_mixed_store_may_take_batches_within_int8s_row_limit() -> None:
    # The kernel-sized retry tries each stored dtype's row limit: a mixed store's int8 one too.
    machine = Machine(ram_bytes=int(512 * GB), cpu_bf16=True, cores=8, ram_bps=400 * GB, cpu_bf16_flops=0.05e12)
    pinned = dict(weight_dtype="int4", compute_dtype="bf16", weight_home="ram", kv_dtype="bf16")
    work = Work(40, 8, 256)  # long decodes: the step's cost decides
    assert plan(YALM, work, machine, **pinned).batch_size == 40  # all int4: its kernel takes 40 rows
    assert plan(YALM, work, machine, **pinned, int8_share=0.9).batch_size <= FUSED_MAX_ROWS["int8"]


def test_hidden_cpu_flags_make_this_machine_the_avx2_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    from robot_llm.llm.plan import cpu

    monkeypatch.setenv(cpu.HIDE_FLAGS_ENV, "avx512_bf16, amx_bf16")
    cpu._this_cpu_flags.cache_clear()
    try:
        assert not cpu_has_native_bf16()
        assert cpu.cpu_flags() == cpu.cpu_flags("/proc/cpuinfo") - {"avx512_bf16", "amx_bf16"}
    finally:
        monkeypatch.delenv(cpu.HIDE_FLAGS_ENV)
        cpu._this_cpu_flags.cache_clear()
