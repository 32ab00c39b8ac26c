"""Large reads with many requests in flight: what an NVMe drive needs to reach its bandwidth.

One synchronous reader keeps one request outstanding at a time; a fast drive
(and a virtual disk in front of one) reaches its rated bandwidth only with
16-32 requests queued, as ``fio --iodepth`` shows. :func:`read_span` cuts a
span into aligned chunks and issues them from a pool of threads: each thread
sits in ``preadv`` (which releases the GIL; with O_DIRECT the drive DMAs into
the buffer, so the waiting costs no CPU), so ``depth`` threads keep ``depth``
requests in flight. No extra dependency (io_uring / libaio bindings) is needed.
:func:`huge_page_buffer` is the memory the weights a decode step reads whole are held in.
"""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

#: Requests in flight by default (fio's knee on NVMe and virtio disks is 16-32).
DEFAULT_DEPTH = 16
#: Chunks are at least this large (smaller requests waste the drive's per-request budget) ...
MIN_CHUNK = 1 << 20
#: ... and at most this large (so a layer of a few hundred MB still spreads over ``depth`` requests).
MAX_CHUNK = 16 << 20
#: Alignment O_DIRECT needs for buffer addresses, file offsets and lengths (chunks keep it).
DIRECT_ALIGN = 4096
#: A transparent huge page on x86-64 and arm64 Linux (the kernel's default size).
HUGE_PAGE = 2 << 20
#: The bandwidth probe's buffer at most (4 MiB requests at depth 16): a night measures its disk before the
#: model loads, and the probe must not raise the process's peak memory above what the plan allows for.
PROBE_WINDOW = 64 << 20


def round_up(n: int, align: int = DIRECT_ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align`` (O_DIRECT's alignment by default)."""
    return -(-n // align) * align


def huge_page_buffer(nbytes: int) -> Tensor:
    """A zeroed uint8 CPU tensor of ``nbytes`` at a multiple of :data:`HUGE_PAGE`, in anonymous memory the kernel is
    asked to back with huge pages (``madvise(MADV_HUGEPAGE)`` before the first touch: honoured where Linux's
    transparent huge pages are ``madvise`` or ``always``, plain pages elsewhere). For what a decode step reads whole
    every step, the RAM-homed layers and the int8 head (Gemma 3 270M: about 270 MB, some 66,000 small pages): fewer
    page walks beside the product's reads. Untouched pages take no memory; the last huge page may take up to 2 MiB past
    ``nbytes``. The tensor (and every view of it) holds the mapping."""
    import torch

    # Private: a shared anonymous mapping is shmem, whose huge pages another switch (shmem_enabled, mostly never) gates.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    return raw[skip : skip + nbytes]


def io_pool(depth: int = DEFAULT_DEPTH) -> ThreadPoolExecutor:
    """A pool of ``depth`` reader threads for :func:`read_span`."""
    if depth < 1:
        raise ValueError(f"read depth must be >= 1, got {depth}")
    return ThreadPoolExecutor(max_workers=depth, thread_name_prefix="disk-io")


def chunk_size(length: int, depth: int) -> int:
    """Chunk length that spreads ``length`` bytes over about ``depth`` aligned requests."""
    per_request = -(-length // max(depth, 1))
    return min(MAX_CHUNK, max(MIN_CHUNK, round_up(per_request)))


def _pread_full(fd: int, view: memoryview, offset: int) -> int:
    """Read until ``view`` is full or the file ends; returns the bytes read."""
    pos = 0
    while pos < len(view):
        n = os.preadv(fd, [view[pos:]], offset + pos)
        if n <= 0:
            break
        pos += n
    return pos


def read_span(fd: int, view: memoryview, start: int, pool: Executor | None = None, depth: int = 1) -> int:
    """Read ``len(view)`` bytes of ``fd`` from offset ``start`` into ``view``; returns the bytes read.

    With a ``pool`` the span is read as aligned chunks, ``depth`` at a time
    (the pool should have that many threads). Fewer bytes than asked means the
    file ended early; a chunk that stops short is followed only by empty ones.
    """
    length = len(view)
    if pool is None or depth <= 1 or length <= MIN_CHUNK:
        return _pread_full(fd, view, start)
    step = chunk_size(length, depth)
    futures = [pool.submit(_pread_full, fd, view[pos : pos + step], start + pos) for pos in range(0, length, step)]
    # Every request ends before any error is raised: the caller then closes ``fd``, and a request still in
    # flight would read whatever file reuses that number into a buffer a retry is already filling.
    wait(futures)
    return sum(f.result() for f in futures)


def drop_page_cache(paths: list[Path]) -> None:
    """Ask the kernel to evict these files from the page cache (honest disk-read measurements)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure_read_bandwidth(path: str | Path, depth: int = DEFAULT_DEPTH, max_bytes: int | None = None) -> float:
    """Raw sequential read bandwidth of one file in bytes/s: O_DIRECT, ``depth`` large requests in
    flight like fio's ``--iodepth`` (page cache dropped first and after; buffered where O_DIRECT is refused).
    ``max_bytes`` stops at the first window that reaches that many bytes.

    The buffer is an anonymous mapping (page-aligned, as O_DIRECT needs), so this imports no torch.
    """
    path = Path(path)
    drop_page_cache([path])
    size = round_up(path.stat().st_size)
    window = mmap.mmap(-1, max(DIRECT_ALIGN, min(depth * MAX_CHUNK, size, PROBE_WINDOW)))
    view = memoryview(window)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    total = 0
    pool = io_pool(depth)
    try:
        started = time.perf_counter()
        while (max_bytes is None or total < max_bytes) and (n := read_span(fd, view, total, pool, depth)):
            total += n
        elapsed = time.perf_counter() - started
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        pool.shutdown()
        os.close(fd)
        view.release()
        window.close()
    return total / max(elapsed, 1e-9)
