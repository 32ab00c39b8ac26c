"""What the planner knows about a machine, and how this one is detected.

Pure Python (torch is imported only to ask CUDA for its memory): the daemon's
``doctor`` and ``model plan`` use it without loading the model.

The default rates describe a typical desktop (NVMe, PCIe 4, a consumer GPU,
8-16 cores). A night and ``model plan`` for this machine replace them with
measured ones: the disk under the store (:func:`robot_llm.llm.engine.runtime.store_read_bps`),
the CPU, RAM and GPU rates (:mod:`robot_llm.llm.plan.rates`); given options win.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from robot_llm.errors import RobotLLMError
from robot_llm.llm.plan.cpu import cpu_flags, cpu_has_native_bf16
from robot_llm.llm.store.gemv import ENV, INT4_FEW_ROWS, MATMUL_ROWS, kernels, matmul_available
from robot_llm.llm.store.int8act import (
    int8_activation_max_rows,
    int8_activation_min_rows,
    int8_activations_on_cpu,
    our_int8_mm_max_rows,
)
from robot_llm.llm.store.quant import FUSED_MAX_ROWS, fused_on_cpu, int4_kernel_reads_stored_layout

GB = 1e9


class GPUError(RobotLLMError):
    """CUDA is there but the GPU cannot be asked for its memory (busy, exclusive-process mode, broken driver)."""


@dataclass(frozen=True)
class Machine:
    """What the planner knows about the hardware (bytes, bytes/s, FLOP/s, cores).

    ``cpu_flops`` is the sustained fp32 GEMM rate on all ``cores``, ``cpu_bf16_flops``
    the bf16 one where the CPU has native bf16 (``cpu_bf16``; AVX512-BF16 or AMX),
    else unused; the planner charges ``compute_threads / cores`` of them. ``ram_bps``
    is how fast the compute threads read weights out of RAM through a one-row fp32 GEMM,
    ``ram_bf16_bps`` through a bf16 one (torch's bf16 one-row GEMM reads slower; 0 = as
    ``ram_bps``, e.g. for a machine described by its RAM rate alone). ``threads`` is how
    many intra-op threads compute gets (0 = all ``cores``). ``cpu_int8_ops`` is the int8 x int8 GEMM rate on
    all ``cores`` where calls of many rows quantize their activations
    (:func:`~robot_llm.llm.store.int8act.int8_activations_on_cpu`; 0 = they do not). ``gpu_bf16``: the GPU computes bf16
    natively (compute capability 8.0 or newer; :func:`gpu_has_native_bf16`).
    """

    ram_bytes: int
    gpu_bytes: int = 0
    disk_read_bps: float = 3.0 * GB
    h2d_bps: float = 12.0 * GB
    gpu_flops: float = 30e12
    cpu_flops: float = 0.5e12
    cpu_bf16_flops: float = 1.0e12
    cpu_bf16: bool = False
    gpu_bf16: bool = False
    ram_bps: float = 10.0 * GB
    ram_bf16_bps: float = 0.0
    cpu_int8_ops: float = 0.0
    cores: int = 1
    threads: int = 0
    label: str = ""

    @property
    def has_gpu(self) -> bool:
        """True when a GPU computes."""
        return self.gpu_bytes > 0

    @property
    def compute_threads(self) -> int:
        """Intra-op threads compute gets."""
        return self.threads or self.cores

    def cpu_rate(self, dtype: str) -> float:
        """Sustained CPU GEMM rate in ``dtype`` (fp16 has no fast CPU path: fp32's rate at best)."""
        return self.cpu_bf16_flops if dtype == "bf16" and self.cpu_bf16 else self.cpu_flops

    def ram_rate(self, dtype: str) -> float:
        """Bytes/s at which a one-row GEMM in ``dtype`` reads its weight out of RAM (fp32's rate unless bf16's
        was measured or given)."""
        return self.ram_bf16_bps if dtype == "bf16" and self.ram_bf16_bps else self.ram_bps


def gpu_has_native_bf16(device: object = None) -> bool:
    """True when the CUDA GPU ``device`` (default: the current one) computes bf16 natively, not emulated;
    False without CUDA or on any error."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        if device is not None:
            with torch.cuda.device(device):
                return bool(torch.cuda.is_bf16_supported(including_emulation=False))
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except Exception:  # no CUDA, an old torch, a driver error: assume no native bf16
        return False


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def free_cores(cores: int, load: float | None = None) -> int:
    """Cores not busy with other work: ``cores`` minus the 1-minute load average, at least 1.

    On shared cores more threads than free cores make every step wait for the
    slowest thread (measured: a decode step 4x slower with 2 threads than 1
    on 2 cores while another process ran).
    """
    if load is None:
        load = os.getloadavg()[0]
    return max(1, min(cores, round(cores - load)))


def usable_gpu_bytes(free: int, total: int, reserved: int) -> int:
    """The GPU memory this process can use: what is free (a desktop or browser on the same GPU holds the
    rest) plus what this process's torch already holds (``reserved``: our own model when a night re-plans
    with it loaded), never more than ``total``."""
    return max(0, min(total, free + reserved))


def gpu_error(exc: BaseException, device: str = "cuda") -> GPUError:
    """The one-line error for a GPU that cannot be asked for its memory (``exc``: what CUDA raised)."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return GPUError(
        f"the GPU ({device}) cannot be used: {first}; another process may hold it (exclusive-process mode) "
        "or its driver is broken: free or fix it, or set model.device: cpu"
    )


