"""Weight store: convert (fp16/bf16/int8/int4), verify, resume after interruption, disk-space refusal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from robot_llm.llm.families.yalm import YalmConfig
from robot_llm.llm.store.checkpoint import module_plan
from robot_llm.llm.store.layout import SCALE_SUFFIX, StoreError
from robot_llm.llm.store.reader import MANIFEST, PROGRESS, Store, StoreFile, read_manifest, sha256_file, verify
from robot_llm.llm.store.writer import convert


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "int8", "int4"])
def test_convert_writes_one_file_per_module_and_a_manifest(
    stores: dict[str, Path], tiny_config: YalmConfig, dtype: str
) -> None:
    store = stores[dtype]
    manifest = json.loads((store / MANIFEST).read_text())
    assert manifest["dtype"] == dtype
    assert manifest["config"] == tiny_config.to_dict()
    assert [f["name"] for f in manifest["files"]] == [
        "embedding.safetensors",
        "projector.safetensors",
        "layer_000.safetensors",
        "layer_001.safetensors",
        "output.safetensors",
    ]
    for f in manifest["files"]:
        assert (store / f["name"]).stat().st_size == f["size"]
        assert sha256_file(store / f["name"]) == f["sha256"]
    assert (manifest["quantization"] is not None) == (dtype in ("int8", "int4"))
    assert verify(store) == []
    layer = Store(store).load("layer", 1)
    if dtype == "int8":
        # Per output channel, as torch._weight_int8pack_mm takes it: int8 [N, K] and a bf16 scale per row.
        assert layer["attention.dense.weight"].dtype == torch.int8
        assert layer["attention.dense.weight" + SCALE_SUFFIX].dtype == torch.bfloat16
        assert layer["attention.dense.weight" + SCALE_SUFFIX].shape == (64,)
        assert layer["attention.dense.bias"].dtype == torch.float16
    elif dtype == "int4":
        # 64x64 weights in one group of 64 (a float source's default) per row: 32 bytes of codes per row
        # and a bf16 scale and zero per group, as torch._weight_int4pack_mm_for_cpu takes them.
        assert layer["attention.dense.weight"].dtype == torch.uint8
        assert layer["attention.dense.weight"].shape == (64, 32)
        assert layer["attention.dense.weight" + SCALE_SUFFIX].shape == (1, 64, 2)
        assert Store(store).layout("layer", 1).shape("attention.dense.weight") == (64, 64)
    else:
        assert all(t.dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype] for t in layer.values())


def test_fp16_store_holds_the_release_tensors_exactly(stores: dict[str, Path], reference_weights: dict) -> None:
    store = Store(stores["fp16"])
    for kind, index, _, _ in module_plan(store.config):
        loaded = store.load(kind, index)
        assert loaded.keys() == reference_weights[(kind, index)].keys()
        for key, tensor in loaded.items():
            assert torch.equal(tensor, reference_weights[(kind, index)][key])


@pytest.fixture(scope="module")
def reference_weights(tiny_dir: Path, tiny_config: YalmConfig) -> dict:
    from robot_llm.llm.store.checkpoint import iter_release_modules

    return {(kind, index): params for kind, index, params in iter_release_modules(tiny_dir, tiny_config)}


def test_verify_detects_a_corrupted_file(stores: dict[str, Path], tmp_path: Path) -> None:
    store = tmp_path / "store"
    shutil.copytree(stores["fp16"], store)
    path = store / "layer_001.safetensors"
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x40  # one flipped bit in a weight
    path.write_bytes(bytes(data))
    (store / "projector.safetensors").unlink()
    problems = verify(store)
    assert any("layer_001.safetensors: sha256 mismatch" in p for p in problems)
    assert any("projector.safetensors: missing" in p for p in problems)
    assert len(problems) == 2


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_interrupted_conversion_resumes_without_redoing_finished_files(
    stores: dict[str, Path], tiny_dir: Path, tmp_path: Path, dtype: str
) -> None:
    store = tmp_path / "store"
    finished: list[str] = []

    def stop_after_two(entry: StoreFile, done: int, total: int) -> None:
        finished.append(entry.name)
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(tiny_dir, store, dtype=dtype, on_file=stop_after_two)
    assert finished == ["embedding.safetensors", "projector.safetensors"]
    assert not (store / MANIFEST).exists() and (store / PROGRESS).exists()
    with pytest.raises(StoreError, match="run convert again to resume"):
        read_manifest(store)
    before = {name: (store / name).stat().st_mtime_ns for name in finished}
    (store / "layer_000.safetensors.partial").write_bytes(b"half a file")  # killed mid-write

    reported: list[str] = []
    manifest = convert(tiny_dir, store, dtype=dtype, on_file=lambda e, d, t: reported.append(e.name))
    assert reported[:2] == finished and len(reported) == 5
    assert {name: (store / name).stat().st_mtime_ns for name in finished} == before
    assert not list(store.glob("*.partial")) and not (store / PROGRESS).exists()
    assert verify(store) == []
    # Same bytes as an uninterrupted conversion (int4: its shape metadata included).
    assert manifest.to_json() == read_manifest(stores[dtype]).to_json()


def test_conversion_is_refused_when_the_disk_is_too_small(tiny_dir: Path, tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(StoreError, match="not enough disk space"):
        convert(tiny_dir, tmp_path / "store", reserve_bytes=free)
    assert list((tmp_path / "store").iterdir()) == []


def test_int4_group_size_must_be_one_the_kernel_takes(tiny_dir: Path, tmp_path: Path) -> None:
    # Round trips, the kernel layout and odd shapes: tests/engine/test_quant.py.
    with pytest.raises(StoreError, match=r"group size must be one of 32, 64, 128"):
        convert(tiny_dir, tmp_path / "store", dtype="int4", group_size=256)
    assert not (tmp_path / "store" / MANIFEST).exists()
