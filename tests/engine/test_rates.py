"""Measured rates (robot_llm.llm.plan.rates): what the probes measure, where a night uses them, and that the
planner's formulas give back the measured numbers. Real torch, real probes; no wall-clock assertions."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from robot_llm.errors import RobotLLMError
from robot_llm.llm.engine.runtime import ModelSettings, machine_for, night_machine
from robot_llm.llm.families.yalm import YalmConfig
from robot_llm.llm.plan import rates
from robot_llm.llm.plan.cpu import cpu_has_native_bf16
from robot_llm.llm.plan.machine import GPUError, Machine, usable_gpu_bytes
from robot_llm.llm.plan.planner import Work, plan
from robot_llm.llm.plan.sizes import layer_bytes, layer_params
from robot_llm.llm.store.int8act import int8_activations_on_cpu

CACHED = (rates.cpu_gemm_flops, rates.ram_read_bps, rates.gpu_rates)


@pytest.fixture(autouse=True)
def fresh_probes() -> Iterator[None]:
    """Each test starts with nothing measured (the probes cache per process)."""
    for probe in CACHED:
        probe.cache_clear()
    yield
    for probe in CACHED:
        probe.cache_clear()


def _positive(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x > 0


def _threads_seen(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the intra-op thread count every probe loop runs at (the real loop runs)."""
    seen: list[int] = []
    real = rates._calls_per_second

    def recording(call: Callable[[], object], sync: Callable[[], None], seconds: float) -> float:
        seen.append(torch.get_num_threads())
        return real(call, sync, seconds)

    monkeypatch.setattr(rates, "_calls_per_second", recording)
    return seen


