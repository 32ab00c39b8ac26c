"""The door (Model.open) and the convert / verify / plan / check-fixture commands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from robot_llm.commands.model import main
from robot_llm.llm.generate import SamplingParams
from robot_llm.llm.model import Model, ModelSettings
from robot_llm.llm.plan import rates
from robot_llm.llm.plan.cpu import cpu_has_native_bf16
from robot_llm.llm.plan.planner import PlanError

PROMPTS = ["Акции выросли", "The index fell after the report", "Нефть"]


def test_stream_runtime_generates_what_the_memory_backend_generates(tiny_dir: Path, stores: dict[str, Path]) -> None:
    vocab = tiny_dir / "vocab" / "voc_tiny.sp"
    params = SamplingParams(max_new_tokens=6, greedy=True)
    stream = Model.open(
        ModelSettings(vocab=vocab, store=stores["fp16"], device="cpu", dtype="fp32", memory_budget_bytes=4 << 30)
    )
    memory = Model.open(
        ModelSettings(vocab=vocab, backend="memory", checkpoint=tiny_dir / "weights", device="cpu", dtype="fp32")
    )
    try:
        assert stream.model_id.startswith("yalm-tiny/fp16@") and memory.model_id.startswith("yalm-tiny/fp32@")
        ours, theirs = stream.generate(PROMPTS, params), memory.generate(PROMPTS, params)
        assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
        assert stream.score("Нефть", [" выросла", " упала"]) == pytest.approx(
            memory.score("Нефть", [" выросла", " упала"]), abs=1e-4
        )
    finally:
        stream.close()
        memory.close()


def test_the_stream_engine_opens_as_planned(tiny_dir: Path, stores: dict[str, Path]) -> None:
    vocab = tiny_dir / "vocab" / "voc_tiny.sp"
    threads = torch.get_num_threads()
    auto = Model.open(ModelSettings(vocab=vocab, store=stores["int4"], device="cpu", memory_budget_bytes=4 << 30))
    try:
        # Everything fits: the layers live in RAM; the CPU computes in bf16 exactly where it is native.
        assert auto.engine.home == "ram" and auto.engine.ram_layers == 2
        assert auto.engine.dtype == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
        completions = auto.generate(PROMPTS, SamplingParams(max_new_tokens=3, greedy=True))
        assert all(c.new_token_count == 3 for c in completions)
    finally:
        auto.close()
    pinned = Model.open(
        ModelSettings(
            vocab=vocab, store=stores["fp16"], device="cpu", home="split", dtype="fp32", threads=1, kv_dtype="int8"
        )
    )
    try:
        assert (pinned.engine.home, pinned.engine.ram_layers, pinned.engine.dtype) == ("disk", 1, torch.float32)
        assert torch.get_num_threads() == 1 and pinned.engine.kv_dtype == "int8"
        completions = pinned.generate(PROMPTS, SamplingParams(max_new_tokens=3, greedy=True))
        assert all(c.new_token_count == 3 for c in completions)
    finally:
        pinned.close()
        torch.set_num_threads(threads)


def test_runtime_refuses_a_ram_home_over_budget(tiny_dir: Path, stores: dict[str, Path]) -> None:
    settings = ModelSettings(
        vocab=tiny_dir / "vocab" / "voc_tiny.sp", store=stores["fp16"], home="ram", memory_budget_bytes=1 << 20
    )
    with pytest.raises(PlanError, match="RAM"):
        Model.open(settings)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_convert_verify_commands(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], dtype: str
) -> None:
    store = tmp_path / "store"
    assert main(["model", "convert", str(tiny_dir), str(store), "--dtype", dtype]) == 0
    assert main(["model", "verify", str(store)]) == 0
    assert "OK" in capsys.readouterr().out
    path = store / "output.safetensors"
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    assert main(["model", "verify", str(store)]) == 1
    assert "output.safetensors: sha256 mismatch" in capsys.readouterr().out
    assert main(["model", "check-fixture", str(tiny_dir), "--engine", "stream", "--home", "ram"]) == 0


def test_plan_command_prints_a_plan_or_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["model", "plan", "--preset", "yalm-100b", "--gpu-gb", "8", "--ram-gb", "64", "--disk-gbps", "3.5"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "batch size" in out and "weights homed in split" in out and "estimated time" in out
    assert "stance: from each row's KV cache" in out
    assert "disk 3.5 GB/s (given)" in out  # where the disk's rate came from is printed with it
    assert main(["model", "plan", "--preset", "yalm-100b", "--gpu-gb", "4", "--ram-gb", "16"]) == 1
    out = capsys.readouterr().out
    assert "refused" in out and "GB/s (assumed; --disk-gbps states yours)" in out
    assert main([*args, "--dtype", "int4"]) == 0
    assert "weights stored as int4" in capsys.readouterr().out


def test_plan_command_gives_a_described_gpu_native_bf16_unless_told(capsys: pytest.CaptureFixture[str]) -> None:
    machine = ["--gpu-gb", "8", "--ram-gb", "64", "--prompts", "8"]
    for preset, flags, dtype in (
        ("gemma-3-270m", [], "bf16"),
        ("gemma-3-270m", ["--gpu-bf16", "no"], "fp32"),
        ("yalm-100b", [], "fp16"),
        ("yalm-100b", ["--gpu-bf16", "no"], "fp16"),
    ):
        assert main(["model", "plan", "--preset", preset, *machine, *flags]) == 0
        assert f"compute on cuda in {dtype}," in capsys.readouterr().out


def test_plan_command_measures_this_machine_and_given_rates_win(capsys: pytest.CaptureFixture[str]) -> None:
    probes = (rates.cpu_gemm_flops, rates.ram_read_bps, rates.gpu_rates)
    for probe in probes:
        probe.cache_clear()
    # Another machine (--ram-gb): its rates are assumed, and nothing of this one is measured.
    assert main(["model", "plan", "--preset", "yalm-100b", "--ram-gb", "256", "--dtype", "int4"]) == 0
    out = capsys.readouterr().out
    assert "CPU fp32 0.5 TFLOP/s (assumed; --cpu-tflops states yours)" in out
    assert "RAM read 10.0 GB/s (assumed; --ram-gbps states yours)" in out
    assert [probe.cache_info().currsize for probe in probes] == [0, 0, 0]
    # This machine's CPU with another GPU (--gpu-gb): the CPU measured, the GPU's rates assumed, not probed.
    assert main(["model", "plan", "--preset", "yalm-100b", "--gpu-gb", "8", "--dtype", "int4"]) == 0
    out = capsys.readouterr().out
    assert "GPU 30 TFLOP/s (assumed; --gpu-tflops states yours)" in out
    assert "host-to-GPU 12.0 GB/s (assumed; --h2d-gbps states yours)" in out
    assert rates.gpu_rates.cache_info().currsize == 0

    # This machine: measured at the threads its plan computes with; given flags win over the measurement.
    def threads(out: str) -> str:
        planned = re.search(r"CPU \d+ cores, (\d+) compute thread\(s\)", out)
        assert planned is not None and f"\n{planned[1]} compute thread(s)\n" in out  # the plan's own count
        return planned[1]

    flags = ["--cpu-tflops", "0.3", "--ram-gbps", "7"]
    assert main(["model", "plan", "--preset", "yalm-100b", "--dtype", "int4", *flags]) == 0
    out = capsys.readouterr().out
    assert "RAM read 7.0 GB/s (given)" in out and "CPU fp32 0.3 TFLOP/s (given)" in out
    if cpu_has_native_bf16():
        assert re.search(rf"bf16 [\d.]+ TFLOP/s \(measured at {threads(out)} threads?[,)]", out)
    assert main(["model", "plan", "--preset", "yalm-100b", "--dtype", "int4"]) == 0
    out = capsys.readouterr().out
    n = threads(out)
    assert re.search(rf"RAM read [\d.]+ GB/s \(measured at {n} threads?\)", out)
    assert re.search(rf"CPU fp32 [\d.]+ TFLOP/s \(measured at {n} threads?[,)]", out)


def test_the_stream_engine_reports_liveness_after_every_layer(tiny_dir: Path, stores: dict[str, Path]) -> None:
    # The watchdog's unit of liveness is one layer (of one prefill micro-batch), not a whole forward pass.
    vocab = tiny_dir / "vocab" / "voc_tiny.sp"
    loaded = Model.open(ModelSettings(vocab=vocab, store=stores["fp16"], device="cpu", micro_batch=2))
    model = loaded.engine
    layers = loaded.config.num_layers
    forwards: list[int] = []
    beats: list[int] = []
    inner = model.forward

    def counted(ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        forwards.append(len(beats))
        return inner(ids, *args, **kwargs)

    model.forward = counted  # type: ignore[method-assign]
    try:
        loaded.generate(PROMPTS, SamplingParams(max_new_tokens=3, greedy=True), on_step=lambda: beats.append(1))
    finally:
        loaded.close()
    # Prefill of 3 rows in micro-batches of 2: 2 beats per layer; 2 decode steps: 1 per layer; +1 per pass.
    assert len(forwards) == 3
    assert len(beats) == layers * 2 + 1 + 2 * (layers + 1)
    # The job's callback and micro-batch were passed to the engine's calls, never written into it.
    assert not hasattr(model, "on_layer") and model.micro_batch == loaded.policy.micro_batch == 2


def test_plan_command_on_this_gpu_assumes_its_rates(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A GPU here (there is none: torch answers as a desktop's 8 GiB GPU would, 6 GiB of it free). Planning for it
    # must not probe it: a night may be running there, and the probe's ~320 MiB could push it out.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (6 << 30, 8 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    rates.gpu_rates.cache_clear()
    assert main(["model", "plan", "--preset", "yalm-100b", "--dtype", "int4"]) == 0
    out = capsys.readouterr().out
    assert "machine: GPU 6 GB" in out  # what is free, not the 8.6 GB the GPU has
    assert "GPU 30 TFLOP/s (assumed; the night measures it, --gpu-tflops states yours)" in out
    assert "host-to-GPU 12.0 GB/s (assumed; the night measures it, --h2d-gbps states yours)" in out
    assert rates.gpu_rates.cache_info().currsize == 0


def test_a_given_policy_is_the_engine_and_no_job_changes_it(tiny_dir: Path, stores: dict[str, Path]) -> None:
    import dataclasses

    from robot_llm.llm.model import Policy

    vocab = tiny_dir / "vocab" / "voc_tiny.sp"
    policy = Policy(device="cpu", compute_dtype="fp32", weight_home="split", ram_layers=1, threads=1, micro_batch=1)
    threads = torch.get_num_threads()
    opened = Model.open(ModelSettings(vocab=vocab, store=stores["fp16"], device="cpu"), policy)
    engine = opened.engine
    try:
        assert opened.policy is policy and torch.get_num_threads() == 1
        assert (engine.home, engine.ram_layers, engine.dtype, engine.micro_batch) == ("disk", 1, torch.float32, 1)
        before = dict(vars(engine))
        opened.generate(PROMPTS, SamplingParams(max_new_tokens=2, greedy=True))
        opened.score("Нефть", [" выросла", " упала"])
        # Every attribute the engine had is the same object after two jobs (the stats and slots it updates
        # in place aside, the layer stream's position and the last pass's hidden state, an output the
        # stance head reads): nothing per-job was written into it.
        changed = {k for k, v in vars(engine).items() if before.get(k) is not v}
        assert changed <= {"_next", "_prefetched", "_current", "_read_busy_until", "last_hidden"}, changed
        with pytest.raises(dataclasses.FrozenInstanceError):
            policy.micro_batch = 4  # type: ignore[misc]
    finally:
        opened.close()
        torch.set_num_threads(threads)
