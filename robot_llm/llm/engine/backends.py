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


def release_freed_memory() -> bool:
    """Hand the memory this process has freed back to the OS (glibc's ``malloc_trim``); True where it could.

    Opening a quantized store on the CPU converts tables and layers through temporaries of tens of MB
    (the LM head, the rotated int8 matrices of :mod:`robot_llm.llm.store.int8act`); glibc keeps the freed
    ones below its mmap threshold in its heap, where the night's KV cache and activations then land beside
    them: peak RSS at batch 32 measured 1.36 GiB without this, against 1.20 GiB weight-only.
    """
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    return bool(ctypes.CDLL(None).malloc_trim(0))


def build_engine(settings: ModelSettings, config: ModelConfig, policy: Policy, store: Store | None) -> Any:
    """The engine of ``settings.backend`` placed as ``policy`` says (``store``: the stream engine's)."""
    if settings.backend == "stream":
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
        release_freed_memory()
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
