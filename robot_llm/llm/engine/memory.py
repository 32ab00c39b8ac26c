"""The ``memory`` backend: the whole model in memory (:class:`robot_llm.llm.families.yalm.Yalm`)."""

from __future__ import annotations

from robot_llm.llm.engine.backends import BackendError, ModelRequest
from robot_llm.llm.families.family import DTYPES
from robot_llm.llm.families.yalm import Yalm


def create(request: ModelRequest) -> Yalm:
    """Load a release checkpoint folder into a :class:`Yalm` on ``request.device``."""
    if request.home is not None or request.offload is not None:
        raise BackendError("--home and --offload apply to the stream and deepspeed engines, not to 'memory'")
    if request.dtype not in DTYPES:
        raise BackendError(f"the memory engine computes in {', '.join(DTYPES)}, not {request.dtype!r}")
    return Yalm.from_release(
        str(request.checkpoint),
        request.config,
        dtype=request.dtype,
        device=request.device,
        trust_pickle=request.trust_pickle,
    )
