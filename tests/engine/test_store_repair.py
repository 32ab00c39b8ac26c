"""`model convert` repairs a damaged store (it used to return early on its manifest) and takes
the release's weights/ subfolder as well as the release folder itself."""

from __future__ import annotations

import shutil
from pathlib import Path

from robot_llm.commands.main import main
from robot_llm.llm.store.reader import MANIFEST, PROGRESS, read_manifest, verify


def test_convert_again_repairs_a_truncated_and_a_missing_file(
    stores: dict[str, Path], tiny_dir: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    shutil.copytree(stores["fp16"], store)
    truncated, missing = store / "layer_001.safetensors", store / "projector.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:1000])
    missing.unlink()
    intact = {p.name: p.stat().st_mtime_ns for p in store.glob("*.safetensors")}
    del intact[truncated.name]
    assert len(verify(store)) == 2

    assert main(["model", "convert", str(tiny_dir), str(store), "--dtype", "fp16"]) == 0
    assert verify(store) == []
    assert read_manifest(store).to_json() == read_manifest(stores["fp16"]).to_json()
    # Only the damaged files were written again.
    assert {name: (store / name).stat().st_mtime_ns for name in intact} == intact
    assert (store / MANIFEST).is_file() and not (store / PROGRESS).exists()


def test_convert_takes_the_weights_subfolder(stores: dict[str, Path], tiny_dir: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    assert main(["model", "convert", str(tiny_dir / "weights"), str(store), "--dtype", "fp16"]) == 0
    assert verify(store) == [] and read_manifest(store).to_json() == read_manifest(stores["fp16"]).to_json()
