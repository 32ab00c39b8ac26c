"""The CPU's feature flags, read once per process from ``/proc/cpuinfo`` (pure Python, no project imports:
the kernels' builder, :mod:`robot_llm.llm.store.gemv`, and the machine's description,
:mod:`robot_llm.llm.plan.machine`, both ask it)."""

from __future__ import annotations

import functools
import os
from pathlib import Path


def cpu_flags(cpuinfo: str | Path | None = None) -> frozenset[str]:
    """The CPU's feature flags (the first ``flags`` line of ``cpuinfo``); this machine's are read once."""
    if cpuinfo is None:
        return _this_cpu_flags()
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


#: Environment variable naming CPU flags (comma-separated) this process acts as if the CPU lacked, e.g.
#: ``avx512_bf16,amx_bf16`` to run an AVX512-BF16 machine as the common AVX2 kind (with torch's own
#: ``ATEN_CPU_CAPABILITY=avx2`` for its kernels, ``ONEDNN_MAX_CPU_ISA=AVX2`` for oneDNN's, which the
#: first does not limit, and ``MKL_ENABLE_INSTRUCTIONS=AVX2`` for MKL's fp32 GEMM): one machine then measures
#: both kinds' paths.
HIDE_FLAGS_ENV = "ROBOT_LLM_HIDE_CPU_FLAGS"


@functools.cache
def _this_cpu_flags() -> frozenset[str]:
    hidden = {f.strip() for f in os.environ.get(HIDE_FLAGS_ENV, "").split(",") if f.strip()}
    return cpu_flags("/proc/cpuinfo") - hidden


def cpu_has_native_bf16(cpuinfo: str | Path | None = None) -> bool:
    """True when the CPU flags list AVX512-BF16 or AMX-BF16 (bf16 GEMMs then beat fp32 several times)."""
    return bool(cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16"})


def cpu_has_amx(flags: frozenset[str] | None = None) -> bool:
    """True when ``flags`` (default: this CPU's) list AMX tiles, whose int8 and bf16 GEMMs (oneDNN's) outrun our
    VNNI and int8-activation paths at some sizes."""
    return bool((cpu_flags() if flags is None else flags) & {"amx_tile", "amx_int8", "amx_bf16"})
