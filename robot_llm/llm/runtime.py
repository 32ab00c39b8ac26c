"""One entry point for the nightly batch: :func:`open_model` -> :class:`LoadedModel`.

:class:`ModelSettings` says which engine runs the model (``memory``,
``stream`` or ``deepspeed``), where the weights are and how much memory the
run may take; :class:`LoadedModel` generates and scores through
:mod:`robot_llm.llm.generate`. With the stream engine and a memory budget,
every :meth:`LoadedModel.generate` call is planned first
(:mod:`robot_llm.llm.planner`): the batch size, micro-batch and KV home come
from the plan, and a job that cannot fit is refused before any token is computed.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from robot_llm.errors import RobotLLMError
from robot_llm.llm.config import PRESETS, ModelConfig, YalmConfig

if TYPE_CHECKING:
    from robot_llm.llm.generate import Completion, Followup, SamplingParams

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
    * ``home``: where the stream engine keeps layers (``disk`` or ``ram``).
    * ``dtype``: compute dtype (``auto`` = fp16 on CUDA, fp32 on CPU).
    * ``device``: ``auto`` (CUDA if present), ``cpu`` or ``cuda``.
    * ``max_batch_size``: upper bound on prompts per batch.
    * ``memory_budget_bytes``: host RAM the run may use (stream engine: planned).
    * ``offload_dir``: DeepSpeed NVMe swap folder / converted store folder.
    * ``offload``: DeepSpeed parameter offload target, ``cpu`` or ``nvme``.
    * ``preset``: model config name when the release folder has no ``config.json``.
    """

    vocab: Path
    backend: Literal["memory", "stream", "deepspeed"] = "stream"
    checkpoint: Path | None = None
    store: Path | None = None
    home: Literal["disk", "ram"] = "disk"
    dtype: str = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_batch_size: int = 32
    memory_budget_bytes: int | None = None
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


class LoadedModel:
    """An open model: tokenizer, engine, and generation/scoring with planned batch sizes."""

    def __init__(self, settings: ModelSettings, model: object, config: ModelConfig, model_id: str) -> None:
        from robot_llm.llm.tokenizer import load_tokenizer

        self.settings = settings
        self.model = model
        self.config = config
        self.model_id = model_id
        self.tokenizer = load_tokenizer(settings.vocab)

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
        from robot_llm.llm.engine import StreamingModel
        from robot_llm.llm.generate import SamplingParams, followup_slots, generate, shared_prefix_length

        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        encoded = [self.tokenizer.encode(p) for p in prompts]
        prompt_tokens = max((len(ids) for ids in encoded), default=1)
        new_tokens = max((p.max_new_tokens for p in per_prompt), default=0)
        # The step that scores followups from the cache takes a few slots more per row.
        extra = max((followup_slots(self.tokenizer, f) for f in followups or ()), default=0)
        # Every batch shares at least the head all the prompts share (a batch of one template shares more).
        shared = shared_prefix_length(encoded) if len(encoded) > 1 else 0
        shared = shared if shared >= SHARE_PREFIX_MIN else 0
        batch = self._prepare(len(prompts), prompt_tokens, new_tokens + extra, shared)
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
            )
        finally:
            if streaming:
                self.model.on_layer = None

    def score(self, prompt: str, continuations: Sequence[str]) -> list[float]:
        """Sum of log-probabilities of each continuation after ``prompt``."""
        return [float(sum(p)) for p in self.score_pieces(prompt, continuations)]

    def score_pieces(self, prompt: str, continuations: Sequence[str]) -> list[list[float]]:
        """Log-probability of every token of each continuation after ``prompt`` (a re-prefill)."""
        from robot_llm.llm.generate import score_pieces

        longest = max((len(self.tokenizer.encode(prompt + c)) for c in continuations), default=1)
        batch = self._prepare(len(continuations), longest, 0)
        return score_pieces(self.model, self.tokenizer, prompt, continuations, batch_size=batch)

    def _prepare(self, count: int, prompt_tokens: int, new_tokens: int, shared: int = 0) -> int:
        """Batch size for this job; with the stream engine and a budget, plan it (or refuse it)."""
        import torch

        from robot_llm.llm.engine import StreamingModel

        model = self.model
        budget = self.settings.memory_budget_bytes
        if not isinstance(model, StreamingModel) or budget is None or count == 0:
            return self.settings.max_batch_size
        from robot_llm.llm.planner import Work, detect_machine, plan

        machine = detect_machine()
        job = plan(
            self.config,
            Work(count, prompt_tokens, new_tokens, shared),
            machine,
            weight_dtype=model.store.manifest.dtype,
            compute_dtype=_dtype_name(model.dtype),
            max_batch_size=self.settings.max_batch_size,
            memory_budget_bytes=budget,
            weight_home=model.home,
        )
        model.micro_batch = job.micro_batch
        model.kv_device = model.device if job.kv_home == "device" else torch.device("cpu")
        log.info("plan: batch %d, micro-batch %d, KV on %s", job.batch_size, job.micro_batch, job.kv_home)
        return job.batch_size

    def close(self) -> None:
        """Stop background work and free the engine's resources."""
        close = getattr(self.model, "close", None)
        if close is not None:
            close()


