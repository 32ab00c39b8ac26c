"""One entry point for the nightly batch: :func:`open_model` -> :class:`LoadedModel`.

:class:`ModelSettings` says which engine runs the model (``memory``,
``stream`` or ``deepspeed``), where the weights are and how much memory the
run may take; :class:`LoadedModel` generates and scores through
:mod:`robot_llm.llm.generate`.

The plan is the run. Opening the stream engine plans the night
(:func:`plan_run`, :mod:`robot_llm.llm.plan.planner`): the weight home (disk, RAM
or split across both), the compute dtype (bf16 on a CPU that has it natively,
never fp16 on a CPU), the KV home and the intra-op threads come from the plan,
within ``memory_budget_bytes`` and ``gpu_memory_budget_bytes``; every setting
that is not ``auto`` pins its choice. Every :meth:`LoadedModel.generate` and
:meth:`LoadedModel.score` call is then planned for its real work: the batch size
and prefill micro-batch come from that plan, and a job that cannot fit is
refused before any token is computed. ``robot-llm doctor`` prints the same plan.
The plan's rates are this machine's, measured once per process (:func:`night_machine`):
the disk under the store, the CPU's GEMM and RAM read rates at the night's threads,
and a GPU's copy and GEMM rates.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from robot_llm.errors import RobotLLMError
from robot_llm.llm.families.config import PRESETS, ModelConfig, YalmConfig
from robot_llm.llm.plan.machine import Machine, detect_machine
from robot_llm.llm.plan.planner import Plan, Work, auto_compute_dtype, gpu_compute_dtype, plan, warn_gpu_dtype
from robot_llm.llm.plan.rates import measure_rates

if TYPE_CHECKING:
    from robot_llm.llm.generate import Completion, SamplingParams
    from robot_llm.llm.scoring import Followup
    from robot_llm.llm.store.reader import Manifest
    from robot_llm.llm.tokenizer import Tokenizer

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
    * ``preset``: model config name when the release folder has no ``config.json``.
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


class LoadedModel:
    """An open model: tokenizer, engine, and generation/scoring with planned batch sizes."""

    def __init__(
        self, settings: ModelSettings, model: object, config: ModelConfig, model_id: str, tokenizer: Tokenizer | None
    ) -> None:
        from robot_llm.llm.tokenizer import load_tokenizer

        self.settings = settings
        self.model = model
        self.config = config
        self.model_id = model_id
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(settings.vocab)

    def generate(
        self,
        prompts: Sequence[str],
        params: SamplingParams | Sequence[SamplingParams],
        on_progress: Callable[[int, int], None] | None = None,
        on_step: Callable[[], None] | None = None,
        followups: Sequence[Followup | None] | None = None,
    ) -> list[Completion]:
        """Continue ``prompts`` (one ``SamplingParams`` or one per prompt); see :func:`generate.generate`.

        ``on_step`` is called after every forward pass and, with the stream engine, after
        every layer of it too (one pass of a big batch can outlast the watchdog's patience).
        """
        from robot_llm.llm.engine.streaming import StreamingModel
        from robot_llm.llm.generate import SamplingParams, generate, shared_prefix_length
        from robot_llm.llm.scoring import followup_slots

        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        encoded = [self.tokenizer.encode(p) for p in prompts]
        prompt_tokens = max((len(ids) for ids in encoded), default=1)
        new_tokens = max((p.max_new_tokens for p in per_prompt), default=0)
        # The step that scores followups from the cache takes a few slots more per row.
        extra = max((followup_slots(self.tokenizer, f) for f in followups or ()), default=0)
        # Every batch shares at least the head all the prompts share (a batch of one template shares more).
        shared = shared_prefix_length(encoded) if len(encoded) > 1 else 0
        shared = shared if shared >= SHARE_PREFIX_MIN else 0
        refill = self.settings.refill_slots
        batch = self._prepare(len(prompts), prompt_tokens, new_tokens + extra + refill, shared)
        streaming = isinstance(self.model, StreamingModel)
        if streaming:
            self.model.on_layer = on_step
        try:
            return generate(
                self.model,
                self.tokenizer,
                prompts,
                params,
                batch_size=batch,
                on_progress=on_progress,
                on_step=on_step,
                followups=followups,
                share_prefix=SHARE_PREFIX_MIN,
                refill_slots=refill,
            )
        finally:
            if streaming:
                self.model.on_layer = None

    def score(self, prompt: str, continuations: Sequence[str]) -> list[float]:
        """Sum of log-probabilities of each continuation after ``prompt``."""
        return [float(sum(p)) for p in self.score_pieces(prompt, continuations)]

    def score_pieces(self, prompt: str, continuations: Sequence[str]) -> list[list[float]]:
        """Log-probability of every token of each continuation after ``prompt`` (a re-prefill)."""
        from robot_llm.llm.scoring import score_pieces

        longest = max((len(self.tokenizer.encode(prompt + c)) for c in continuations), default=1)
        batch = self._prepare(len(continuations), longest, 0)
        return score_pieces(self.model, self.tokenizer, prompt, continuations, batch_size=batch)

    def _prepare(self, count: int, prompt_tokens: int, new_tokens: int, shared: int = 0) -> int:
        """Batch size for this job: with the stream engine, planned for the engine as it is (or refused)."""
        import torch

        from robot_llm.llm.engine.streaming import StreamingModel

        model = self.model
        if not isinstance(model, StreamingModel) or count == 0:
            return self.settings.max_batch_size
        home = "ram" if model.home == "ram" else "split" if model.ram_layers else "disk"
        kv_dtype = model.kv_dtype or _dtype_name(model.dtype)
        # Planned for the engine as it runs: its threads too (the ones the night's rates were measured at,
        # not the cores free this minute, which would measure again and time a thread count nothing uses).
        settings = replace(
            self.settings,
            home=home,
            dtype=_dtype_name(model.dtype),
            kv_dtype=kv_dtype,
            threads=torch.get_num_threads(),
        )
        work = Work(count, prompt_tokens, new_tokens, shared)
        job = plan_run(settings, self.config, work, model.store.manifest)
        model.micro_batch = min(job.micro_batch, self.settings.micro_batch or job.micro_batch)
        model.kv_device = model.device if job.kv_home == "device" else torch.device("cpu")
        model.attention_home = job.attention_home
        log.info("plan: batch %d, micro-batch %d, KV on %s", job.batch_size, job.micro_batch, job.kv_home)
        return job.batch_size

    def close(self) -> None:
        """Stop background work and free the engine's resources."""
        close = getattr(self.model, "close", None)
        if close is not None:
            close()


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


def _set_threads(threads: int) -> None:
    import torch

    if torch.get_num_threads() != threads:
        log.info("compute threads: %d", threads)
        torch.set_num_threads(threads)


def _dtype_name(dtype: object) -> str:
    return {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16"}[str(dtype)]


def _config(settings: ModelSettings, manifest: Manifest | None) -> ModelConfig:
    if manifest is not None:
        return manifest.config
    if settings.store is not None:
        from robot_llm.llm.store.reader import read_manifest

        return read_manifest(settings.store).config
    if settings.preset is not None:
        return YalmConfig.preset(settings.preset)
    assert settings.checkpoint is not None
    for path in (settings.checkpoint / "config.json", settings.checkpoint.parent / "config.json"):
        if path.is_file():
            return YalmConfig.from_json(path)
    raise RobotLLMError(f"{settings.checkpoint} has no config.json; set preset (e.g. yalm-100b)")


def _model_id(config: ModelConfig, weights: Path, weights_dtype: str) -> str:
    """``<preset or yalm-custom>/<weights dtype>@<digest>``; the digest pins the exact weights when known."""
    name = next((n for n, c in PRESETS.items() if c == config), f"{config.family}-custom")
    manifest = weights / "manifest.json"
    source = manifest.read_bytes() if manifest.is_file() else json.dumps(config.to_dict(), sort_keys=True).encode()
    return f"{name}/{weights_dtype}@{hashlib.sha256(source).hexdigest()[:12]}"


def open_model(
    settings: ModelSettings, manifest: Manifest | None = None, tokenizer: Tokenizer | None = None
) -> LoadedModel:
    """Open the model described by ``settings`` (refuses a stream run whose weights cannot fit).

    ``manifest`` (``settings.store``'s) and ``tokenizer`` (``settings.vocab``'s): when the caller has
    them already (a night derives them once); otherwise they are read here.
    """
    from robot_llm.llm.engine.backends import create_model, refusal
    from robot_llm.llm.engine.request import BackendError, ModelRequest

    if settings.store is None:
        manifest = None
    config = _config(settings, manifest)
    reason = refusal(settings.backend, config.family)
    if reason is not None:
        raise BackendError(reason)
    device = settings.device
    if settings.backend == "stream":
        return _open_stream(settings, config, manifest, tokenizer)

    assert settings.checkpoint is not None or settings.store is not None
    source = settings.store or settings.checkpoint
    assert source is not None
    machine = machine_for(settings)
    if device == "auto":
        device = "cuda" if machine.has_gpu else "cpu"
    dtype = settings.dtype
    if dtype == "auto":
        dtype = (
            gpu_compute_dtype(config, machine.gpu_bf16)
            if device == "cuda"
            else auto_compute_dtype(replace(machine, gpu_bytes=0), config)
        )
    elif device == "cuda":
        warn_gpu_dtype(config, dtype)
    _set_threads(machine.compute_threads)
    if settings.backend == "deepspeed":
        from robot_llm.llm.engine.deepspeed import DeepSpeedModel

        model: object = DeepSpeedModel(
            source, config, offload=settings.offload, dtype=dtype, offload_dir=settings.offload_dir
        )
    else:
        request = ModelRequest(checkpoint=source, config=config, dtype=dtype, device=device)
        model = create_model("memory", request)
    return LoadedModel(settings, model, config, _model_id(config, source, dtype), tokenizer)


def _open_stream(
    settings: ModelSettings, config: ModelConfig, manifest: Manifest | None, tokenizer: Tokenizer | None
) -> LoadedModel:
    from robot_llm.llm.engine.streaming import StreamingModel
    from robot_llm.llm.store.reader import MANIFEST, Store
    from robot_llm.llm.store.writer import convert

    store_dir = settings.store
    if store_dir is None:
        assert settings.checkpoint is not None
        if settings.offload_dir is None:
            raise RobotLLMError("the stream engine needs a store; set store, or offload_dir to convert into")
        store_dir = settings.offload_dir / "store"
        if not (store_dir / MANIFEST).is_file():
            log.info("converting %s into the store %s", settings.checkpoint, store_dir)
            convert(settings.checkpoint, store_dir, dtype="fp16", config=config)
    store = Store(store_dir, manifest if store_dir == settings.store else None)
    # Refuse now what cannot fit; otherwise open the engine exactly as planned.
    night = plan_run(settings, config, night_work(settings, config), store.manifest)
    log.info("the night's plan:\n%s", night.describe())
    _set_threads(night.threads)
    model = StreamingModel(
        store,
        home="ram" if night.weight_home == "ram" else "disk",
        ram_layers=night.ram_layers if night.weight_home == "split" else 0,
        device=night.device,
        dtype=night.compute_dtype,
        kv_home=night.kv_home,
        attention_home=night.attention_home,
        micro_batch=min(night.micro_batch, settings.micro_batch or night.micro_batch),
        kv_dtype=night.kv_dtype if night.kv_dtype in ("int8", "int4") else None,
    )
    return LoadedModel(settings, model, config, _model_id(config, store.path, store.manifest.dtype), tokenizer)
