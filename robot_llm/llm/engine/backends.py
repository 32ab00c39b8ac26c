"""The model backends: which families each serves (:func:`refusal`) and the engine each builds (:func:`build_engine`).

``memory`` holds the whole model in RAM/VRAM (:mod:`robot_llm.llm.engine.memory`); ``stream`` streams layers
from a weight store (:mod:`robot_llm.llm.engine.streaming`); ``deepspeed`` offloads under ZeRO-3
(:mod:`robot_llm.llm.engine.deepspeed`). :func:`build_engine` is the only place an engine is constructed
(the door, :meth:`robot_llm.llm.model.Model.open`, calls it); each engine module, and torch with it,
is imported only when chosen.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from robot_llm.errors import BackendError

if TYPE_CHECKING:
    from robot_llm.llm.engine.policy import Policy
    from robot_llm.llm.engine.runtime import ModelSettings
    from robot_llm.llm.families.config import ModelConfig
    from robot_llm.llm.store.reader import Store

#: The backends, in the order the command line lists them.
BACKENDS: tuple[str, ...] = ("memory", "stream", "deepspeed")

#: The model families each backend computes; None: every family of the registry
#: (:mod:`robot_llm.llm.families.registry`). The stream engine runs any family's forward; the memory
#: backend loads a YaLM release folder and DeepSpeed wraps YaLM's own layer modules.
SERVES: dict[str, tuple[str, ...] | None] = {"memory": ("yalm",), "stream": None, "deepspeed": ("yalm",)}


def refusal(backend: str, family: str) -> str | None:
    """Why ``backend`` cannot run a model of ``family`` (one line), or None when it can."""
    served = SERVES.get(backend)
    if served is None or family in served:
        return None
    others = [name for name, fams in SERVES.items() if fams is None or family in fams]
    runs = ", ".join(served)
    return f"the {backend} backend runs {runs} models only, not {family}: use backend {' or '.join(others)}"


def build_engine(settings: ModelSettings, config: ModelConfig, policy: Policy, store: Store | None) -> Any:
    """The engine of ``settings.backend`` placed as ``policy`` says (``store``: the stream engine's)."""
    if settings.backend == "stream":
        from robot_llm.llm.engine.stream_slots import trim_heap
        from robot_llm.llm.engine.streaming import StreamingModel

        assert store is not None
        engine = StreamingModel(
            store,
            home="ram" if policy.weight_home == "ram" else "disk",
            ram_layers=policy.ram_layers if policy.weight_home == "split" else 0,
            device=policy.device,
            dtype=policy.compute_dtype,
            kv_home=policy.kv_home,
            attention_home=policy.attention_home,
            micro_batch=policy.micro_batch,
            kv_dtype=policy.kv_dtype,
            read_depth=policy.read_depth,
        )
        trim_heap()  # the conversions' temporaries, before the night's KV cache lands beside them
        return engine
    source = settings.store or settings.checkpoint
    assert source is not None
    if settings.backend == "deepspeed":
        try:
            from robot_llm.llm.engine.deepspeed import DeepSpeedModel
        except ModuleNotFoundError as exc:
            if exc.name != "deepspeed":
                raise
            raise BackendError("engine 'deepspeed' is not available in this installation") from exc
        return DeepSpeedModel(
            source,
            config,
            offload=settings.offload,
            dtype=policy.compute_dtype,
            offload_dir=settings.offload_dir,
            trust_pickle=settings.trust_pickle,
        )
    from robot_llm.llm.engine.memory import Yalm

    return Yalm.from_release(
        str(Path(source)), config, dtype=policy.compute_dtype, device=policy.device, trust_pickle=settings.trust_pickle
    )
