"""This machine's compute and memory rates, measured the way the planner charges them.

The planner (:mod:`robot_llm.llm.plan.planner`) prices a pass with a few rates of
:class:`~robot_llm.llm.plan.machine.Machine`:

* ``cpu_rate(dtype) * compute_threads / cores`` for every CPU GEMM and attention FLOP. The
  passes that compute-bound a night are prefill and the stance pass, whose GEMMs have
  micro-batch x tokens rows (hundreds to thousands); a decode step's few rows are bounded by
  reading the weights instead (below). So the GEMM probe has many rows.
* ``ram_rate(dtype)`` for the compute threads reading a RAM-homed layer: the floor under a small
  batch's decode step (and, on a GPU machine, ``ram_bps`` for attending over a KV cache kept in
  RAM). So the RAM probe reads a matrix larger than the caches through a one-row GEMM, as a
  decode step does, in fp32 (``ram_bps``) and, where bf16 is native, in bf16 (``ram_bf16_bps``):
  torch's one-row bf16 GEMM reads slower at 1 thread (here: fp32 23.5 GB/s, bf16 16.6 GB/s; about
  equal at 2 threads).
* ``h2d_bps`` for a layer (or the KV cache) crossing from pinned host slots to the GPU, and
  ``gpu_flops`` for the GPU's GEMMs (fp16, the GPU's compute dtype).

Each probe runs one untimed call (allocator, kernel choice), then calls for about
:data:`PROBE_SECONDS`, at the intra-op thread count the night will use, and is cached once per
process (per dtype and thread count), as :func:`robot_llm.llm.engine.runtime.store_read_bps` is for
the disk. Torch is imported inside the functions, so importing this module stays light (the
daemon's and the read API's import path); without torch the probes give None and the defaults
stay, labelled as assumed.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace

from robot_llm.llm.plan.machine import Machine

#: How long each probe calls its operation after the untimed first call (seconds).
PROBE_SECONDS = 0.1
#: The CPU GEMM probe: ``rows x inner`` times an ``outer x inner`` weight, as ``F.linear`` computes a layer.
#: The rate levels off past about 128 rows (here, 1 thread: fp32 71 GFLOP/s at 32 rows, 100 at 128-512);
#: the 16 MiB fp32 weight is past the L2 caches, and one call is 2 GFLOP (about 20 ms at 100 GFLOP/s).
CPU_GEMM_SHAPE = (256, 2048, 2048)
#: The GPU GEMM probe (fp16): prefill-sized, large enough that a call is not launch latency (0.5 TFLOP).
GPU_GEMM_SHAPE = (4096, 8192, 8192)
#: Bytes the RAM read and host-to-device copy probes move per call: past the last-level cache of most
#: CPUs, and no more than the disk probe's window (a night measures before its model loads, and must
#: not raise its peak RSS past the plan).
PROBE_BYTES = 64 << 20

#: Torch dtypes by the planner's names.
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@contextlib.contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """Run the body with ``threads`` intra-op threads (None: as set), then put the count back."""
    import torch

    before = torch.get_num_threads()
    if threads and threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _calls_per_second(call: Callable[[], object], sync: Callable[[], None], seconds: float) -> float:
    """Calls per second of ``call``: one untimed call, then calls until ``seconds`` have passed (at least 2).

    ``sync`` waits for the device to finish (CUDA runs calls asynchronously: without it the loop
    would time the launches, not the work).
    """
    call()
    sync()
    count, started = 0, time.perf_counter()
    while True:
        call()
        sync()
        count += 1
        elapsed = time.perf_counter() - started
        if count >= 2 and elapsed >= seconds:
            return count / elapsed


def _sync_for(device: object) -> Callable[[], None]:
    import torch

    if torch.device(device).type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def gemm_flops(
    rows: int,
    inner: int,
    outer: int,
    dtype: str = "fp32",
    *,
    device: str = "cpu",
    threads: int | None = None,
    seconds: float = PROBE_SECONDS,
) -> float:
    """Sustained FLOP/s of ``F.linear`` of ``rows x inner`` activations with an ``outer x inner`` weight.

    ``dtype`` is the planner's name (fp32, bf16, fp16); ``threads`` the intra-op threads (None: as set).
    """
    import torch

    dt = getattr(torch, _DTYPES[dtype])
    # Made where they are used, in their dtype: no fp32 host copy of a GPU-sized weight.
    x = torch.randn(rows, inner, device=device, dtype=dt)
    w = torch.randn(outer, inner, device=device, dtype=dt)
    with intra_op_threads(threads):
        per_s = _calls_per_second(lambda: torch.nn.functional.linear(x, w), _sync_for(device), seconds)
    return 2 * rows * inner * outer * per_s


def int8_gemm_ops(
    rows: int,
    inner: int,
    outer: int,
    *,
    threads: int | None = None,
    seconds: float = PROBE_SECONDS,
    packed: bool = False,
) -> float:
    """Sustained ops/s of the int8 x int8 -> int32 GEMM that int8 activations meet in a call of ``rows`` rows
    (ours where :func:`~robot_llm.llm.store.int8act.int8_kernels_for` gives one, else ``torch._int_mm``) of
    ``rows x inner`` codes with an ``outer x inner`` matrix of codes; ``packed``: codes packed in VNNI order, as a
    VNNI build's head holds them (:func:`~robot_llm.llm.store.int8act.vnni_pack`; ours at every row count)."""
    import torch

    from robot_llm.llm.store.gemv import kernels
    from robot_llm.llm.store.int8act import int8_kernels_for, vnni_pack

    q = torch.ones(rows, inner, dtype=torch.int8)
    w = torch.ones(outer, inner, dtype=torch.int8)
    ours, lib = int8_kernels_for(rows), kernels()
    matmul = ours.matmul if ours is not None else None
    w, offset = vnni_pack(w, outer) if packed and lib is not None else (w, None)

    def call() -> object:
        if offset is not None and lib is not None:
            return lib.int8_mm(q, w, offset=offset)
        return matmul(q, w, None) if matmul is not None else torch._int_mm(q, w.t())

    with intra_op_threads(threads):
        per_s = _calls_per_second(call, lambda: None, seconds)
    return 2 * rows * inner * outer * per_s


