"""How an open model runs (:class:`Policy`, fixed at the door) and how one job runs on it (:class:`Task`).

FlexGen's split: the *policy* (device, compute dtype, weight home, RAM layers, KV dtype and home,
attention home, threads, micro-batch cap, read depth) is decided once when the model opens, by the
planner (:func:`robot_llm.llm.engine.runtime.plan_run`) or given explicitly (a benchmark, a test),
and never changes while the model is open. A *task* (batch size, this job's prefill micro-batch and
KV placement) is planned per ``generate``/``score`` call for its real work and passed into the
engine's calls (:class:`TaskView`), never written into the engine: two jobs cannot leak into each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from robot_llm.llm.store.diskio import DEFAULT_DEPTH

if TYPE_CHECKING:
    from torch import Tensor

    from robot_llm.llm.engine.kv_cache import KVCache
    from robot_llm.llm.plan.planner import Plan

WeightHome = Literal["disk", "ram", "split"]
KVHome = Literal["device", "cpu"]
AttentionHome = Literal["compute", "kv"]


@dataclass(frozen=True)
class Policy:
    """The placement an open model keeps (frozen: nothing rewrites it per job).

    * ``device``: ``cpu`` or ``cuda``; ``compute_dtype``: ``fp32``/``bf16``/``fp16``.
    * ``weight_home``: where the stream engine keeps layers (``disk``; ``ram``; ``split``: the first
      ``ram_layers`` in RAM, the rest on disk). The memory backend holds everything (``ram``); DeepSpeed
      offloads to ``ram`` (its ``cpu``) or ``disk`` (``nvme``).
    * ``kv_dtype``: ``int8``/``int4`` (compressed, :mod:`robot_llm.llm.engine.kvquant`), a float dtype other
      than the compute dtype (``bf16`` under fp32 compute on the CPU), or None (the compute dtype);
      ``kv_home`` and ``attention_home``: the night's worst case, a job's own plan may do better.
    * ``threads``: intra-op compute threads, set once at open.
    * ``micro_batch``: the most rows of one prefill pass, a cap on every job's planned micro-batch (None:
      each job's plan decides alone; an engine called directly, outside a job, then does not split).
    * ``read_depth``: large reads of one layer in flight (:mod:`robot_llm.llm.store.diskio`).
    """

    device: Literal["cpu", "cuda"]
    compute_dtype: str
    weight_home: WeightHome = "ram"
    ram_layers: int = 0
    kv_dtype: str | None = None
    kv_home: KVHome = "device"
    attention_home: AttentionHome = "compute"
    threads: int = 1
    micro_batch: int | None = None
    read_depth: int = DEFAULT_DEPTH

    @classmethod
    def from_plan(cls, plan: Plan, micro_batch: int | None = None) -> Policy:
        """The policy a night's plan decides; ``micro_batch``: the user's cap (a pin lowers a job's planned
        micro-batch, never raises it)."""
        return cls(
            device=plan.device,
            compute_dtype=plan.compute_dtype,
            weight_home=plan.weight_home,
            ram_layers=plan.ram_layers if plan.weight_home == "split" else 0,
            kv_dtype=plan.kv_dtype if plan.kv_dtype != plan.compute_dtype else None,
            kv_home=plan.kv_home,
            attention_home=plan.attention_home,
            threads=plan.threads,
            micro_batch=micro_batch,
        )


@dataclass(frozen=True)
class Task:
    """One ``generate``/``score`` job's values, planned for its real work and passed to every engine call."""

    batch_size: int
    micro_batch: int | None = None
    kv_home: KVHome | None = None
    attention_home: AttentionHome | None = None


class TaskView:
    """The stream engine as one job runs it: the task's values (and its liveness callback) go into every
    ``new_cache`` and ``forward`` call; the engine itself is not changed. Implements ``ForwardModel``."""

    def __init__(self, engine: Any, task: Task, on_layer: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.task = task
        self.on_layer = on_layer
        self.config = engine.config
        self.dtype = engine.dtype

    def new_cache(self, batch: int, max_len: int, pad: Tensor | None = None) -> KVCache:
        """An empty cache where this job's plan puts it."""
        return self.engine.new_cache(batch, max_len, pad, self.task)

    def forward(
        self,
        ids: Tensor,
        cache: KVCache | None = None,
        pad: Tensor | None = None,
        *,
        last_only: bool = False,
        select: Tensor | None = None,
    ) -> Tensor:
        """The engine's forward pass with this job's micro-batch and liveness callback."""
        return self.engine.forward(
            ids, cache, pad, last_only=last_only, select=select, task=self.task, on_layer=self.on_layer
        )

    __call__ = forward

    @property
    def last_hidden(self) -> Tensor | None:
        """The engine's last pass's pre-head hidden states (a stance head reads them: scoring.tree_hidden)."""
        return self.engine.last_hidden

    def first_nonfinite(self) -> str:
        """Where the engine's last pass first went non-finite."""
        return self.engine.first_nonfinite()
