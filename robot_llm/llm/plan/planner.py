"""Memory planner for the streaming engine: batch size, weight home, KV home and micro-batch.

Given the model config, the work (prompts, their token lengths, max_new_tokens)
and the machine (GPU memory, RAM, bandwidths), :func:`plan` enumerates the
placements the engine supports (weights in RAM or on disk; KV cache on the
compute device or in RAM), finds for each the largest batch whose every tier
fits, estimates the run time with a per-layer max(I/O, compute) model (the
engine overlaps the two; :mod:`robot_llm.llm.plan.timing`) and returns the fastest. Nothing fits -> :class:`PlanError`
with the reason, before any weight is read.

The memory model follows what :class:`robot_llm.llm.engine.streaming.StreamingModel`
allocates: two layer slots (pinned on CUDA, plus two device slots), one set of
compute-dtype buffers when the stored dtype differs, the resident embedding /
projector / output layer, the KV cache, and activations of one micro-batch.
Pure Python: importing it does not import torch.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from robot_llm.errors import RobotLLMError
from robot_llm.llm.families.config import ModelConfig, embedding_is_head
from robot_llm.llm.plan.machine import Machine
from robot_llm.llm.plan.sizes import (
    DTYPE_BYTES,
    activation_bytes,
    embedding_params,
    kv_bytes,
    layer_bytes,
    layer_params,
    pinned_bytes,
    resident_params,
)
from robot_llm.llm.plan.timing import PassTiming, decode_attention, matrix_shares
from robot_llm.llm.store.quant import (
    FUSED_MAX_ROWS,
    KV_QUANTIZED,
    fused_on_cpu,
    kv_bits_per_value,
)

log = logging.getLogger(__name__)

GiB = 2**30
GB = 1e9
#: Share of each memory tier (RAM, GPU) a plan may fill; the rest is slack for what it does not model.
HEADROOM = 0.9

#: Resident set of a Python process with torch (CPU build) and this package loaded, after the kernels a night
#: runs (fp32/bf16 linear, the int4/int8 fused kernels, log_softmax) and before any weight: measured 241 MiB with
#: the engine's imports, 260 MiB with ``batch run``'s (VmHWM, 7 fresh processes, 1 or 2 threads: +-0.2 MiB);
#: the rest is margin for the real model's tokenizer.
PROCESS_BASE_BYTES = int(0.28 * GiB)
#: Host memory the CUDA runtime maps into the process (libraries, context), on top of the base.
CUDA_HOST_BYTES = int(1.5 * GiB)
#: CUDA context and allocator slack on the GPU.
CUDA_CONTEXT_BYTES = int(0.8 * GiB)
#: A staging slot's bytes beyond its layer's payload: the file's header and O_DIRECT's alignment (the engine
#: reads whole files into :func:`~robot_llm.llm.store.layout.aligned_buffer` memory).
SLOT_HEADER_BYTES = 64 << 10
Home = Literal["ram", "disk", "split"]


class PlanError(RobotLLMError):
    """The run cannot fit on this machine; the message says which tier and by how much."""


@dataclass(frozen=True)
class Work:
    """The batch job: ``num_prompts`` prompts of up to ``prompt_tokens`` tokens (BOS included).

    ``shared_prefix_tokens`` of every prompt are a common head (a template's) whose KV is
    stored once per batch, not once per row.

    ``stance_tokens`` > 0 means every row's stance is then scored the way the
    worker does it: from the row's own KV cache, the cue and the label pieces
    (that many tokens per row) in one more pass of the batch, whose fp32
    logits come back for every one of those positions.
    """

    num_prompts: int
    prompt_tokens: int
    max_new_tokens: int
    shared_prefix_tokens: int = 0
    stance_tokens: int = 0

    @property
    def seq_slots(self) -> int:
        """KV slots per sequence of its own (the last generated token is never fed back; the shared head is not;
        the stance's cue and labels are)."""
        return self.prompt_tokens - self.shared_prefix_tokens + max(self.max_new_tokens, 1) - 1 + self.stance_tokens


@dataclass(frozen=True)
class Plan:
    """A placement, its memory per tier and its estimated time."""

    device: Literal["cuda", "cpu"]
    weight_dtype: str
    compute_dtype: str
    batch_size: int
    weight_home: Literal["ram", "disk", "split"]
    kv_home: Literal["device", "cpu"]
    kv_dtype: str
    micro_batch: int
    memory: dict[str, dict[str, int]]
    capacity: dict[str, int]
    prefill_seconds: float
    decode_seconds: float
    num_batches: int
    work: Work
    notes: list[str] = field(default_factory=list)
    ram_layers: int = 0
    threads: int = 1
    stance_seconds: float = 0.0
    attention_home: Literal["compute", "kv"] = "compute"
    int8_share: float = 0.0

    @property
    def kv(self) -> tuple[Literal["device", "cpu"], str]:
        """The KV cache's (home, dtype)."""
        return self.kv_home, self.kv_dtype

    @property
    def total_seconds(self) -> float:
        """Estimated wall time of the whole job (stance scoring included)."""
        per_batch = self.prefill_seconds + self.work.max_new_tokens * self.decode_seconds + self.stance_seconds
        return self.num_batches * per_batch

    @property
    def tokens_per_second(self) -> float:
        """Estimated generated tokens per second."""
        return self.work.num_prompts * self.work.max_new_tokens / max(self.total_seconds, 1e-9)

    def describe(self) -> str:
        """Human-readable plan (what ``robot-llm model plan`` prints)."""
        lines = [
            f"compute on {self.device} in {self.compute_dtype}, weights stored as {self.weight_dtype}"
            + (f" ({self.int8_share:.0%} of the layer matrices' parameters int8)" if self.int8_share else ""),
            f"batch size {self.batch_size} ({self.num_batches} batches of the {self.work.num_prompts} prompts), "
            f"prefill micro-batch {self.micro_batch}",
            f"weights homed in {self.weight_home}"
            + (f" ({self.ram_layers} layers in RAM, the rest on disk)" if self.weight_home == "split" else "")
            + ", KV cache in "
            + ("GPU memory" if self.kv_home == "device" and self.device == "cuda" else "RAM")
            + f" as {self.kv_dtype}"
            + (", decode attention computed there (the cache never moves)" if self.attention_home == "kv" else ""),
            f"{self.threads} compute thread(s)",
            "memory per tier:",
        ]
        for tier, items in self.memory.items():
            used = sum(items.values())
            cap = self.capacity.get(tier)
            head = f"  {tier}: {_fmt(used)}" + (f" of {_fmt(cap)}" if cap else "")
            lines.append(head)
            lines.extend(f"    {name:<22} {_fmt(size)}" for name, size in items.items() if size)
        lines.append(
            f"estimated time: prefill {_dur(self.prefill_seconds)}/batch, decode {self.decode_seconds:.2f} s/step"
            + (f", stance {self.stance_seconds:.2f} s/batch" if self.stance_seconds else "")
            + f", total {_dur(self.total_seconds)} ({self.tokens_per_second:.3g} tok/s)"
        )
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _fmt(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.1f} MiB"


def _dur(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    return f"{s / 60:.1f} min" if s >= 120 else f"{s:.1f} s"


# --------------------------------------------------------------------------- plan


def plan(
    cfg: ModelConfig,
    work: Work,
    machine: Machine,
    *,
    weight_dtype: str = "fp16",
    compute_dtype: str | None = None,
    max_batch_size: int | None = None,
    memory_budget_bytes: int | None = None,
    headroom: float = HEADROOM,
    weight_home: Home | None = None,
    kv_dtype: str | None = None,
    layer_sizes: Sequence[int] | None = None,
    int8_share: float = 0.0,
) -> Plan:
    """The fastest placement that fits; raises :class:`PlanError` when none does.

    ``memory_budget_bytes`` caps the host RAM the run may use (default: the
    machine's RAM); ``headroom`` is the usable share of each tier.
    ``weight_home`` forces a home instead of trying all three (``split``: the
    first layers in RAM, as many as fit next to the batch, the rest on disk);
    ``compute_dtype`` None or ``"auto"`` means on a GPU the family's dtype
    (:func:`gpu_compute_dtype`: YaLM fp16; Llama bf16 where the GPU has it natively, else
    fp16; Gemma 3 bf16, else fp32, never fp16), and on the CPU bf16 where it is native
    (:attr:`Machine.cpu_bf16`), else fp32 (never fp16: CPUs have no fast fp16 GEMM).
    ``kv_dtype`` pins the KV cache's dtype; None or ``"auto"`` tries the compute dtype (on the CPU
    :func:`cpu_kv_dtype` first), int8 and int4 (compressed, :mod:`robot_llm.llm.engine.kvquant`) and keeps the
    fastest, the first of those on a tie.
    ``layer_sizes`` are the stored bytes of each transformer layer of a converted store
    (:meth:`robot_llm.llm.store.reader.Manifest.layer_bytes`: an int4 store of a GGUF file keeps
    some matrices int8); by default every layer has :func:`layer_bytes` of ``weight_dtype``.
    ``int8_share`` is the share of the layers' matrix parameters such an int4 store keeps int8
    (:meth:`robot_llm.llm.store.reader.Manifest.int8_share`): they are timed on int8's kernels and row limit.
    """
    sizes = tuple(layer_sizes) if layer_sizes is not None else (layer_bytes(cfg, weight_dtype),) * cfg.num_layers
    if len(sizes) != cfg.num_layers:
        raise PlanError(f"{len(sizes)} layer sizes for a model of {cfg.num_layers} layers")
    if not 0 <= int8_share <= 1 or (int8_share and weight_dtype != "int4"):
        raise PlanError(f"an int8 share of {int8_share} for {weight_dtype} weights (only an int4 store has one)")
    if work.num_prompts < 1 or work.prompt_tokens < 1 or work.max_new_tokens < 0:
        raise PlanError(f"nothing to plan for {work}")
    total_tokens = work.prompt_tokens + work.max_new_tokens
    if total_tokens > cfg.max_position_embeddings:
        raise PlanError(
            f"prompt ({work.prompt_tokens}) + max_new_tokens ({work.max_new_tokens}) = {total_tokens} tokens "
            f"exceeds the model's {cfg.max_position_embeddings} positions"
        )
    auto = compute_dtype in (None, "auto")
    cdtype = auto_compute_dtype(machine, cfg) if auto else str(compute_dtype)
    if machine.has_gpu:
        warn_gpu_dtype(cfg, cdtype)
    if cdtype not in DTYPE_BYTES:
        raise PlanError(f"unknown compute dtype {compute_dtype!r}; use one of {', '.join(DTYPE_BYTES)} or auto")
    ram = int((memory_budget_bytes or machine.ram_bytes) * headroom)
    gpu = int(machine.gpu_bytes * headroom)
    cap_batch = min(work.num_prompts, max_batch_size or work.num_prompts)
    homes: list[Home] = [weight_home] if weight_home else ["ram", "split", "disk"]
    kv_homes: list[Literal["device", "cpu"]] = ["device", "cpu"] if machine.has_gpu else ["device"]
    plain = cdtype if machine.has_gpu else cpu_kv_dtype(cfg, cdtype)
    kv_dtypes = [kv_dtype] if kv_dtype not in (None, "auto") else list(dict.fromkeys([plain, cdtype, *KV_QUANTIZED]))
    if cfg.head_dim % 2:  # int4 packs pairs of a head's values
        kv_dtypes = [d for d in kv_dtypes if d != "int4"] or kv_dtypes
    best: Plan | None = None
    reasons: list[str] = []
    for home, kv_home, kvd in itertools.product(homes, kv_homes, kv_dtypes):
        candidate = None
        for batch in _descending(cap_batch):
            candidate = _try(
                cfg, work, machine, sizes, weight_dtype, cdtype, home, (kv_home, kvd), batch, ram, gpu, int8_share
            )
            if isinstance(candidate, Plan):
                break
        if isinstance(candidate, Plan):
            candidate = _rebalance(cfg, work, machine, sizes, candidate, ram, gpu, cap_batch)
            candidate = _kernel_sized(cfg, work, machine, sizes, candidate, ram, gpu)
            if best is None or candidate.total_seconds < best.total_seconds:
                best = candidate
        elif candidate is not None:
            reasons.append(f"weights in {home}, KV on {kv_home} in {kvd}: {candidate}")
    if best is None:
        raise PlanError("the run cannot fit even with batch size 1:\n  " + "\n  ".join(reasons))
    return best


def cpu_kv_dtype(cfg: ModelConfig, compute_dtype: str) -> str:
    """The KV cache's float dtype on the CPU: bf16 under fp32 compute where the family attends it as stored
    (:attr:`~robot_llm.llm.families.config.ModelConfig.kv_read_as_stored`, :func:`robot_llm.llm.engine.kv_cache.
    reads_in_place`): half the bytes at the same step time (Gemma 3 270M int4, batch 32, prompt 512 + 128 new,
    AVX2 kernels, 1 thread, load 1: 270 against 272 ms a decode step, 1.09 against 1.53 GiB peak RSS); else the
    compute dtype."""
    return "bf16" if compute_dtype == "fp32" and cfg.kv_read_as_stored else compute_dtype


def auto_compute_dtype(machine: Machine, cfg: ModelConfig) -> str:
    """On a GPU the family's dtype (:func:`gpu_compute_dtype`); on the CPU bf16 where it is native, else fp32."""
    if machine.has_gpu:
        return gpu_compute_dtype(cfg, machine.gpu_bf16)
    return "bf16" if machine.cpu_bf16 else "fp32"


def gpu_compute_dtype(cfg: ModelConfig, native_bf16: bool) -> str:
    """The dtype ``cfg``'s family computes in on a GPU with (or without) native bf16
    (:attr:`~robot_llm.llm.families.config.ModelConfig.gpu_dtypes`): YaLM fp16 (as released); Llama bf16, else fp16;
    Gemma 3 bf16, else fp32 (its activations overflow fp16)."""
    with_bf16, without = cfg.gpu_dtypes
    return with_bf16 if native_bf16 else without


def warn_gpu_dtype(cfg: ModelConfig, dtype: str) -> None:
    """Log a warning when ``dtype`` is pinned on a GPU for a family that overflows in it (Gemma 3 in fp16)."""
    if dtype == "fp16" and "fp16" not in cfg.gpu_dtypes:
        log.warning(
            "computing %s in fp16 on the GPU: its activations exceed fp16's range (65504) and overflow to "
            "inf/NaN logits; use dtype bf16 (or fp32 where the GPU lacks bf16), or auto",
            cfg.family,
        )


def _descending(cap: int) -> list[int]:
    """Batch sizes to try, largest first: cap, then powers of two below it, then 1."""
    sizes = [cap] + [2**k for k in range(int(math.log2(cap)), -1, -1) if 2**k < cap]
    return sizes


def _kernel_sized(
    cfg: ModelConfig, work: Work, machine: Machine, sizes: tuple[int, ...], p: Plan, ram: int, gpu: int
) -> Plan:
    """``p``, or batches small enough for the fused int4/int8 CPU kernels' decode steps where that is faster
    (each stored dtype's row limit is tried: a mixed int4 store's int8 matrices have a lower one)."""
    if machine.has_gpu or p.compute_dtype != "bf16":
        return p
    best = p
    for dtype in matrix_shares(p.weight_dtype, p.int8_share):
        limit = FUSED_MAX_ROWS.get(dtype)
        if limit is None or p.batch_size <= limit:
            continue
        even = math.ceil(work.num_prompts / math.ceil(work.num_prompts / limit))
        small = _try_batch(cfg, work, machine, sizes, p, even, ram, gpu)
        if isinstance(small, Plan) and small.total_seconds < best.total_seconds:
            best = small
    return best


def _rebalance(
    cfg: ModelConfig, work: Work, machine: Machine, sizes: tuple[int, ...], p: Plan, ram: int, gpu: int, cap: int
) -> Plan:
    """Grow the batch between the found power of two and the cap, then even out the batches."""
    lo, hi = p.batch_size, min(cap, 2 * p.batch_size - 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        got = _try_batch(cfg, work, machine, sizes, p, mid, ram, gpu)
        lo, hi = (mid, hi) if isinstance(got, Plan) else (lo, mid - 1)
    batches = math.ceil(work.num_prompts / lo)
    even = math.ceil(work.num_prompts / batches)
    final = _try_batch(cfg, work, machine, sizes, p, even, ram, gpu)
    return final if isinstance(final, Plan) else p


def _try_batch(
    cfg: ModelConfig, work: Work, machine: Machine, sizes: tuple[int, ...], p: Plan, batch: int, ram: int, gpu: int
) -> Plan | str:
    """:func:`_try` with ``p``'s choices (dtypes, homes, int8 share) at another batch size."""
    return _try(
        cfg, work, machine, sizes, p.weight_dtype, p.compute_dtype, p.weight_home, p.kv, batch, ram, gpu, p.int8_share
    )


def _try(
    cfg: ModelConfig,
    work: Work,
    machine: Machine,
    sizes: tuple[int, ...],
    weight_dtype: str,
    cdtype: str,
    home: Home,
    kv: tuple[Literal["device", "cpu"], str],
    batch: int,
    ram_cap: int,
    gpu_cap: int,
    int8_share: float = 0.0,
) -> Plan | str:
    """The plan for exactly this batch with the KV cache ``kv`` = (home, dtype), or why it does not fit.

    ``sizes`` are the stored bytes of each layer: a slot holds the largest, a home the ones it homes;
    ``int8_share`` of an int4 store's matrix parameters are int8.
    """
    kv_home, kv_dtype = kv
    L, c = cfg.num_layers, DTYPE_BYTES[cdtype]
    kv_elem = kv_bits_per_value(kv_dtype, cfg.head_dim) / 8 if kv_dtype in KV_QUANTIZED else DTYPE_BYTES[kv_dtype]
    lb = max(sizes)
    converts = weight_dtype != cdtype
    cuda = machine.has_gpu
    fused = not cuda and fused_on_cpu(weight_dtype, cdtype)
    # CPU: the reader converts the next layer while this one computes, one buffer set per slot; the fused path
    # (and CUDA) dequantizes on the compute thread, if ever, into one set.
    compute_buffers = layer_params(cfg) * c * (1 if cuda or fused else 2) if converts else 0
    slots = work.seq_slots
    kv_total = int(kv_bytes(cfg, batch, slots, kv_elem) + kv_bytes(cfg, 1, work.shared_prefix_tokens, kv_elem))
    ram: dict[str, int] = {"process": PROCESS_BASE_BYTES + (CUDA_HOST_BYTES if cuda else 0)}
    gpu: dict[str, int] = {"cuda context": CUDA_CONTEXT_BYTES} if cuda else {}
    compute_tier = gpu if cuda else ram
    if home == "ram":
        ram["weights (RAM home)"] = sum(sizes)
    else:
        # Pinned on CUDA, where each slot takes the power of two above it.
        ram["staging slots"] = 2 * (pinned_bytes(lb + SLOT_HEADER_BYTES) if cuda else lb)
    host_embedding = 0 if embedding_is_head(cfg) or not cuda else embedding_params(cfg) * c
    compute_tier["resident modules"] = resident_params(cfg) * c - host_embedding
    if host_embedding:
        ram["embedding (lookup)"] = host_embedding
    if cuda:
        gpu["layer slots"] = 2 * lb
    compute_tier["compute buffers"] = compute_buffers
    (compute_tier if kv_home == "device" else ram)["KV cache"] = kv_total
    # Logits come back to RAM in fp32: the last position per row while generating; every position of
    # every label continuation (plus its log-softmax) while scoring a stance.
    ram["logits"] = 2 * batch * max(1, work.stance_tokens) * cfg.vocab_size * 4
    cap = gpu_cap if cuda else ram_cap
    # The largest prefill micro-batch whose activations fit next to everything else.
    fixed = sum(compute_tier.values())
    mean_slots = work.prompt_tokens + work.max_new_tokens / 2
    attention_home = decode_attention(cfg, machine, kv, kv_elem, batch, mean_slots)[0]
    if (cuda and kv_home == "cpu") or kv_dtype in KV_QUANTIZED:
        # One layer's K/V of the whole batch for a decode step's attention: in the compute dtype where
        # it computes (copied up, dequantized, or both), or in fp32 in RAM where the cache attends.
        attend_values = 2 * batch * slots * cfg.num_key_value_heads * cfg.head_dim
        if attention_home == "kv":
            ram["decode attention K/V"] = attend_values * 4
        else:
            fixed += attend_values * c
    P, T = work.prompt_tokens, work.stance_tokens
    decode_act = activation_bytes(cfg, batch, batch, 1, slots, c)

    def activations(rows: int) -> int:
        # Prefill and the stance pass are split into micro-batches of ``rows`` rows alike.
        scoring = activation_bytes(cfg, batch, rows, T, slots, c) if T else 0
        return max(activation_bytes(cfg, batch, rows, P, P, c), scoring, decode_act)

    micro = next((rows for rows in range(batch, 0, -1) if fixed + activations(rows) <= cap), 0)
    tier_name = "GPU memory" if cuda else "RAM"
    if not micro:
        return f"batch {batch} needs {_fmt(fixed + activations(1))} of {tier_name}, {_fmt(cap)} usable"
    compute_tier["activations"] = activations(micro)
    ram_layers = L if home == "ram" else 0
    if home == "split":
        # What RAM has left holds the first layers (the engine's order); the rest stream from disk.
        left = ram_cap - sum(ram.values())
        ram_layers = sum(1 for held in itertools.accumulate(sizes[: L - 1]) if held <= left)
        if ram_layers < 1:
            return f"batch {batch} leaves no RAM for a layer ({_fmt(sizes[0])})"
        ram["weights (RAM part)"] = sum(sizes[:ram_layers])
    if sum(ram.values()) > ram_cap:
        return f"batch {batch} needs {_fmt(sum(ram.values()))} of RAM, {_fmt(ram_cap)} usable"
    memory = {"gpu": gpu, "ram": ram} if cuda else {"ram": ram}
    memory["disk"] = {"weight store": sum(sizes) + resident_params(cfg) * 2}
    capacity = {"ram": ram_cap, **({"gpu": gpu_cap} if cuda else {})}
    timing = PassTiming(
        cfg, machine, layer_params(cfg), sizes, converts, cdtype, ram_layers, kv, kv_elem, weight_dtype, int8_share
    )
    prefill = timing.pass_seconds(batch, P, P)
    decode = timing.pass_seconds(batch, 1, mean_slots)
    stance = timing.pass_seconds(batch, T, slots) if T else 0.0
    notes = []
    if ram_layers < L:
        streamed = sum(sizes[ram_layers:])
        notes.append(f"streams {_fmt(streamed)} of weights from disk per pass at {machine.disk_read_bps / GB:.1f} GB/s")
    if T:
        notes.append(f"stance: from each row's KV cache, one more pass of the batch over {T} cue and label tokens")
    return Plan(
        device="cuda" if cuda else "cpu",
        weight_dtype=weight_dtype,
        compute_dtype=cdtype,
        batch_size=batch,
        weight_home=home,
        kv_home=kv_home,
        kv_dtype=kv_dtype,
        micro_batch=micro,
        memory=memory,
        capacity=capacity,
        prefill_seconds=prefill,
        decode_seconds=decode,
        num_batches=math.ceil(work.num_prompts / batch),
        work=work,
        notes=notes,
        ram_layers=ram_layers,
        threads=machine.compute_threads,
        stance_seconds=stance,
        attention_home=attention_home,
        int8_share=int8_share,
    )
