"""The planner's time model: how long one forward pass takes on a machine (:class:`PassTiming`).

Every layer takes max(its I/O, its compute), as the engine overlaps the two: I/O is the
layer's stored bytes from disk, from RAM through the cores, or over the host link to a GPU;
compute is its GEMMs at the machine's rate (or torch's fused int4/int8 kernels' rates on the
CPU), attention, and the dequantization of a compressed KV cache. :func:`decode_attention`
decides where a decode step attends over a KV cache kept in RAM on a GPU machine.
The memory fit that picks the placement is :mod:`robot_llm.llm.plan.planner`.
Pure Python: importing it does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from robot_llm.llm.families.config import ModelConfig
from robot_llm.llm.plan.machine import Machine
from robot_llm.llm.store.int8act import int8_activation_max_rows, int8_activation_min_rows
from robot_llm.llm.store.quant import FUSED_MAX_ROWS, KV_QUANTIZED, fused_on_cpu

#: int4/int8 weights dequantized per second per thread on the CPU (measured 0.96-1.12 G here, fp32/bf16).
DEQUANT_ELEMS_PER_S = 1.0e9
#: torch's fused int4/int8 CPU kernels (bf16 activations, no dequantization), per thread: a call on a matrix of
#: ``V`` values and ``r`` rows takes ``V / values_per_s + 2 r V / flops``. Fitted to 8192x2048 here (AVX512-BF16,
#: 1 thread): int4 0.91 ms at 1 row, 13.3 ms at 32; int8 1.32 ms and 19.6 ms (fp32 dense: 4.2 ms and 22 ms).
FUSED_RATES = {"int4": (33e9, 84e9), "int8": (23e9, 57e9)}
#: int8 codes widened to bf16 per second per thread (a plain copy; measured 3.8-5 G here) when a pass has more
#: rows than the int8 kernel is worth (:data:`~robot_llm.llm.store.quant.FUSED_MAX_ROWS`): then a bf16 GEMM follows.
INT8_WIDEN_ELEMS_PER_S = 4.0e9


def matrix_shares(weight_dtype: str, int8_share: float) -> dict[str, float]:
    """Share of a layer's matrix parameters per stored dtype (an int4 store may keep some matrices int8)."""
    if weight_dtype != "int4" or not int8_share:
        return {weight_dtype: 1.0}
    return {d: share for d, share in (("int4", 1 - int8_share), ("int8", int8_share)) if share}


