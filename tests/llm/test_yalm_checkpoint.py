"""The release checkpoint reader: layout, refusals naming file and key, extra keys, pickles."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest
import torch

from robot_llm.errors import RobotLLMError
from robot_llm.llm.families.yalm import YalmConfig
from robot_llm.llm.store.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    iter_release_modules,
    load_release,
    module_plan,
    read_module,
    save_release,
)

LAYER_04 = "layer_04-model_00-model_states.pt"


@pytest.fixture
def weights(tmp_path: Path, tiny_dir: Path) -> Path:
    """A writable copy of the fixture's weights folder."""
    target = tmp_path / "weights"
    shutil.copytree(tiny_dir / "weights", target)
    for f in target.iterdir():
        f.chmod(0o644)
    return target


def _rewrite(path: Path, edit: dict[str, object], drop: str | None = None) -> None:
    state = torch.load(path, weights_only=True)
    if drop is not None:
        del state[drop]
    state.update(edit)
    torch.save(state, path)


def test_plan_follows_release_numbering(tiny_config: YalmConfig) -> None:
    names = [name for _, _, name, _ in module_plan(tiny_config)]
    assert [n[6:8] for n in names] == ["00", "01", "03", "04", "06"]
    kinds = [(k, i) for k, i, _, _ in module_plan(tiny_config)]
    assert kinds == [("embedding", 0), ("projector", 0), ("layer", 0), ("layer", 1), ("output", 0)]
    assert "input_layernorm.weight" not in tiny_config.layer_shapes(0)
    assert "input_layernorm.weight" in tiny_config.layer_shapes(1)


def test_release_parameter_count() -> None:
    cfg = YalmConfig.preset("yalm-100b")
    total = sum(torch.Size(s).numel() for m in cfg.resident_shapes().values() for s in m.values())
    total += sum(torch.Size(s).numel() for i in range(cfg.num_layers) for s in cfg.layer_shapes(i).values())
    assert total == 100_961_568_640


def test_iterates_one_module_at_a_time(tiny_dir: Path, tiny_config: YalmConfig) -> None:
    seen = [(kind, index, sorted(params)) for kind, index, params in iter_release_modules(tiny_dir, tiny_config)]
    assert [s[:2] for s in seen] == [("embedding", 0), ("projector", 0), ("layer", 0), ("layer", 1), ("output", 0)]
    assert seen[0][2] == ["word_embeddings.weight"]
    loaded = load_release(tiny_dir / "weights", tiny_config)
    assert loaded.resident["embedding"]["word_embeddings.weight"].dtype == torch.float16
    assert len(loaded.layers) == 2


def test_missing_file_is_named(weights: Path, tiny_config: YalmConfig) -> None:
    (weights / LAYER_04).unlink()
    with pytest.raises(CheckpointError, match=LAYER_04 + ".*missing"):
        load_release(weights, tiny_config)


def test_truncated_file_is_named(weights: Path, tiny_config: YalmConfig) -> None:
    data = (weights / LAYER_04).read_bytes()
    (weights / LAYER_04).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=LAYER_04 + ".*truncated or corrupt"):
        load_release(weights, tiny_config)


def test_garbage_file_is_named(weights: Path, tiny_config: YalmConfig) -> None:
    (weights / LAYER_04).write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match=LAYER_04):
        load_release(weights, tiny_config)


def test_missing_key_is_named(weights: Path, tiny_config: YalmConfig) -> None:
    _rewrite(weights / LAYER_04, {}, drop="mlp.dense_ffn_gate.bias")
    with pytest.raises(CheckpointError, match=LAYER_04 + ".*missing key 'mlp.dense_ffn_gate.bias'"):
        load_release(weights, tiny_config)


def test_bad_shape_is_named(weights: Path, tiny_config: YalmConfig) -> None:
    _rewrite(weights / LAYER_04, {"attention.dense.weight": torch.zeros(64, 63, dtype=torch.float16)})
    with pytest.raises(CheckpointError, match=LAYER_04 + ".*'attention.dense.weight'.*\\[64, 63\\].*\\[64, 64\\]"):
        load_release(weights, tiny_config)


def test_config_mismatch_is_refused(tiny_dir: Path, tiny_config: YalmConfig) -> None:
    wrong = YalmConfig(**{**tiny_config.to_dict(), "intermediate_size": 170})
    with pytest.raises(CheckpointError, match=r"layer_03.*dense_ffn_hidden\.weight"):
        load_release(tiny_dir, wrong)


def test_extra_key_warns_and_loads(weights: Path, tiny_config: YalmConfig) -> None:
    # The real release may hold LayerNorm tensors in layer 1's file that the model has no use for.
    _rewrite(weights / "layer_03-model_00-model_states.pt", {"input_layernorm.weight": torch.ones(64)})
    with pytest.warns(CheckpointWarning, match="layer_03.*extra key 'input_layernorm.weight'"):
        loaded = load_release(weights, tiny_config)
    assert "input_layernorm.weight" not in loaded.layers[0]


def test_unrelated_files_are_ignored(weights: Path, tiny_config: YalmConfig) -> None:
    (weights / "notes.txt").write_text("hello")
    torch.save({"x": torch.zeros(1)}, weights / "layer_05-model_00-model_states.pt")
    assert len(load_release(weights, tiny_config).layers) == 2


def test_pickled_objects_need_explicit_trust(weights: Path, tiny_config: YalmConfig) -> None:
    _rewrite(weights / LAYER_04, {"args": argparse.Namespace(fp16=True)})
    with pytest.raises(CheckpointError, match=LAYER_04 + ".*weights_only.*trust_pickle=True"):
        load_release(weights, tiny_config)
    with pytest.warns(CheckpointWarning, match="extra key 'args'"):
        loaded = load_release(weights, tiny_config, trust_pickle=True)
    assert len(loaded.layers) == 2


def test_errors_are_user_errors(tmp_path: Path, tiny_config: YalmConfig) -> None:
    with pytest.raises(RobotLLMError, match="does not exist"):
        load_release(tmp_path / "nowhere", tiny_config)
    with pytest.raises(CheckpointError, match="missing"):
        read_module(tmp_path / "layer_00-model_00-model_states.pt", {})


def test_save_release_round_trip(tmp_path: Path, tiny_dir: Path, tiny_config: YalmConfig) -> None:
    original = load_release(tiny_dir, tiny_config)
    written = save_release(tmp_path, tiny_config, original)
    assert [p.name for p in written] == [name for _, _, name, _ in module_plan(tiny_config)]
    again = load_release(tmp_path, tiny_config)
    for a, b in zip(original.layers, again.layers, strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
