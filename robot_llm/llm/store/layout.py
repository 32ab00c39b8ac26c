"""One store file on disk: its safetensors layout, written aligned and read straight into buffers.

Each store file is a safetensors file whose data section and quantized matrices start
at multiples of ``ALIGN``, so the fused kernels can be handed views of the bytes as read.
This module owns that byte layout in both directions (:func:`save_aligned` writes it,
:class:`FileLayout` parses its header) and the reads of it: :func:`read_into` with
O_DIRECT into :func:`aligned_buffer` memory (many requests in flight via
:mod:`robot_llm.llm.store.diskio`), page-cache eviction and the raw bandwidth probe.
The manifest and the folder of files are :mod:`robot_llm.llm.store.reader`'s; converting
into one is :mod:`robot_llm.llm.store.writer`'s.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from robot_llm.errors import RobotLLMError
from robot_llm.llm.families.family import Params
from robot_llm.llm.store.diskio import DIRECT_ALIGN, read_span, round_up
from robot_llm.llm.store.quant import ALIGN

#: Suffix of the scale tensor that accompanies a quantized matrix (int8: bf16 ``[N]``; int4: the
#: kernel's bf16 ``scales_and_zeros [Kp / group, Np, 2]``).
SCALE_SUFFIX = ".qscale"
#: Safetensors metadata key of a quantized file: JSON ``{key: logical shape}`` of its packed matrices.
LOGICAL_SHAPES = "logical_shapes"

_SAFETENSORS_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int8: "I8",
    torch.uint8: "U8",
}
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I8": torch.int8,
    "U8": torch.uint8,
}


class StoreError(RobotLLMError):
    """A store cannot be written or used as it is; the message says why.

    Defined in this, the lowest of the store modules, so that the reader, the writer and
    the reads all raise the one error without importing each other in a circle.
    """


def save_aligned(tensors: Params, path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file (fsynced) whose data section and quantized matrices start at multiples of ALIGN.

    The fused kernels are handed views of the bytes as read (the int8 kernel crashes on weights
    not 16-byte aligned); slots and RAM homes are allocated aligned, so aligned file offsets
    suffice. The quantized matrices (sizes multiples of ALIGN) come first, then the
    rest by element size, then by name; the header is padded with spaces, as the format allows.
    """
    order = sorted(tensors, key=lambda k: (k + SCALE_SUFFIX not in tensors, -tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key in order:
        t = tensors[key]
        header[key] = {
            "dtype": _SAFETENSORS_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for key in order:
            f.write(memoryview(tensors[key].contiguous().reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor sits inside a file's data section."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class FileLayout:
    """Parsed safetensors header: data section offset/size, tensor slots, quantized matrices' logical shapes."""

    path: Path
    data_offset: int
    data_size: int
    tensors: dict[str, TensorSlot]
    packed_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: The file's first ``data_offset`` bytes as read (the header's length and JSON), for its checksum.
    header: bytes = field(default=b"", repr=False)

    @classmethod
    def read(cls, path: str | Path) -> FileLayout:
        """Parse the header of a safetensors file without reading its data."""
        path = Path(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise StoreError(f"{path}: {len(prefix)} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", prefix)
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except ValueError as exc:  # UnicodeDecodeError included
            raise StoreError(f"{path}: the safetensors header is damaged ({exc})") from None
        if not isinstance(header, dict):
            raise StoreError(f"{path}: the safetensors header is damaged (not a JSON object)")
        try:
            metadata = header.pop("__metadata__", None) or {}
            packed = {k: tuple(v) for k, v in json.loads(metadata.get(LOGICAL_SHAPES, "{}")).items()}
            tensors = {}
            for key, info in header.items():
                if info["dtype"] not in _SAFETENSORS_DTYPES:
                    raise StoreError(f"{path}: unsupported tensor dtype {info['dtype']} for {key!r}")
                start, end = info["data_offsets"]
                tensors[key] = TensorSlot(
                    _SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]), int(start), int(end)
                )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StoreError(f"{path}: the safetensors header is damaged ({type(exc).__name__}: {exc})") from None
        data_size = max((t.end for t in tensors.values()), default=0)
        return cls(
            path=path,
            data_offset=8 + n,
            data_size=data_size,
            tensors=tensors,
            packed_shapes=packed,
            header=prefix + raw,
        )

    def shape(self, key: str) -> tuple[int, ...]:
        """The model's shape of tensor ``key`` (a quantized matrix is stored packed in another shape)."""
        return self.packed_shapes.get(key) or self.tensors[key].shape

    def views(self, buffer: Tensor) -> Params:
        """Tensors viewing a uint8 ``buffer`` that holds this file's data section (no copies)."""
        return {key: buffer[s.start : s.end].view(s.dtype).view(s.shape) for key, s in self.tensors.items()}


def read_pieces(layout: FileLayout, buffer: Tensor, offset: int) -> list[tuple[int, memoryview]]:
    """The file's bytes after :func:`read_into` returned ``offset``, as ``(file offset, bytes)`` pieces.

    A direct read put the whole file at the start of ``buffer``; a buffered one only the data
    section, so the header comes from the layout.
    """
    view = memoryview(buffer.numpy()).cast("B")
    end = layout.data_offset + layout.data_size
    if offset == layout.data_offset:
        return [(0, view[:end])]
    return [(0, memoryview(layout.header)), (layout.data_offset, view[offset : offset + layout.data_size])]


def direct_span(layout: FileLayout) -> int:
    """Bytes a direct read of this file covers (header included, rounded up to the alignment)."""
    return round_up(layout.data_offset + layout.data_size)


def aligned_buffer(nbytes: int, *, pin_memory: bool = False) -> Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose address is aligned for O_DIRECT."""
    raw = torch.empty(nbytes + DIRECT_ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
    skip = -raw.data_ptr() % DIRECT_ALIGN
    return raw[skip : skip + nbytes]


def read_into(
    path: str | Path,
    layout: FileLayout,
    buffer: Tensor,
    *,
    direct: bool = False,
    drop_cache: bool = False,
    pool: Executor | None = None,
    depth: int = 1,
) -> int:
    """Read a file's data section into the uint8 CPU ``buffer``; returns where the data starts in it.

    ``direct`` reads the whole file with O_DIRECT into a buffer from :func:`aligned_buffer`
    (at least :func:`direct_span` bytes): the disk DMAs straight into it, bypassing the page
    cache, and the waiting thread needs no CPU, so reading does not slow down compute on
    the same cores. The data then starts at ``layout.data_offset``. Where the file system
    refuses O_DIRECT (tmpfs) it falls back to a buffered read at offset 0. ``drop_cache``
    makes a buffered read forget the file's pages afterwards, so weights homed on disk
    do not silently occupy RAM as page cache. With a ``pool`` of reader threads the
    file is read as ``depth`` large requests in flight (:func:`robot_llm.llm.store.diskio.read_span`).
    """
    size = layout.data_size
    fd = -1
    if direct:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            fd = -1
    if fd >= 0:
        start, length, offset = 0, direct_span(layout), layout.data_offset
    else:
        fd = os.open(path, os.O_RDONLY)
        start, length, offset = layout.data_offset, size, 0
        os.posix_fadvise(fd, start, size, os.POSIX_FADV_SEQUENTIAL)
    view = memoryview(buffer.numpy()).cast("B")[:length]
    try:
        if read_span(fd, view, start, pool, depth) < offset + size:
            raise StoreError(f"{path}: file is shorter than its header says")
        if drop_cache:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return offset


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` through a fsynced temporary file (never half a file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