@dataclass(frozen=True)
class PassTiming:
    """Per-pass time model: every layer takes max(its I/O, its compute); the engine overlaps the two.

    ``params`` are a layer's matrix parameters, ``layer_sizes`` each layer's stored bytes, ``ram_layers``
    how many of the first layers are homed in RAM; ``int8_share`` of an int4 store's matrix parameters
    are int8 (:func:`matrix_shares`).
    """

    cfg: ModelConfig
    machine: Machine
    params: int
    layer_sizes: tuple[int, ...]
    converts: bool
    dtype: str
    ram_layers: int
    kv: tuple[Literal["device", "cpu"], str]
    kv_elem_bytes: float
    weight_dtype: str = "fp16"
    int8_share: float = 0.0

    def pass_seconds(self, batch: int, tokens: int, slots: float) -> float:
        """One forward pass of ``batch`` rows of ``tokens`` new tokens attending to ``slots`` positions."""
        cfg, m = self.cfg, self.machine
        q_width, kv_width = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        params = self.params
        rate = m.gpu_flops if m.has_gpu else m.cpu_rate(self.dtype) * m.compute_threads / max(m.cores, 1)
        rows = batch * tokens
        fused = not m.has_gpu and fused_on_cpu(self.weight_dtype, self.dtype)
        streamed_matmuls = None
        if fused:  # each stored dtype's share of the parameters takes that dtype's own path
            shares = matrix_shares(self.weight_dtype, self.int8_share)

            def paths(int8: bool) -> float:
                return sum(self._fused_path_seconds(d, s * params, rows, rate, int8) for d, s in shares.items())

            matmuls = paths(m.cpu_int8_ops > 0)
            if m.cpu_int8_ops and self.ram_layers < len(self.layer_sizes):
                streamed_matmuls = paths(False)  # only RAM-homed layers are rotated for int8 activations
        else:
            matmuls = 2 * rows * params / rate
            if self.converts and not m.has_gpu:  # dequantized by the reader
                matmuls += params / (DEQUANT_ELEMS_PER_S * m.compute_threads)
        other = 4 * rows * slots * q_width / rate
        kv_values = 2 * batch * slots * kv_width
        if tokens == 1:
            other += decode_attention(cfg, m, self.kv, self.kv_elem_bytes, batch, slots)[1]
        if self.kv[1] in KV_QUANTIZED and not m.has_gpu:
            other += kv_values / (DEQUANT_ELEMS_PER_S * m.compute_threads)
        compute = matmuls + other
        streamed = compute if streamed_matmuls is None else streamed_matmuls + other
        # A RAM-homed layer crosses the host link to a GPU; on the CPU the cores still read it from RAM,
        # which bounds a small batch's step (counting it as free made batch 1 look as fast as any): through
        # a GEMM in the compute dtype (torch's one-row bf16 GEMM reads slower than fp32's), unless the fused
        # kernels or a widening copy read the int4/int8 codes (their rates are in ``compute``).
        ram_bps = m.h2d_bps if m.has_gpu else m.ram_bps if fused else m.ram_rate(self.dtype)
        return sum(
            max(size / ram_bps, size / m.disk_read_bps, streamed)
            if i >= self.ram_layers
            else max(size / ram_bps, compute)
            for i, size in enumerate(self.layer_sizes)
        )

    def _fused_path_seconds(self, dtype: str, params: float, rows: int, rate: float, int8: bool) -> float:
        """Matrix seconds of ``params`` stored as ``dtype`` (int4/int8) with bf16 activations on the CPU, or past
        the fused kernels' rows with ``int8`` activations (one int8 GEMM over matrices rotated once; quantizing
        and rotating the activations is a few % of it, not charged)."""
        m = self.machine
        threads = m.compute_threads
        most = int8_activation_max_rows(self.dtype)
        quantized = int8 and rows >= int8_activation_min_rows() and (most is None or rows <= most)
        if quantized:  # an int4 matrix too, through its rotated int8 copy (5x the fused int4 kernel at 32 rows)
            return 2 * rows * params / (m.cpu_int8_ops * threads / max(m.cores, 1))
        if rows <= FUSED_MAX_ROWS[dtype]:  # torch's fused kernels read the stored bytes
            values_per_s, flops = FUSED_RATES[dtype]
            return params * (1 / values_per_s + 2 * rows / flops) / threads
        # Past the kernel's row limit, a bf16 GEMM: int8 codes widened once per pass (a copy), int4 ones
        # dequantized once by the compute thread.
        widen = INT8_WIDEN_ELEMS_PER_S if dtype == "int8" else DEQUANT_ELEMS_PER_S
        return 2 * rows * params / rate + params / (widen * threads)


def decode_attention(
    cfg: ModelConfig,
    m: Machine,
    kv: tuple[Literal["device", "cpu"], str],
    kv_elem_bytes: float,
    batch: int,
    slots: float,
) -> tuple[Literal["compute", "kv"], float]:
    """Where a decode step attends over a KV cache in RAM on a GPU machine, and the seconds per layer it adds.

    Copying the cache up costs its (compressed) bytes over the host link. Attending in RAM
    (FlexGen's CPU attention) reads them once, dequantizes them, writes and reads them
    again as fp32 and does the score FLOPs on the cores; only ``q`` and the output move.
    The engine does the cheaper one. Anywhere else attention runs with the weights: 0 s.
    """
    kv_home, kv_dtype = kv
    if not (m.has_gpu and kv_home == "cpu"):
        return "compute", 0.0
    kv_values = 2 * batch * slots * cfg.num_key_value_heads * cfg.head_dim
    move = kv_values * kv_elem_bytes / m.h2d_bps
    flops = 4 * batch * slots * cfg.num_attention_heads * cfg.head_dim
    here = (kv_values * (kv_elem_bytes + 2 * 4)) / m.ram_bps + flops / m.cpu_flops
    if kv_dtype in KV_QUANTIZED:
        here += kv_values / (DEQUANT_ELEMS_PER_S * m.compute_threads)
    return ("kv", here) if here < move else ("compute", move)