def _dtype_name(dtype: object) -> str:
    return {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16"}[str(dtype)]


def _config(settings: ModelSettings) -> ModelConfig:
    if settings.store is not None:
        from robot_llm.llm.store import read_manifest

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


def open_model(settings: ModelSettings) -> LoadedModel:
    """Open the model described by ``settings`` (refuses a stream run whose weights cannot fit)."""
    config = _config(settings)
    device = settings.device
    if settings.backend == "stream":
        return _open_stream(settings, config)
    from robot_llm.llm.backends import ModelRequest, create_model

    assert settings.checkpoint is not None or settings.store is not None
    source = settings.store or settings.checkpoint
    assert source is not None
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = settings.dtype if settings.dtype != "auto" else ("fp16" if device == "cuda" else "fp32")
    if settings.backend == "deepspeed":
        from robot_llm.llm.backends.deepspeed import DeepSpeedModel

        model: object = DeepSpeedModel(
            source, config, offload=settings.offload, dtype=dtype, offload_dir=settings.offload_dir
        )
    else:
        request = ModelRequest(checkpoint=source, config=config, dtype=dtype, device=device)
        model = create_model("memory", request)
    return LoadedModel(settings, model, config, _model_id(config, source, dtype))


def _open_stream(settings: ModelSettings, config: ModelConfig) -> LoadedModel:
    from robot_llm.llm.engine import StreamingModel
    from robot_llm.llm.planner import Work, detect_machine, plan
    from robot_llm.llm.store import MANIFEST, Store, convert

    store_dir = settings.store
    if store_dir is None:
        assert settings.checkpoint is not None
        if settings.offload_dir is None:
            raise RobotLLMError("the stream engine needs a store; set store, or offload_dir to convert into")
        store_dir = settings.offload_dir / "store"
        if not (store_dir / MANIFEST).is_file():
            log.info("converting %s into the store %s", settings.checkpoint, store_dir)
            convert(settings.checkpoint, store_dir, dtype="fp16", config=config)
    store = Store(store_dir)
    dtype = None if settings.dtype == "auto" else settings.dtype
    if settings.memory_budget_bytes is not None:
        # Refuse now a home that cannot hold even one short sequence.
        cuda = settings.device == "cuda" or (settings.device == "auto" and detect_machine().has_gpu)
        plan(
            config,
            Work(1, 1, 1),
            detect_machine(),
            weight_dtype=store.manifest.dtype,
            compute_dtype=dtype or ("fp16" if cuda else "fp32"),
            memory_budget_bytes=settings.memory_budget_bytes,
            weight_home=settings.home,
        )
    model = StreamingModel(store, home=settings.home, device=settings.device, dtype=dtype)
    return LoadedModel(settings, model, config, _model_id(config, store.path, store.manifest.dtype))
