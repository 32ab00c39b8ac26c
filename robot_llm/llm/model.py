"""The one door to a model: :meth:`Model.open` (llama's ``Llama.build()``), then ``generate``/``score``.

Everything that runs a model comes through here: the night (:func:`robot_llm.night.model.open_configured_model`
builds its :class:`~robot_llm.llm.engine.runtime.ModelSettings` from the config), ``robot-llm model
generate`` / ``check-fixture`` (from their flags), the reference check, the benchmarks and the tests.
The door decides the :class:`~robot_llm.llm.engine.policy.Policy` once (the planner's, or one given),
builds the engine (:func:`robot_llm.llm.engine.backends.build_engine`: ``StreamingModel``, the memory
backend's ``Yalm`` or ``DeepSpeedModel``) and keeps both fixed; each job's
:class:`~robot_llm.llm.engine.policy.Task` is planned per call and passed down. Torch is imported
only when a model opens.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from robot_llm.errors import BackendError
from robot_llm.llm.engine.backends import build_engine, refusal
from robot_llm.llm.engine.policy import Policy, Task, TaskView
from robot_llm.llm.engine.runtime import (
    SHARE_PREFIX_MIN,
    ModelSettings,
    decide_policy,
    model_id,
    open_store,
    plan_task,
    set_threads,
    weights_config,
)
from robot_llm.llm.families.config import ModelConfig
from robot_llm.llm.plan.planner import Work

if TYPE_CHECKING:
    from robot_llm.llm.generate import Completion, SamplingParams
    from robot_llm.llm.scoring import Followup
    from robot_llm.llm.store.reader import Manifest, Store
    from robot_llm.llm.tokenizer import Tokenizer

__all__ = ["Model", "ModelSettings", "Policy"]


class Model:
    """An open model: its settings, its fixed policy, the engine, the tokenizer; generation and scoring.

    Made by :meth:`open` only. ``engine`` is the ``ForwardModel`` behind it (for a caller that runs
    forward passes itself: the fixture and reference checks, the benchmarks).
    """

    def __init__(
        self,
        settings: ModelSettings,
        policy: Policy,
        config: ModelConfig,
        engine: Any,
        tokenizer: Tokenizer | None,
        model_id: str,
        store: Store | None,
        temporary: Path | None,
    ) -> None:
        self.settings = settings
        self.policy = policy
        self.config = config
        self.engine = engine
        self._tokenizer = tokenizer
        self._id = model_id
        self._store = store
        self._temporary = temporary

    @classmethod
    def open(
        cls,
        settings: ModelSettings,
        policy: Policy | None = None,
        *,
        manifest: Manifest | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> Model:
        """Open the model ``settings`` describe, placed as ``policy`` says (None: as the planner decides,
        refusing a stream run that cannot fit: PlanError). A backend that cannot serve the weights' family
        is refused before anything loads (BackendError). ``manifest`` (``settings.store``'s) and
        ``tokenizer`` (``settings.vocab``'s): when the caller has them already (a night derives them once)."""
        manifest = manifest if settings.store is not None else None
        config = weights_config(settings, manifest)
        reason = refusal(settings.backend, config.family)
        if reason is not None:
            raise BackendError(reason)
        store, temporary = open_store(settings, config, manifest) if settings.backend == "stream" else (None, None)
        try:
            policy = policy or decide_policy(settings, config, store.manifest if store is not None else None)
            set_threads(policy.threads)
            engine = build_engine(settings, config, policy, store)
        except BaseException:
            if temporary is not None:
                shutil.rmtree(temporary, ignore_errors=True)
            raise
        if store is not None:
            ident = model_id(config, store.path, store.manifest.dtype)
        else:
            ident = model_id(config, Path(settings.store or settings.checkpoint or "."), policy.compute_dtype)
        return cls(settings, policy, config, engine, tokenizer, ident, store, temporary)

    @property
    def tokenizer(self) -> Tokenizer:
        """``settings.vocab``'s tokenizer (built on first use: a caller of the engine alone never needs it)."""
        if self._tokenizer is None:
            from robot_llm.llm.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.settings.vocab)
        return self._tokenizer

    @property
    def model_id(self) -> str:
        """The runtime's id, which pins the exact weights (``yalm-100b/fp16@3f2a9c1b7d0e``), after the user's
        name when the settings give one (``yalm-100b:yalm-100b/fp16@3f2a9c1b7d0e``)."""
        return f"{self.settings.name}:{self._id}" if self.settings.name else self._id

    @property
    def max_positions(self) -> int:
        """The longest context a request may use: the settings' window within the model's."""
        window = self.config.max_position_embeddings
        return min(self.settings.max_positions or window, window)

    def generate(
        self,
        prompts: Sequence[str],
        params: SamplingParams | Sequence[SamplingParams],
        on_progress: Callable[[int, int], None] | None = None,
        followups: Sequence[Followup | None] | None = None,
        *,
        on_step: Callable[[], None] | None = None,
    ) -> list[Completion]:
        """Continue ``prompts`` (one ``SamplingParams`` or one per prompt); see :func:`generate.generate`.

        ``on_progress(done, total)`` after every batch; ``on_step`` after every forward pass and, with the stream
        engine, every layer of it (one pass of a big batch can outlast the watchdog's patience). Given only
        ``on_progress``, every step reports the progress again: that is the night's liveness.
        """
        from robot_llm.llm.generate import SamplingParams, generate, shared_prefix_length
        from robot_llm.llm.scoring import followup_slots

        if on_progress is not None and on_step is None:
            done = [0]
            report = on_progress

            def batch_done(finished: int, total: int) -> None:
                done[0] = finished
                report(finished, total)

            on_progress, on_step = batch_done, lambda: report(done[0], len(prompts))
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
        task = self._task(len(prompts), prompt_tokens, new_tokens + extra + refill, shared)
        return generate(
            self._engine_for(task, on_step),
            self.tokenizer,
            prompts,
            params,
            batch_size=task.batch_size,
            on_progress=on_progress,
            on_step=on_step,
            followups=followups,
            share_prefix=SHARE_PREFIX_MIN,
            refill_slots=refill,
        )

    def score(self, prompt: str, continuations: Sequence[str]) -> list[float]:
        """Sum of log-probabilities of each continuation after ``prompt``."""
        return [float(sum(p)) for p in self.score_pieces(prompt, continuations)]

    def score_pieces(self, prompt: str, continuations: Sequence[str]) -> list[list[float]]:
        """Log-probability of every token of each continuation after ``prompt`` (a re-prefill)."""
        from robot_llm.llm.scoring import score_pieces

        longest = max((len(self.tokenizer.encode(prompt + c)) for c in continuations), default=1)
        task = self._task(len(continuations), longest, 0)
        engine = self._engine_for(task, None)
        return score_pieces(engine, self.tokenizer, prompt, list(continuations), batch_size=task.batch_size)

    def _task(self, count: int, prompt_tokens: int, new_tokens: int, shared: int = 0) -> Task:
        """This job's task: planned for the stream engine as the policy placed it (or refused)."""
        if self._store is None or count == 0:
            return Task(self.settings.max_batch_size, self.policy.micro_batch)
        work = Work(count, prompt_tokens, new_tokens, shared)
        return plan_task(self.settings, self.config, self.policy, work, self._store.manifest)

    def _engine_for(self, task: Task, on_step: Callable[[], None] | None) -> Any:
        """The engine with this job's task passed to each call (the stream engine); the others as they are."""
        return TaskView(self.engine, task, on_step) if self._store is not None else self.engine

    def close(self) -> None:
        """Stop background work, free the engine's resources and delete a store converted for this model."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None