def cuda_usable_bytes() -> int:
    """This process's usable GPU memory (:func:`usable_gpu_bytes`) on the current CUDA device; 0 without CUDA.
    Raises :class:`GPUError` where CUDA is there but cannot be asked."""
    import torch

    if not torch.cuda.is_available():
        return 0
    try:
        device = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
    except RuntimeError as exc:  # all CUDA-capable devices are busy or unavailable, a driver error...
        raise gpu_error(exc) from exc
    return usable_gpu_bytes(free, total, reserved)


def detect_machine(disk_read_bps: float | None = None, *, gpu: bool = True) -> Machine:
    """This machine: RAM from the OS, the GPU memory this process can use when CUDA is present (and ``gpu``;
    :func:`cuda_usable_bytes`, which raises :class:`GPUError` for a GPU that cannot be asked), CPU flags,
    free cores. Its rates are the defaults until measured (:func:`robot_llm.llm.plan.rates.measure_rates`)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gpu_bytes = 0
    if gpu:
        try:
            gpu_bytes = cuda_usable_bytes()
        except ImportError:
            gpu_bytes = 0
    gpu_bf16 = gpu_bytes > 0 and gpu_has_native_bf16()
    kwargs = {"disk_read_bps": disk_read_bps} if disk_read_bps else {}
    cores = usable_cores()
    return Machine(
        ram_bytes=ram,
        gpu_bytes=gpu_bytes,
        gpu_bf16=gpu_bf16,
        cpu_bf16=cpu_has_native_bf16(),
        cores=cores,
        threads=free_cores(cores),
        label="this machine",
        **kwargs,
    )


def cpu_compute_path(
    weight_dtype: str, compute_dtype: str, cpuinfo: str | None = None, int8_activations: bool | None = None
) -> str:
    """Which matrix path a CPU night runs, in words (``doctor`` prints it): the CPU's features, whether the
    stored matrices reach the fused kernels or are widened every pass, whether calls of many rows quantize
    their activations (``int8_activations``; None: as on this machine), the int4 layout, the head's dtype."""
    flags = cpu_flags(cpuinfo)
    features = ", ".join(f"{name} {'yes' if flag in flags else 'no'}" for name, flag in _FEATURES)
    if not fused_on_cpu(weight_dtype, compute_dtype):
        how = f"{weight_dtype} matrices computed in {compute_dtype}"
        if weight_dtype in ("int4", "int8"):
            how += ", dequantized into float buffers every pass"
        return f"CPU ({features}): {how}"
    cast = ", activations cast to bf16 for them" if compute_dtype == "fp32" else ""
    rows = "/".join(f"{FUSED_MAX_ROWS[d]}" for d in ("int4", "int8"))
    if int8_activations is None:
        int8_activations = int8_activations_on_cpu()
    past = f"dense {compute_dtype} past that"
    if int8_activations:
        most = int8_activation_max_rows(compute_dtype, flags)
        fewest = int8_activation_min_rows()
        if fewest == 1:  # ours multiplies every call: the fused kernels keep only unrotated (streamed) matrices
            rows_quantized = "for every call" + (f" of up to {most} rows" if most is not None else "")
        else:
            rows_quantized = f"from {fewest}" + (f" to {most}" if most is not None else "") + " rows"
        past += f", int8 activations {rows_quantized} (Hadamard-rotated, one int8 x int8 GEMM)"
    how = f"int4/int8 matrices through torch's fused kernels up to {rows} rows{cast}, {past}"
    if weight_dtype == "int4":
        layout = "the stored layout" if int4_kernel_reads_stored_layout() else "codes repacked for this CPU once"
        how += f"; int4 kernel reads {layout}"
    return f"CPU ({features}): {how}; LM head int8 per row, embedding rows read exactly from the store"


def cpu_kernels_path() -> str:
    """Which kernels serve the few-row int8 products and a decode step's norms and attention here, in words
    (``doctor`` prints it)."""
    built = kernels()
    what = "few-row int8 products (the int8 matrices and the head at decode sizes)"
    if built is None:
        why = f"no C compiler, no AVX2/FMA, or {ENV}=0"
        return f"{what} through torch's fused kernel; norms, attention, gated activation torch's (not built: {why})"
    body = "AVX512" if built.lanes == 16 else "AVX2"
    many = ""
    if matmul_available():
        (a, b), (c, d) = MATMUL_ROWS["int4"], MATMUL_ROWS["int8"]
        many = f"; int4 calls of 1-{INT4_FEW_ROWS} and {a}-{b} rows and int8 ones of {c}-{d} rows ours too (gemm.c)"
    if built.int8_mm_body == "amx":
        many += f"; int8 x int8 products ours at every size (AMX tiles; VNNI to {built.lib.rl_vnni_max_rows()} rows)"
    elif built.int8_mm_body == "vnni":
        many += f"; int8 x int8 products of up to {our_int8_mm_max_rows()} rows ours (AVX512-VNNI), every one over the"
        many += " matrices held in RAM and the head, their codes packed in VNNI order (vnni.c)"
    else:
        trick = "offset" if built.activation_levels <= built.narrow_levels else "sign"
        levels = built.activation_levels
        many += f"; int8 x int8 products ours at every size (AVX2, activation codes to +-{levels}: {trick} trick)"
    return (
        f"{what} through our kernel (gemv.c, its {body} body){many}; decode norms and attention ours"
        " (norm.c, attend.c), the gated MLP's activation ours (gated.c)"
    )


#: CPU flags :func:`cpu_compute_path` names.
_FEATURES = (("AVX2", "avx2"), ("AVX512", "avx512f"), ("AVX512-BF16", "avx512_bf16"), ("AMX", "amx_bf16"))