def read_bps(
    nbytes: int = PROBE_BYTES, dtype: str = "fp32", *, threads: int | None = None, seconds: float = PROBE_SECONDS
) -> float:
    """Bytes/s at which the compute threads read a ``dtype`` matrix of ``nbytes`` out of RAM: a one-row GEMM
    over it, as a batch-1 decode step reads a layer (a plain reduction reads faster than any step does)."""
    import torch

    dt, width = getattr(torch, _DTYPES[dtype]), 4096
    w = torch.ones(max(1, nbytes // (dt.itemsize * width)), width, dtype=dt)
    x = torch.ones(1, width, dtype=dt)
    with intra_op_threads(threads):
        per_s = _calls_per_second(lambda: torch.nn.functional.linear(x, w), lambda: None, seconds)
    return w.numel() * w.element_size() * per_s


def copy_bps(device: str, nbytes: int = PROBE_BYTES, *, seconds: float = PROBE_SECONDS) -> float:
    """Bytes/s of copying a host buffer to ``device``: from pinned memory where it is CUDA, as the engine's
    layer slots are."""
    import torch

    cuda = torch.device(device).type == "cuda"
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    per_s = _calls_per_second(lambda: dst.copy_(src, non_blocking=cuda), _sync_for(device), seconds)
    return nbytes * per_s


# --------------------------------------------------------------------------- cached probes (once per process)


def _torch_present() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def cpu_gemm_flops(dtype: str, threads: int) -> float | None:
    """The CPU's GEMM rate in ``dtype`` at ``threads`` intra-op threads (:data:`CPU_GEMM_SHAPE`); None without
    torch. Measured once per process per (dtype, threads)."""
    return gemm_flops(*CPU_GEMM_SHAPE, dtype, threads=threads) if _torch_present() else None


@functools.cache
def cpu_int8_gemm_ops(threads: int) -> float | None:
    """The CPU's int8 GEMM rate at ``threads`` intra-op threads (:data:`CPU_GEMM_SHAPE`), over codes packed in VNNI
    order where the RAM-homed matrices it times are (:func:`~robot_llm.llm.store.int8act.packs_codes`); None without
    torch or where calls do not quantize their activations. Measured once per process per thread count."""
    from robot_llm.llm.store.int8act import int8_activations_on_cpu, packs_codes

    if not (_torch_present() and int8_activations_on_cpu()):
        return None
    return int8_gemm_ops(*CPU_GEMM_SHAPE, threads=threads, packed=packs_codes())


@functools.cache
def ram_read_bps(dtype: str, threads: int) -> float | None:
    """The RAM read rate of a one-row GEMM in ``dtype`` at ``threads`` intra-op threads (:func:`read_bps`); None
    without torch. Measured once per process per (dtype, threads)."""
    return read_bps(dtype=dtype, threads=threads) if _torch_present() else None


@functools.cache
def gpu_rates(
    device: str = "cuda", shape: tuple[int, int, int] = GPU_GEMM_SHAPE, nbytes: int = PROBE_BYTES
) -> tuple[float, float] | None:
    """(host-to-device bytes/s of ``nbytes``, fp16 GEMM FLOP/s at ``shape``) of ``device``; None where it is not
    there. Once per process. (The tests run it on the CPU device, at a small shape.)"""
    if not _torch_present():
        return None
    import torch

    cuda = torch.device(device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        return None
    rates = copy_bps(device, nbytes), gemm_flops(*shape, "fp16", device=device)
    if cuda:  # the probes' ~320 MiB go back to the device before the model is placed there
        torch.cuda.empty_cache()
    return rates


# --------------------------------------------------------------------------- the machine with its rates

#: Machine fields that are rates, in the order they are printed.
RATE_FIELDS = (
    "disk_read_bps",
    "ram_bps",
    "cpu_flops",
    "cpu_bf16_flops",
    "cpu_int8_ops",
    "ram_bf16_bps",
    "h2d_bps",
    "gpu_flops",
)


def _threads_label(threads: int) -> str:
    return f"{threads} thread" + ("s" if threads != 1 else "")


def measure_rates(
    machine: Machine,
    given: Mapping[str, float] | None = None,
    *,
    probe_cpu: bool = True,
    probe_gpu: bool = True,
) -> tuple[Machine, dict[str, str]]:
    """``machine`` with its rates, and where each came from (by field: ``given``, ``measured ...``, ``assumed``).

    ``given`` rates (by field name) win. The CPU's GEMM and RAM read rates (fp32, and bf16 where it is
    native) are measured here with ``probe_cpu``, at ``machine.compute_threads``; the GPU's copy and
    GEMM rates with ``probe_gpu`` where the machine has a GPU. The rest stay the defaults, assumed.
    The disk's rate is the caller's (it is measured under a store): labelled assumed unless given.
    A given ``ram_bps`` stands for every dtype: bf16's read is then not measured (nor printed).

    The planner charges CPU compute at ``cpu_rate(dtype) * compute_threads / cores``: a CPU rate measured
    at ``t`` threads is stored as ``rate * cores / t``, so that the planner gets back the measured rate at
    the night's thread count.
    """
    given = dict(given or {})
    sources = {name: "assumed" for name in RATE_FIELDS}
    threads, cores = max(machine.compute_threads, 1), max(machine.cores, 1)
    measured: dict[str, float] = {}
    label = f"measured at {_threads_label(threads)}"
    if probe_cpu:
        scale = cores / threads
        scaled = label + (f", scaled to {cores} cores" if threads != cores else "")
        for field, dtype, wanted in (("cpu_flops", "fp32", True), ("cpu_bf16_flops", "bf16", machine.cpu_bf16)):
            rate = cpu_gemm_flops(dtype, threads) if wanted and field not in given else None
            if rate is not None:
                measured[field], sources[field] = rate * scale, scaled
        int8 = cpu_int8_gemm_ops(threads) if "cpu_int8_ops" not in given else None
        if int8 is not None:
            measured["cpu_int8_ops"], sources["cpu_int8_ops"] = int8 * scale, scaled
        for field, dtype, wanted in (("ram_bps", "fp32", True), ("ram_bf16_bps", "bf16", machine.cpu_bf16)):
            ram = ram_read_bps(dtype, threads) if wanted and not {"ram_bps", field} & given.keys() else None
            if ram is not None:
                measured[field], sources[field] = ram, label
    if probe_gpu and machine.has_gpu and not {"h2d_bps", "gpu_flops"} <= given.keys():
        gpu = gpu_rates()
        if gpu is not None:
            for field, rate in zip(("h2d_bps", "gpu_flops"), gpu, strict=True):
                measured[field], sources[field] = rate, "measured"
    for field in given:
        sources[field] = "given"
    values = {**measured, **given}
    bad = {k: v for k, v in values.items() if not (math.isfinite(v) and v > 0)}
    if bad:
        raise ValueError(f"rates must be positive and finite: {bad}")
    return replace(machine, **values), sources


def describe_rates(machine: Machine, sources: Mapping[str, str]) -> str:
    """One line: each rate the planner uses on ``machine`` and where it came from (what ``model plan`` and
    ``doctor`` print)."""

    def src(field: str) -> str:
        return f" ({sources[field]})" if field in sources else ""

    parts = [
        f"disk {machine.disk_read_bps / 1e9:.1f} GB/s{src('disk_read_bps')}",
        f"RAM read {machine.ram_bps / 1e9:.1f} GB/s{src('ram_bps')}",
        f"CPU fp32 {machine.cpu_flops / 1e12:.3g} TFLOP/s{src('cpu_flops')}",
        f"bf16 {machine.cpu_bf16_flops / 1e12:.3g} TFLOP/s{src('cpu_bf16_flops')}"
        if machine.cpu_bf16
        else "no native bf16",
    ]
    if machine.cpu_int8_ops:
        parts.append(f"int8 activations {machine.cpu_int8_ops / 1e12:.3g} TOP/s{src('cpu_int8_ops')}")
    if machine.ram_bf16_bps:  # else bf16 reads at the RAM read rate above
        parts.append(f"RAM read in bf16 {machine.ram_bf16_bps / 1e9:.1f} GB/s{src('ram_bf16_bps')}")
    if machine.has_gpu:
        parts.append(f"host-to-GPU {machine.h2d_bps / 1e9:.1f} GB/s{src('h2d_bps')}")
        parts.append(f"GPU {machine.gpu_flops / 1e12:.3g} TFLOP/s{src('gpu_flops')}")
    return ", ".join(parts)
