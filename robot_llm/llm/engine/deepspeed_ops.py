"""DeepSpeed's C++ ops, compiled on first use when the install did not prebuild them.

``scripts/install.sh`` installs DeepSpeed as Python only unless given ``--deepspeed-ops``
(compiling them takes 4 to 13 minutes on 2 cores, which a first run of the demo should not
pay: the demo never uses DeepSpeed). DeepSpeed then compiles an op the first time it loads
it, silently, inside ``init_distributed`` or the NVMe swapper. :func:`prepare_ops` does that
load up front, so a night that starts with a compile says so, and how long it took; torch
caches the result, so it happens once per machine.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

__all__ = ["prepare_ops"]


def _cached(name: str) -> bool:
    """Whether torch's extension cache already holds a JIT build of op ``name``."""
    from torch.utils.cpp_extension import _get_build_directory

    return (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").is_file()


def needed_builders(offload: Literal["cpu", "nvme"]) -> list[Any]:
    """The op builders a run with ``offload`` loads: shared-memory comm, and async I/O for NVMe."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    names = ["ShareMemCommBuilder"] + (["AsyncIOBuilder"] if offload == "nvme" else [])
    return [b for b in (accel.create_op_builder(n) for n in names) if b is not None]


def prepare_ops(offload: Literal["cpu", "nvme"]) -> None:
    """Load (compiling if need be) the ops this run needs, logging a compile and its duration."""
    import deepspeed.ops
    from deepspeed.git_version_info import installed_ops

    for builder in needed_builders(offload):
        name = builder.NAME
        if installed_ops.get(name) or not deepspeed.ops.__compatible_ops__.get(name, False):
            continue  # prebuilt, or not buildable here (DeepSpeed then goes without it and says why)
        if _cached(name):
            builder.load(verbose=False)
            continue
        log.warning(
            "DeepSpeed's %s op was not compiled at install time: compiling it now, once "
            "(several minutes on 2 cores; `scripts/install.sh --deepspeed-ops` does it at install)",
            name,
        )
        started = time.monotonic()
        builder.load(verbose=False)
        log.warning("compiled DeepSpeed's %s op in %.0f s (cached for the next runs)", name, time.monotonic() - started)
