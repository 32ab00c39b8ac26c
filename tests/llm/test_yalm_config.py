"""YalmConfig: presets, fixture config.json, validation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from robot_llm.llm.families.yalm import PRESETS, YalmConfig


def test_fixture_config_is_the_tiny_preset(tiny_dir: Path) -> None:
    cfg = YalmConfig.from_json(tiny_dir / "config.json")
    assert cfg == YalmConfig.preset("yalm-tiny")
    assert cfg.head_dim == 16
    assert YalmConfig.from_dict(cfg.to_dict()) == cfg


def test_release_preset() -> None:
    cfg = PRESETS["yalm-100b"]
    assert (cfg.num_layers, cfg.hidden_size, cfg.embedding_size) == (80, 10240, 2048)
    assert (cfg.intermediate_size, cfg.num_attention_heads, cfg.head_dim) == (27308, 128, 80)
    assert (cfg.max_position_embeddings, cfg.vocab_size, cfg.layernorm_epsilon) == (1024, 128000, 1e-5)


def test_validation(tmp_path: Path) -> None:
    base = PRESETS["yalm-tiny"].to_dict()
    with pytest.raises(ValueError, match="divisible"):
        YalmConfig(**{**base, "num_attention_heads": 5})
    with pytest.raises(ValueError, match="embedding_size"):
        YalmConfig(**{**base, "embedding_size": 128})
    with pytest.raises(ValueError, match="unknown model preset"):
        YalmConfig.preset("nope")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**base, "activation": "gelu"}))
    with pytest.raises(ValueError, match="activation"):
        YalmConfig.from_json(path)
    path.write_text(json.dumps({"num_layers": 2}))
    with pytest.raises(ValueError, match="lacks"):
        YalmConfig.from_json(path)


def test_package_import_does_not_import_torch() -> None:
    code = (
        "import sys, robot_llm.llm, robot_llm.llm.engine.backends, robot_llm.commands.model; "
        "print('torch' in sys.modules)"
    )
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo)
    assert out.stdout.strip() == "False"