def test_the_probes_run_at_the_asked_threads_and_put_the_count_back(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    other = 1 if before > 1 else 2
    seen = _threads_seen(monkeypatch)
    assert _positive(rates.gemm_flops(64, 256, 256, "fp32", threads=other))
    assert _positive(rates.read_bps(1 << 20, threads=other)) and _positive(
        rates.read_bps(1 << 20, "bf16", threads=other)
    )
    assert _positive(rates.cpu_gemm_flops("fp32", other)) and _positive(rates.ram_read_bps("bf16", other))
    assert seen == [other] * 5
    assert torch.get_num_threads() == before


def test_the_device_probes_run_on_the_cpu_device() -> None:
    # The GPU's rates are this function on "cuda" (a pinned source, synchronised timing); here on the CPU.
    on_cpu = rates.gpu_rates("cpu", (32, 128, 128), 1 << 20)
    assert on_cpu is not None and all(map(_positive, on_cpu))
    gpu = rates.gpu_rates()
    if torch.cuda.is_available():
        assert gpu is not None and all(map(_positive, gpu))
    else:
        assert gpu is None  # no GPU: nothing measured, the defaults stay (assumed)


def test_measured_rates_given_rates_and_their_labels() -> None:
    native = cpu_has_native_bf16()
    machine = Machine(ram_bytes=1 << 30, cores=2, threads=1, cpu_bf16=native)
    default = Machine(ram_bytes=1 << 30)
    got, sources = rates.measure_rates(machine)
    fp32 = rates.cpu_gemm_flops("fp32", 1)
    assert _positive(fp32)
    # Stored for all cores; the planner's share of them (compute_threads / cores) is what was measured.
    assert got.cpu_flops == pytest.approx(fp32 * 2, rel=1e-12)
    assert sources["cpu_flops"] == "measured at 1 thread, scaled to 2 cores"
    assert got.ram_bps == rates.ram_read_bps("fp32", 1) and sources["ram_bps"] == "measured at 1 thread"
    line = rates.describe_rates(got, sources)
    if native:
        bf16 = rates.cpu_gemm_flops("bf16", 1)
        assert bf16 is not None and got.cpu_bf16_flops == pytest.approx(bf16 * 2, rel=1e-12)
        assert sources["cpu_bf16_flops"] == "measured at 1 thread, scaled to 2 cores"
        # The RAM read in bf16 too (torch's one-row bf16 GEMM reads slower), not scaled: it is per thread count.
        assert got.ram_bf16_bps == rates.ram_read_bps("bf16", 1) and got.ram_rate("bf16") == got.ram_bf16_bps
        assert sources["ram_bf16_bps"] == "measured at 1 thread"
        assert f"RAM read in bf16 {got.ram_bf16_bps / 1e9:.1f} GB/s (measured at 1 thread)" in line
    else:
        assert got.cpu_bf16_flops == default.cpu_bf16_flops and sources["cpu_bf16_flops"] == "assumed"
        assert got.ram_bf16_bps == 0 and got.ram_rate("bf16") == got.ram_bps and "in bf16" not in line
    assert got.ram_rate("fp32") == got.ram_bps
    # The int8 x int8 GEMM that calls of many rows meet, where they quantize their activations.
    int8 = rates.cpu_int8_gemm_ops(1)
    if int8_activations_on_cpu():
        assert _positive(int8) and got.cpu_int8_ops == pytest.approx(int8 * 2, rel=1e-12)
        assert f"int8 activations {got.cpu_int8_ops / 1e12:.3g} TOP/s (measured at 1 thread" in line
    else:
        assert int8 is None and got.cpu_int8_ops == 0 and "int8 activations" not in line
    # No GPU on this machine: its rates stay the defaults, and the disk is the caller's.
    assert (got.h2d_bps, got.gpu_flops, got.disk_read_bps) == (
        default.h2d_bps,
        default.gpu_flops,
        default.disk_read_bps,
    )
    assert sources["h2d_bps"] == sources["gpu_flops"] == sources["disk_read_bps"] == "assumed"

    # Given rates win, and are labelled so; the others are still measured.
    given = {"cpu_flops": 0.3e12, "ram_bps": 7e9, "disk_read_bps": 2e9}
    got, sources = rates.measure_rates(machine, given)
    assert (got.cpu_flops, got.ram_bps, got.disk_read_bps) == (0.3e12, 7e9, 2e9)
    assert {sources[k] for k in given} == {"given"}
    # A given RAM rate stands for every dtype: bf16's read is not measured against it, nor printed.
    assert got.ram_bf16_bps == 0 and got.ram_rate("bf16") == 7e9 and sources["ram_bf16_bps"] == "assumed"
    assert "in bf16" not in rates.describe_rates(got, sources)
    assert sources["cpu_bf16_flops"] == ("measured at 1 thread, scaled to 2 cores" if native else "assumed")

    # A machine described, not this one: nothing measured.
    got, sources = rates.measure_rates(machine, probe_cpu=False, probe_gpu=False)
    assert got == machine and set(sources.values()) == {"assumed"}
    with pytest.raises(ValueError, match="positive"):
        rates.measure_rates(machine, {"ram_bps": -1.0})


def _mid(layers: int = 2) -> YalmConfig:
    return YalmConfig(
        num_layers=layers,
        hidden_size=1024,
        embedding_size=256,
        intermediate_size=2730,
        num_attention_heads=16,
        max_position_embeddings=1024,
        vocab_size=4000,
    )


def test_a_night_plans_with_the_rates_measured_at_its_threads(tmp_path: Path) -> None:
    settings = ModelSettings(vocab=tmp_path / "v", store=tmp_path, home="ram", device="cpu", threads=1)
    machine, sources = night_machine(settings)
    assert machine.compute_threads == 1 and machine.gpu_bytes == 0
    assert sources["cpu_flops"].startswith("measured at 1 thread") and sources["ram_bps"] == "measured at 1 thread"
    assert sources["disk_read_bps"] == "assumed; the weights are read once, into RAM"
    fp32 = rates.cpu_gemm_flops("fp32", 1)
    assert fp32 is not None

    # The planner's formulas give back what was measured. Prefill of 256 tokens is compute-bound: each layer
    # costs (2 rows params + 4 rows slots q_width) / rate, the rate being cpu_rate * compute_threads / cores.
    cfg, P = _mid(), 256
    L, params, q_width = cfg.num_layers, layer_params(cfg), cfg.num_attention_heads * cfg.head_dim
    flops = L * (2 * P * params + 4 * P * P * q_width)
    work = Work(1, P, 2, stance_tokens=0)
    for dtype, measured in (("fp32", fp32), ("bf16", rates.cpu_gemm_flops("bf16", 1))):
        if dtype == "bf16" and not machine.cpu_bf16:
            continue
        # Each compute dtype reads a RAM-homed layer at the rate measured in that dtype.
        ram = rates.ram_read_bps(dtype, 1)
        assert measured is not None and ram is not None
        p = plan(cfg, work, machine, weight_dtype=dtype, compute_dtype=dtype, weight_home="ram", kv_dtype="fp32")
        assert p.threads == 1 and p.compute_dtype == dtype
        assert layer_bytes(cfg, dtype) / ram < flops / L / measured  # compute, not the RAM read, bounds prefill
        assert flops / p.prefill_seconds == pytest.approx(measured, rel=1e-9)
        # A decode step of one row over RAM-homed layers is bounded by reading them: at the measured RAM rate.
        step_flops = 2 * params + 4 * (P + 1) * q_width
        assert step_flops / measured < layer_bytes(cfg, dtype) / ram
        assert L * layer_bytes(cfg, dtype) / p.decode_seconds == pytest.approx(ram, rel=1e-9)


def test_a_night_measures_once_per_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[object, ...]] = []
    real = rates.gemm_flops

    def counting(*args: object, **kwargs: object) -> float:
        calls.append(args)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(rates, "gemm_flops", counting)
    settings = ModelSettings(vocab=tmp_path / "v", store=tmp_path, home="ram", device="cpu", threads=1)
    first = machine_for(settings)
    assert machine_for(settings) == first and night_machine(settings)[0] == first
    assert len(calls) == (2 if first.cpu_bf16 else 1)  # fp32 (and bf16 where native), once each
    assert rates.ram_read_bps.cache_info().misses == (2 if first.cpu_bf16 else 1)  # fp32 (and bf16), once each
    assert rates.gpu_rates.cache_info().currsize == 0  # a CPU night never touches the GPU


