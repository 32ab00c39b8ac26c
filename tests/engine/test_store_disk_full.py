"""Disk full, for real: a weight-store conversion on a small tmpfs.

The error is one clear line, nothing half-written is taken as valid, and freeing space then
rerunning completes. The ``small_disk`` fixture mounts the tmpfs (root only; skipped, saying so, otherwise).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from robot_llm.llm.store.layout import StoreError
from robot_llm.llm.store.reader import MANIFEST, PROGRESS, read_manifest, verify
from robot_llm.llm.store.writer import convert
from tests.conftest import fill_disk


def test_store_conversion_on_a_full_disk_fails_clearly_keeps_nothing_half_written_and_resumes(
    small_disk, tiny_dir, stores
):
    store = small_disk / "store"
    sizes = read_manifest(stores["fp16"]).files
    first_two = sum(f.size for f in sizes[:2])
    filled: list[Path] = []

    def disk_fills_after_two(entry, done, total) -> None:
        if done == 2 and not filled:  # another process takes the rest of the disk
            filled.append(fill_disk(small_disk, leave=4096))

    with pytest.raises(StoreError) as info:
        convert(tiny_dir, store, dtype="fp16", reserve_bytes=0, on_file=disk_fills_after_two)
    message = str(info.value)
    assert "\n" not in message and "No space left on device" in message and "run convert again" in message
    assert not (store / MANIFEST).exists()  # an unfinished store is never taken for a complete one
    assert not list(store.glob("*.partial"))
    with pytest.raises(StoreError, match="run convert again to resume"):
        read_manifest(store)
    assert sum(p.stat().st_size for p in store.glob("*.safetensors")) == first_two

    os.unlink(filled[0])
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    manifest = convert(tiny_dir, store, dtype="fp16", reserve_bytes=0)
    assert verify(store) == [] and not (store / PROGRESS).exists()
    assert manifest.to_json() == read_manifest(stores["fp16"]).to_json()
