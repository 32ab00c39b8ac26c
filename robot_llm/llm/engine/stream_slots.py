"""What the streaming engine (:mod:`robot_llm.llm.engine.streaming`) stages layers in and counts: a
staging slot per layer in flight, the stream's counters, the read error that fails one forward pass, and the
one-time preparation of a RAM-homed layer for the fused CPU path."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import Tensor

from robot_llm.errors import ModelFault
from robot_llm.llm.families.family import Params
from robot_llm.llm.store.int8act import rotated_int8_copy, rotated_int8_in_place
from robot_llm.llm.store.layout import SCALE_SUFFIX, FileLayout, StoreError
from robot_llm.llm.store.quant import PackedInt4, PackedInt8, int4_kernel_codes


class LayerReadError(StoreError, ModelFault):
    """A layer file stayed unreadable through every retry: that forward pass fails, the engine stays usable."""


#: A RAM-homed layer's one-time work (:func:`prepare_ram_layer`), by key: int4 kernel codes, int8 matrices rotated
#: (and packed) in place, int4 matrices' rotated int8 copies.
Prepared = tuple[Params, dict[str, PackedInt8], dict[str, PackedInt8]]
#: A layer nothing was prepared for (a streamed one).
UNPREPARED: Prepared = ({}, {}, {})


def prepare_ram_layer(layout: FileLayout, data: Tensor, *, repack: bool, rotate: bool) -> Prepared:
    """A RAM-homed layer's one-time work: with ``repack``, its int4 codes in this CPU's kernel layout; with
    ``rotate`` (int8 activations), its int8 matrices rotated (and where our VNNI product serves, packed) in place
    and its int4 ones' rotated int8 copies (made once here, not every prefill pass: 27 int4 matrices of Gemma 3 270M,
    15 MB)."""
    raw = layout.views(data)
    codes = {k: int4_kernel_codes(t) for k, t in raw.items() if t.dtype == torch.uint8} if repack else {}
    if not rotate:
        return codes, {}, {}
    int8 = {k: rotated_int8_in_place(t, raw[k + SCALE_SUFFIX]) for k, t in raw.items() if t.dtype == torch.int8}
    copies = {
        k: rotated_int8_copy(PackedInt4(t, raw[k + SCALE_SUFFIX], tuple(layout.shape(k))[:2]))
        for k, t in raw.items()
        if t.dtype == torch.uint8
    }
    return codes, {k: w for k, w in int8.items() if w is not None}, copies


#: Elements up to which a tensor converted into a slot's buffer is given its own copy, so that its RAM-homed layer's
#: compute weights serve every pass (a norm's gain stored in another dtype than the compute one: 640 in Gemma 3 270M).
OWN_COPY_MAX = 1 << 16


def kept_for_reuse(params: Params, buffers: Params) -> Params | None:
    """A RAM-homed layer's compute weights made to serve every pass, or None where they cannot. Views of its RAM
    bytes and packed matrices serve as they are; a small tensor converted into one of the slot's ``buffers`` (which
    the next layer overwrites) is given its own copy; a large one is not (it would double the layer's memory).
    Rebuilding a Gemma 3 270M layer's weights each pass for its fp32 norm gains cost 3.2 ms a decode step."""
    slot = {b.untyped_storage().data_ptr() for b in buffers.values()}
    kept: Params = {}
    for key, p in params.items():
        if not isinstance(p, (PackedInt4, PackedInt8)) and p.untyped_storage().data_ptr() in slot:
            if p.numel() > OWN_COPY_MAX:
                return None
            p = p.clone()
        kept[key] = p
    return kept


def drop_dense(params: Params) -> Params:
    """A reused layer's weights with what its packed matrices made dense dropped, once the layer has run (and again
    before it runs, after a pass that stopped midway): that was made into buffers every layer shares, or, a rotated
    int8 matrix's, into its own, which would stay resident (a prefill's widened copies: 0.12 GiB for Gemma 3 270M)."""
    for p in params.values():
        if isinstance(p, (PackedInt4, PackedInt8)):
            p._dense = None
        if isinstance(p, PackedInt8):
            p._widened = None
    return params


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` means CUDA when available, else the CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass
class StreamStats:
    """Counters of the weight stream, for progress logs and the benchmark.

    ``read_seconds`` is time spent inside reads (background thread);
    ``wait_seconds`` is time the compute thread sat waiting for a layer that
    was not there yet, i.e. I/O that compute did not hide.
    """

    bytes_read: int = 0
    layers_read: int = 0
    read_seconds: float = 0.0
    wait_seconds: float = 0.0
    read_retries: int = 0
    forward_seconds: float = 0.0
    forwards: int = 0

    @property
    def read_bandwidth(self) -> float:
        """Bytes per second while reading."""
        return self.bytes_read / self.read_seconds if self.read_seconds else 0.0

    @property
    def io_hidden_fraction(self) -> float:
        """Share of read time overlapped with compute (1 = the stream never stalled compute)."""
        if not self.read_seconds:
            return 1.0
        return max(0.0, 1.0 - self.wait_seconds / self.read_seconds)


@dataclass
class Slot:
    """One staging slot: host bytes (disk home), device bytes (CUDA) and the event guarding reuse.

    On the CPU, ``buffers`` are the slot's own compute-dtype tensors and
    ``params`` the layer's weights ready for compute, set by the reader.
    """

    host: Tensor | None
    device: Tensor | None
    free: torch.cuda.Event | None = None
    ready: Future[int] | None = field(default=None, repr=False)
    layer: int = -1
    offset: int = 0  # where the layer's data section starts in the slot
    buffers: Params = field(default_factory=dict, repr=False)
    params: Params | None = field(default=None, repr=False)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's; musl and other C libraries have none
    except (OSError, AttributeError):
        return None


def trim_heap() -> bool:
    """Hand the pages of what the allocator holds freed back to the system (glibc's ``malloc_trim``; elsewhere
    nothing); True where some were. A CPU prefill's temporaries (tens of MB a layer, in sizes glibc keeps on its
    heap once its dynamic mmap threshold has risen) stay resident when freed, and the KV cache grows beside them:
    Gemma 3 270M int4, fp32 compute, batch 32, prompt 512, 2 threads, peak RSS 1.20 GiB, 1.07 trimmed after each
    layer of the prefill, 1.06 after each layer of each micro-batch (which cost 16 % of the prefill in page
    faults). Opening a quantized store converts tables and layers through such temporaries too (the LM head, the
    rotated int8 matrices of :mod:`robot_llm.llm.store.int8act`): peak RSS at batch 32 1.36 GiB untrimmed after
    opening, against 1.20 GiB weight-only."""
    trim = _malloc_trim()
    return trim is not None and bool(trim(0))