# --------------------------------------------------------------------------- the GPU memory a night may use

GiB = 1 << 30


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, free: int, total: int, reserved: int) -> None:
    """A CUDA device as torch reports it (no GPU here): ``free`` of ``total`` bytes, ``reserved`` by this process."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)


def test_a_night_may_use_the_free_gpu_memory_plus_its_own() -> None:
    # An 8 GiB GPU whose desktop holds 1.5 GiB: 6.5 GiB free, nothing of ours yet.
    assert usable_gpu_bytes(int(6.5 * GiB), 8 * GiB, 0) == int(6.5 * GiB)
    # Re-planned with our model loaded (5 GiB reserved by our torch): ours counts back as usable.
    assert usable_gpu_bytes(int(1.5 * GiB), 8 * GiB, 5 * GiB) == int(6.5 * GiB)
    assert usable_gpu_bytes(8 * GiB, 8 * GiB, 1 * GiB) == 8 * GiB  # never more than the GPU has


def test_the_night_machine_sees_usable_gpu_memory_capped_by_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_cuda(monkeypatch, free=int(1.5 * GiB), total=8 * GiB, reserved=5 * GiB)
    settings = ModelSettings(vocab=tmp_path / "v", store=tmp_path, home="ram", threads=1)
    got, sources = night_machine(settings, probe_gpu=False)
    assert got.gpu_bytes == int(6.5 * GiB)
    assert sources["gpu_flops"] == sources["h2d_bps"] == "assumed; the night measures it"
    budget = replace(settings, gpu_memory_budget_bytes=4 * GiB)
    assert night_machine(budget, probe_gpu=False)[0].gpu_bytes == 4 * GiB
    roomy = replace(settings, gpu_memory_budget_bytes=7 * GiB)  # a budget above what is usable: what is usable
    assert night_machine(roomy, probe_gpu=False)[0].gpu_bytes == int(6.5 * GiB)
    assert rates.gpu_rates.cache_info().currsize == 0


def test_a_gpu_that_cannot_be_asked_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    busy = "CUDA error: all CUDA-capable devices are busy or unavailable\nCUDA kernel errors might be reported..."

    def raising(device: object = None) -> tuple[int, int]:
        raise RuntimeError(busy)

    _fake_cuda(monkeypatch, 0, 0, 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", raising)
    settings = ModelSettings(vocab=tmp_path / "v", store=tmp_path, home="ram", threads=1)
    with pytest.raises(GPUError) as caught:
        night_machine(settings)
    message = str(caught.value)
    assert "\n" not in message and isinstance(caught.value, RobotLLMError)
    assert message.startswith("the GPU (cuda) cannot be used: CUDA error: all CUDA-capable devices are busy")
    assert "model.device: cpu" in message
    assert rates.gpu_rates.cache_info().currsize == 0

    # A night pinned to the CPU does not touch CUDA at all.
    def touched() -> bool:
        raise AssertionError("CUDA asked on a CPU night")

    monkeypatch.setattr(torch.cuda, "is_available", touched)
    assert night_machine(replace(settings, device="cpu"))[0].gpu_bytes == 0
