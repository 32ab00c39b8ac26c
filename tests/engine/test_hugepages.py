"""Huge-page memory for the weights a decode step reads whole: the RAM-homed layers and the int8 head."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from robot_llm.llm.engine.streaming import StreamingModel
from robot_llm.llm.store.diskio import HUGE_PAGE, huge_page_buffer
from robot_llm.llm.store.qhead import QuantizedTable

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (``hg``: advised as huge pages)."""
    flags: set[str] | None = None
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            flags = set(line.split()[1:])
    assert flags is not None, f"no mapping holds {address:#x}"
    return flags


def _advised(address: int) -> bool:
    """Whether ``address`` lies in private memory advised as huge pages (a shared anonymous mapping is shmem, which
    the advice alone does not give them)."""
    flags = _vm_flags(address)
    return "hg" in flags and "sh" not in flags


def test_a_huge_page_buffer_is_aligned_zeroed_writable_and_outlives_its_base() -> None:
    for nbytes in (1, 4096, HUGE_PAGE + 12345):
        buf = huge_page_buffer(nbytes)
        assert buf.dtype == torch.uint8 and buf.shape == (nbytes,) and buf.data_ptr() % HUGE_PAGE == 0
        assert int(buf.count_nonzero()) == 0
        buf[-1] = 7
        view = buf.view(-1)[-1:]
        del buf
        gc.collect()
        assert int(view) == 7  # the mapping lives while a view does


@linux_only
def test_a_huge_page_buffer_is_advised_as_huge_pages() -> None:
    buf = huge_page_buffer(3 * HUGE_PAGE)
    assert _advised(buf.data_ptr())
    plain = torch.empty(3 * HUGE_PAGE, dtype=torch.uint8)
    assert not _advised(plain.data_ptr())  # the check tells the two apart


@linux_only
def test_the_engine_holds_its_ram_layers_and_int8_head_in_huge_page_memory(stores: dict[str, Path]) -> None:
    model = StreamingModel(stores["int8"], home="ram", device="cpu")
    try:
        held = [t for t in model.ram if t is not None]
        assert len(held) == model.config.num_layers
        # One arena: each layer after the one before, at an O_DIRECT-aligned start.
        starts = [t.data_ptr() for t in held]
        assert starts[0] % HUGE_PAGE == 0 and all(s % 4096 == 0 for s in starts)
        assert starts == sorted(starts) and all(_advised(s) for s in starts)
        tables = [t for params in model.resident.values() for t in params.values() if isinstance(t, QuantizedTable)]
        assert tables and all(_advised(t.q.data_ptr()) for t in tables)
        ids = torch.randint(3, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
        assert torch.isfinite(model.forward(ids)).all()
    finally:
        model.close()
