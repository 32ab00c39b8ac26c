"""The planning behind the door (:meth:`robot_llm.llm.model.Model.open`): :class:`ModelSettings` -> a
:class:`~robot_llm.llm.engine.policy.Policy` at open, a :class:`~robot_llm.llm.engine.policy.Task` per job.

:class:`ModelSettings` says which engine runs the model (``memory``, ``stream`` or ``deepspeed``),
where the weights are and how much memory the run may take; the night builds it from its config
(:func:`robot_llm.night.model.model_settings`), the command line from its flags.

The plan is the run. Opening the stream engine plans the night (:func:`decide_policy`,
:mod:`robot_llm.llm.plan.planner`): the weight home (disk, RAM or split across both), the compute
dtype (bf16 on a CPU that has it natively, never fp16 on a CPU), the KV home and the intra-op threads
come from the plan, within ``memory_budget_bytes`` and ``gpu_memory_budget_bytes``; every setting
that is not ``auto`` pins its choice. Every ``generate`` and ``score`` call is then planned for its
real work (:func:`plan_task`): the batch size and prefill micro-batch come from that plan, and a job
that cannot fit is refused before any token is computed. ``robot-llm doctor`` prints the same plan.
The plan's rates are this machine's, measured once per process (:func:`night_machine`):
the disk under the store, the CPU's GEMM and RAM read rates at the night's threads,
and a GPU's copy and GEMM rates.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from robot_llm.errors import BackendError, RobotLLMError
from robot_llm.llm.engine.policy import Policy, Task
from robot_llm.llm.families.config import ModelConfig
from robot_llm.llm.plan.machine import Machine, detect_machine
from robot_llm.llm.plan.planner import Plan, Work, auto_compute_dtype, gpu_compute_dtype, plan, warn_gpu_dtype
from robot_llm.llm.plan.rates import measure_rates

if TYPE_CHECKING:
    from robot_llm.llm.store.reader import Manifest, Store

log = logging.getLogger(__name__)

#: Common head (tokens) of a batch's prompts from which their KV is shared: below it, the head's
#: own weight pass costs more than the prefill and the memory it saves.
SHARE_PREFIX_MIN = 16


@dataclass(frozen=True)
class ModelSettings:
    """How to open the model.

    * ``backend``: ``memory`` (whole model in RAM/VRAM), ``stream`` (layer
      streaming from a store) or ``deepspeed`` (ZeRO-3 offload to ``offload``).
    * ``checkpoint``: a release folder; ``store``: a converted weight store
      (``robot-llm model convert``). ``stream`` prefers ``store``; given only a
      release, it converts it to fp16 in ``offload_dir/store`` (kept for the
      next run) or in a temporary folder.
    * ``vocab``: the SentencePiece model file.
    * ``home``: where the stream engine keeps layers (``disk``, ``ram``,
      ``split``: the first layers in RAM, the rest on disk; ``auto``: planned).
    * ``dtype``: compute dtype (``auto`` = fp16 on CUDA; on a CPU bf16 where
      it is native, else fp32).
    * ``device``: ``auto`` (CUDA if present), ``cpu`` or ``cuda``.
    * ``max_batch_size``: upper bound on prompts per batch.
    * ``refill_slots``: KV slots per row reserved so that a row whose thesis is done takes
      the next waiting prompt (continuous batching); 0 = off. Planned as KV memory.
    * ``memory_budget_bytes`` / ``gpu_memory_budget_bytes``: RAM / GPU memory
      the run may use (the planner keeps within both).
    * ``threads``: intra-op compute threads (None: the cores not busy with
      other work, :func:`robot_llm.llm.plan.machine.free_cores`).
    * ``micro_batch``: most rows of a prefill pass at once (None: planned; a
      pin lowers the planned one, never raises it).
    * ``kv_dtype``: the KV cache's dtype (``auto``: planned; ``int8``/``int4``
      compressed, :mod:`robot_llm.llm.engine.kvquant`; or a float dtype).
    * ``max_new_tokens`` / ``stance_tokens``: the night's work per request, for
      the plan made when the model opens (longest prompts the window allows,
      ``max_positions`` when it is shorter than the model's).
    * ``offload_dir``: DeepSpeed NVMe swap folder / converted store folder.
    * ``offload``: DeepSpeed parameter offload target, ``cpu`` or ``nvme``.
    * ``preset``: model config name when the release folder has no ``config.json``;
      ``config_file``: the release's config elsewhere (a fixture's ``config.json``).
    * ``trust_pickle``: load release files that ``torch.load(weights_only=True)`` refuses.
    * ``name``: the user's name for the model (config ``model.id``), the head of the model id.

    ``dtype`` ``int8``/``int4`` names a store's weights, not a compute dtype: the plan picks the compute
    dtype, and a release opened by the stream engine is converted into such a store.
    """

    vocab: Path
    backend: Literal["memory", "stream", "deepspeed"] = "stream"
    checkpoint: Path | None = None
    store: Path | None = None
    home: Literal["auto", "disk", "ram", "split"] = "auto"
    dtype: str = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_batch_size: int = 32
    refill_slots: int = 0
    memory_budget_bytes: int | None = None
    gpu_memory_budget_bytes: int | None = None
    threads: int | None = None
    micro_batch: int | None = None
    kv_dtype: str = "auto"
    max_new_tokens: int = 128
    stance_tokens: int = 16
    max_positions: int | None = None
    offload_dir: Path | None = None
    offload: Literal["cpu", "nvme"] = "nvme"
    preset: str | None = None
    config_file: Path | None = None
    trust_pickle: bool = False
    name: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in ("memory", "stream", "deepspeed"):
            raise RobotLLMError(f"unknown model backend {self.backend!r}")
        if self.checkpoint is None and self.store is None:
            raise RobotLLMError("model settings need a checkpoint (release folder) or a store folder")
        if self.backend == "memory" and self.checkpoint is None:
            raise RobotLLMError("the memory backend loads a release checkpoint; set checkpoint")
        if self.max_batch_size < 1:
            raise RobotLLMError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.refill_slots < 0:
            raise RobotLLMError(f"refill_slots must be >= 0, got {self.refill_slots}")
        if self.backend != "stream" and self.dtype in ("int8", "int4"):
            raise BackendError(f"the {self.backend} backend computes in fp32, bf16 or fp16, not {self.dtype!r}")


#: Where the GPU's rates come from when they are not probed (``doctor``, ``model plan``).
GPU_RATES_ASSUMED = "assumed; the night measures it"

#: A store file smaller than this measures the disk's latency, not its bandwidth: the default rate stays.
PROBE_MIN_BYTES = 64 << 20
#: The probe reads about this much of the file (0.2 s at 3 GB/s; YaLM-100B's largest file is 2.6 GB).
PROBE_MAX_BYTES = 512 << 20


@functools.cache
def store_read_bps(store: Path) -> float | None:
    """The read bandwidth of the disk under ``store``, measured once per process on its largest file
    (O_DIRECT, 16 large reads in flight, as the engine reads); None when every file is too small to tell."""
    from robot_llm.llm.store.diskio import measure_read_bandwidth

    files = [p for p in Path(store).iterdir() if p.is_file()]
    largest = max(files, key=lambda p: p.stat().st_size, default=None)
    if largest is None or largest.stat().st_size < PROBE_MIN_BYTES:
        return None
    bps = measure_read_bandwidth(largest, max_bytes=PROBE_MAX_BYTES)
    log.info("disk under %s reads %.2f GB/s (measured on %s)", store, bps / 1e9, largest.name)
    return bps


def night_machine(settings: ModelSettings, *, probe_gpu: bool = True) -> tuple[Machine, dict[str, str]]:
    """This machine as the settings let the run use it (device, GPU budget, threads), with its rates measured,
    and where each rate came from (:func:`robot_llm.llm.plan.rates.measure_rates`).

    Its GPU memory is what this process can use (free plus what its torch holds,
    :func:`robot_llm.llm.plan.machine.cuda_usable_bytes`), capped by ``gpu_memory_budget_bytes``; the planner's
    headroom applies to that once. Device ``cpu`` never touches CUDA; a GPU that cannot be asked raises
    :class:`robot_llm.llm.plan.machine.GPUError`. A stream run's disk rate is measured under its store
    (:func:`store_read_bps`); the CPU's GEMM and RAM read rates at the threads the night computes with, and a
    GPU's copy and GEMM rates where it uses one, unless ``probe_gpu`` is off (``doctor``: its ~320 MiB could
    push a running night out of GPU memory), then they are assumed. Every probe runs once per process.
    """
    store = settings.store if settings.backend == "stream" and settings.home != "ram" else None
    disk = store_read_bps(store) if store is not None else None
    machine = detect_machine(disk, gpu=settings.device != "cpu")
    if settings.gpu_memory_budget_bytes is not None and machine.has_gpu:
        machine = replace(machine, gpu_bytes=min(machine.gpu_bytes, settings.gpu_memory_budget_bytes))
    if settings.threads:
        machine = replace(machine, threads=settings.threads)
    machine, sources = measure_rates(machine, probe_gpu=probe_gpu)
    if not probe_gpu and machine.has_gpu:
        for field in ("h2d_bps", "gpu_flops"):
            sources[field] = GPU_RATES_ASSUMED
    if disk is not None:
        sources["disk_read_bps"] = "measured under the store"
    elif store is not None:
        sources["disk_read_bps"] = "assumed; the store's files are too small to measure"
    elif settings.backend == "stream" and settings.home == "ram":
        sources["disk_read_bps"] = "assumed; the weights are read once, into RAM"
    return machine, sources


def machine_for(settings: ModelSettings) -> Machine:
    """This machine as the settings let the run use it, its rates measured (:func:`night_machine`)."""
    return night_machine(settings)[0]


def night_work(settings: ModelSettings, config: ModelConfig) -> Work:
    """The worst batch of a night: ``max_batch_size`` prompts that fill the window with their thesis and stance."""
    window = min(settings.max_positions or config.max_position_embeddings, config.max_position_embeddings)
    new = min(settings.max_new_tokens, window - 1)
    stance = min(settings.stance_tokens, window - new - 1)
    return Work(settings.max_batch_size, window - new - stance, new, stance_tokens=stance)


def plan_run(
    settings: ModelSettings,
    config: ModelConfig,
    work: Work,
    weights: str | Manifest,
    machine: Machine | None = None,
) -> Plan:
    """The plan for ``work`` on this machine (``machine``: as :func:`machine_for` gives it) under the settings'
    budgets and pins (raises PlanError). ``weights``: the stored dtype, or a converted store's manifest, whose
    own bytes per layer and int8 share are planned (an int4 store of a GGUF file may keep some matrices int8)."""
    if isinstance(weights, str):
        weight_dtype, layer_sizes, int8_share = weights, None, 0.0
    else:
        weight_dtype, layer_sizes, int8_share = weights.dtype, weights.layer_bytes(), weights.int8_share()
    return plan(
        config,
        work,
        machine or machine_for(settings),
        weight_dtype=weight_dtype,
        compute_dtype=None if settings.dtype in ("auto", "int8", "int4") else settings.dtype,
        max_batch_size=settings.max_batch_size,
        memory_budget_bytes=settings.memory_budget_bytes,
        weight_home=None if settings.home == "auto" else settings.home,
        kv_dtype=settings.kv_dtype,
        layer_sizes=layer_sizes,
        int8_share=int8_share,
    )


def set_threads(threads: int) -> None:
    """Compute with ``threads`` intra-op threads (the policy's, set once when the model opens)."""
    import torch

    if torch.get_num_threads() != threads:
        log.info("compute threads: %d", threads)
        torch.set_num_threads(threads)


def weights_config(settings: ModelSettings, manifest: Manifest | None = None) -> ModelConfig:
    """The shape of the weights ``settings`` names: a store's manifest (``manifest``, when read already),
    ``config_file``, ``preset``, or the release folder's ``config.json`` (or one folder above)."""
    if manifest is not None:
        return manifest.config
    if settings.store is not None:
        from robot_llm.llm.store.reader import read_manifest

        return read_manifest(settings.store).config
    # YaLM's module (its config beside its forward pass) imports torch: only a release needs it here.
    from robot_llm.llm.families.yalm import YalmConfig

    if settings.preset is not None:
        try:
            return YalmConfig.preset(settings.preset)
        except ValueError as exc:
            raise RobotLLMError(f"preset: {exc}") from None
    assert settings.checkpoint is not None
    candidates = [settings.config_file] if settings.config_file is not None else []
    candidates += [settings.checkpoint / "config.json", settings.checkpoint.parent / "config.json"]
    for path in candidates:
        if path.is_file():
            try:
                return YalmConfig.from_json(path)
            except (ValueError, TypeError) as exc:
                raise RobotLLMError(f"{path}: {exc}") from exc
    tried = ", ".join(map(str, candidates))
    raise RobotLLMError(f"no model config (tried {tried}): set preset (e.g. yalm-100b) or a config file")


def model_id(config: ModelConfig, weights: Path, weights_dtype: str) -> str:
    """``<preset or yalm-custom>/<weights dtype>@<digest>``; the digest pins the exact weights when known."""
    from robot_llm.llm.families.yalm import PRESETS

    name = next((n for n, c in PRESETS.items() if c == config), f"{config.family}-custom")
    manifest = weights / "manifest.json"
    source = manifest.read_bytes() if manifest.is_file() else json.dumps(config.to_dict(), sort_keys=True).encode()
    return f"{name}/{weights_dtype}@{hashlib.sha256(source).hexdigest()[:12]}"


def open_store(settings: ModelSettings, config: ModelConfig, manifest: Manifest | None) -> tuple[Store, Path | None]:
    """The stream engine's store, and the temporary folder to delete with the model (None: kept).

    A release (no ``store``) is converted, fp16 or the int8/int4 ``dtype`` names, into
    ``offload_dir/store`` (kept for the next run) or, without ``offload_dir``, a temporary folder.
    """
    import tempfile

    from robot_llm.llm.store.reader import MANIFEST, Store
    from robot_llm.llm.store.writer import convert

    if settings.store is not None:
        return Store(settings.store, manifest), None
    assert settings.checkpoint is not None
    temporary = None
    if settings.offload_dir is not None:
        store_dir = settings.offload_dir / "store"
    else:
        store_dir = temporary = Path(tempfile.mkdtemp(prefix="robot-llm-store-"))
    if not (store_dir / MANIFEST).is_file():
        store_dtype = settings.dtype if settings.dtype in ("int8", "int4") else "fp16"
        log.info("converting %s into the %s store %s", settings.checkpoint, store_dtype, store_dir)
        convert(settings.checkpoint, store_dir, dtype=store_dtype, config=config, trust_pickle=settings.trust_pickle)
    return Store(store_dir), temporary


def decide_policy(settings: ModelSettings, config: ModelConfig, manifest: Manifest | None) -> Policy:
    """The policy the model opens with: for the stream engine the night's plan (:func:`night_work`, refused
    with PlanError when it cannot fit; ``manifest``: its store's); for the others the device, the compute
    dtype (``auto``: the family's on a GPU, bf16 on a CPU that has it natively, else fp32) and the threads."""
    if settings.backend == "stream":
        assert manifest is not None
        night = plan_run(settings, config, night_work(settings, config), manifest)
        log.info("the night's plan:\n%s", night.describe())
        return Policy.from_plan(night, settings.micro_batch)
    machine = machine_for(settings)
    device = settings.device if settings.device != "auto" else "cuda" if machine.has_gpu else "cpu"
    dtype = settings.dtype
    if dtype == "auto":
        dtype = (
            gpu_compute_dtype(config, machine.gpu_bf16)
            if device == "cuda"
            else auto_compute_dtype(replace(machine, gpu_bytes=0), config)
        )
    elif device == "cuda":
        warn_gpu_dtype(config, dtype)
    home = "disk" if settings.backend == "deepspeed" and settings.offload == "nvme" else "ram"
    return Policy(
        device=device,
        compute_dtype=dtype,
        weight_home=home,
        threads=machine.compute_threads,
        micro_batch=settings.micro_batch,
    )


def plan_task(settings: ModelSettings, config: ModelConfig, policy: Policy, work: Work, manifest: Manifest) -> Task:
    """One stream job's task, planned for its real work on the engine as the policy placed it (PlanError:
    it cannot fit, before any token). Its threads are the policy's, at which the night's rates were measured,
    not the cores free this minute (which would measure again and time a thread count nothing uses)."""
    pinned = replace(
        settings,
        home=policy.weight_home,
        dtype=policy.compute_dtype,
        kv_dtype=policy.kv_dtype or policy.compute_dtype,
        threads=policy.threads,
    )
    job = plan_run(pinned, config, work, manifest)
    micro = min(job.micro_batch, policy.micro_batch or job.micro_batch)
    log.info("plan: batch %d, micro-batch %d, KV on %s", job.batch_size, micro, job.kv_home)
    return Task(job.batch_size, micro, job.kv_home, job.attention_home)
