"""Reads with many requests in flight: same bytes as one sequential read, depth really reached, short files refused."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from robot_llm.llm.store import diskio
from robot_llm.llm.store.diskio import MIN_CHUNK, chunk_size, io_pool, read_span
from robot_llm.llm.store.layout import FileLayout, StoreError, aligned_buffer, direct_span, read_into


def _file(path: Path, size: int) -> bytes:
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size)).numpy()
    path.write_bytes(data.tobytes())
    return data.tobytes()


def test_chunks_are_aligned_and_bounded() -> None:
    assert chunk_size(200 << 20, 16) == 25 << 19  # 12.5 MiB: a 200 MB layer over 16 requests
    assert chunk_size(3 << 20, 16) == MIN_CHUNK
    assert chunk_size(1 << 30, 16) == diskio.MAX_CHUNK
    assert chunk_size((5 << 20) + 1, 2) % 4096 == 0


@pytest.mark.parametrize("depth", [1, 3, 8])
def test_parallel_read_returns_the_same_bytes(tmp_path: Path, depth: int) -> None:
    data = _file(tmp_path / "f", (6 << 20) + 12345)  # ends mid-chunk
    view = memoryview(bytearray(len(data) + 4096))
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    pool = io_pool(depth)
    try:
        assert read_span(fd, view, 0, pool, depth) == len(data)  # asked for more than the file holds
        assert bytes(view[: len(data)]) == data
        assert read_span(fd, view[:1000], 5000, pool, depth) == 1000
        assert bytes(view[:1000]) == data[5000:6000]
    finally:
        pool.shutdown()
        os.close(fd)


def test_the_requested_depth_is_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _file(tmp_path / "f", 8 << 20)
    real, lock = os.preadv, threading.Lock()
    active, peak = 0, 0
    all_queued = threading.Event()

    # A drive that answers once 4 requests are queued (or after 10 s): with a fixed 20 ms per
    # request, a loaded machine started the 4th reader thread after the 1st had its answer (peak 3).
    def slow_preadv(fd: int, buffers: list, offset: int) -> int:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
            if active == 4:
                all_queued.set()
        all_queued.wait(10)
        with lock:
            active -= 1
        return real(fd, buffers, offset)

    monkeypatch.setattr(diskio.os, "preadv", slow_preadv)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    pool = io_pool(4)
    try:
        assert read_span(fd, memoryview(bytearray(8 << 20)), 0, pool, 4) == 8 << 20
    finally:
        pool.shutdown()
        os.close(fd)
    assert peak == 4


def test_a_truncated_layer_file_is_refused_with_parallel_reads(stores: dict[str, Path], tmp_path: Path) -> None:
    source = stores["fp16"] / "layer_001.safetensors"
    layout = FileLayout.read(source)
    target = tmp_path / "layer_001.safetensors"
    target.write_bytes(source.read_bytes()[: layout.data_offset + layout.data_size // 2])
    pool = io_pool(4)
    try:
        with pytest.raises(StoreError, match="shorter than its header says"):
            read_into(target, layout, aligned_buffer(direct_span(layout)), direct=True, pool=pool, depth=4)
    finally:
        pool.shutdown()


def test_read_bandwidth_is_measured_over_the_whole_file_without_torch(tmp_path: Path) -> None:
    # The probe `doctor` and a night's plan run: O_DIRECT into an anonymous mapping, no torch imported.
    _file(tmp_path / "layer", (5 << 20) + 4097)  # not a multiple of the alignment
    code = (
        "import sys; from robot_llm.llm.store.diskio import measure_read_bandwidth as m; "
        f"bps = m({str(tmp_path / 'layer')!r}, depth=4); "
        "assert 'torch' not in sys.modules, 'torch imported'; print(bps)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout) > 0


def test_read_bandwidth_probe_stops_near_its_byte_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _file(tmp_path / "big", 40 << 20)
    asked: list[int] = []
    real = diskio.read_span

    def counting(fd: int, view: memoryview, start: int, pool: object, depth: int) -> int:
        n = real(fd, view, start, pool, depth)  # type: ignore[arg-type]
        asked.append(n)
        return n

    monkeypatch.setattr(diskio, "read_span", counting)
    assert diskio.measure_read_bandwidth(tmp_path / "big", depth=1, max_bytes=5 << 20) > 0
    assert asked == [diskio.MAX_CHUNK]  # one window (16 MiB at depth 1) reaches the 5 MiB limit: it stops there
    asked.clear()
    diskio.measure_read_bandwidth(tmp_path / "big", depth=1)
    assert sum(asked) == 40 << 20  # no limit: the whole file
    asked.clear()
    monkeypatch.setattr(diskio, "PROBE_WINDOW", 8 << 20)
    diskio.measure_read_bandwidth(tmp_path / "big", depth=16)
    assert max(asked) == 8 << 20 and sum(asked) == 40 << 20  # reads never exceed the window, whatever the depth


def test_a_night_plans_with_the_disk_measured_under_its_store(tmp_path: Path) -> None:
    from robot_llm.llm.engine import runtime

    tiny, big = tmp_path / "tiny", tmp_path / "big"
    tiny.mkdir()
    big.mkdir()
    _file(tiny / "layer_0.safetensors", 1 << 20)
    (tiny / "manifest.json").write_text("{}")
    assert runtime.store_read_bps(tiny) is None  # a small file measures latency: the default rate stays
    with open(big / "layer_0.safetensors", "wb") as f:
        f.truncate(runtime.PROBE_MIN_BYTES)  # sparse: reads are fast and harmless
    _file(big / "small", 4096)
    measured = runtime.store_read_bps(big)
    assert measured is not None and measured > 0
    assert runtime.store_read_bps(big) == measured  # measured once per process
    settings = runtime.ModelSettings(vocab=tmp_path / "v", store=big)
    assert runtime.machine_for(settings).disk_read_bps == measured
    assert runtime.night_machine(settings)[1]["disk_read_bps"] == "measured under the store"
    too_small = runtime.ModelSettings(vocab=tmp_path / "v", store=tiny)
    assert runtime.night_machine(too_small)[1]["disk_read_bps"] == "assumed; the store's files are too small to measure"
    # Weights pinned in RAM are read from disk once: the plan does not need the disk's rate.
    in_ram = runtime.ModelSettings(vocab=tmp_path / "v", store=big, home="ram")
    default = runtime.Machine(ram_bytes=1).disk_read_bps
    assert measured != default and runtime.machine_for(in_ram).disk_read_bps == default
