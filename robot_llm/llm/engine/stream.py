"""The ``stream`` backend: :class:`robot_llm.llm.engine.streaming.StreamingModel` over a weight store.

``request.checkpoint`` is a store folder (with ``manifest.json``) or a release
folder; a release is first converted into a temporary store (fp16, or int8 /
int4 when ``request.dtype`` names one) that is deleted with the model.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path

from robot_llm.llm.engine.request import BackendError, ModelRequest
from robot_llm.llm.engine.streaming import StreamingModel
from robot_llm.llm.store.reader import MANIFEST, QUANTIZED, Store
from robot_llm.llm.store.writer import convert


def open_store(checkpoint: Path, request: ModelRequest, store_dtype: str, work_dir: Path | None = None) -> Store:
    """The store at ``checkpoint``, or a fresh one converted from the release folder ``checkpoint``.

    A converted store lives in ``work_dir`` when given (kept), else in a temporary folder.
    """
    if (checkpoint / MANIFEST).is_file():
        return Store(checkpoint)
    target = work_dir if work_dir is not None else Path(tempfile.mkdtemp(prefix="robot-llm-store-"))
    convert(checkpoint, target, dtype=store_dtype, config=request.config, trust_pickle=request.trust_pickle)
    return Store(target)


def create(request: ModelRequest) -> StreamingModel:
    """Stream the model from a store; ``--dtype int8|int4`` means such a store computed in the default dtype."""
    if request.offload is not None:
        raise BackendError("--offload applies to the deepspeed engine; the stream engine takes --home disk|ram")
    quantized = request.dtype in QUANTIZED
    store_dtype = request.dtype if quantized else "fp16"
    compute = None if quantized else request.dtype
    temporary = not (request.checkpoint / MANIFEST).is_file()
    store = open_store(request.checkpoint, request, store_dtype)
    model = StreamingModel(store, home=request.home or "disk", device=request.device, dtype=compute)
    if temporary:
        weakref.finalize(model, shutil.rmtree, store.path, True)
    return model
