"""A backend that cannot run a store's family says so, in one line, at ``config check`` and at the door."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from robot_llm.commands.main import main
from robot_llm.errors import BackendError
from robot_llm.llm.families.config import module_plan
from robot_llm.llm.families.family import random_weights
from robot_llm.llm.families.gemma3 import Gemma3Config
from robot_llm.llm.model import Model, ModelSettings
from robot_llm.llm.store.writer import convert_modules

GEMMA = Gemma3Config(
    num_layers=2,
    hidden_size=64,
    intermediate_size=100,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=64,
    vocab_size=300,
    layer_types=("sliding_attention", "full_attention"),
    sliding_window_size=4,
    query_pre_attn_scalar=32,
)

CONFIG = """\
database:
  url: "sqlite:///robot-llm.sqlite"
instruments:
  - ticker: "SBER"
    name: "Сбербанк"
model:
  backend: "{backend}"
  store: "store"
  vocab: "store/tokenizer.json"
"""


def _random_store(config: Gemma3Config, store: Path) -> Path:
    weights = random_weights(config, seed=1)
    layers = iter(weights.layers)
    modules = (
        (kind, index, next(layers) if kind == "layer" else weights.resident[kind])
        for kind, index, _ in module_plan(config)
    )
    convert_modules(config, modules, store, dtype="fp32", reserve_bytes=0)
    return store


@pytest.fixture(scope="module")
def gemma_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _random_store(GEMMA, tmp_path_factory.mktemp("gemma") / "store")


def _config(folder: Path, store: Path, backend: str) -> Path:
    (folder / "store").symlink_to(store, target_is_directory=True)
    path = folder / "robot-llm.yaml"
    path.write_text(CONFIG.format(backend=backend), encoding="utf-8")
    return path


def test_config_check_refuses_deepspeed_for_a_gemma_store(
    tmp_path: Path, gemma_store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, gemma_store, "deepspeed")
    assert main(["config", "check", "-c", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err  # one line
    assert str(config.resolve()) in err
    assert "model.backend: the deepspeed backend runs yalm models only, not gemma3: use backend stream" in err


def test_config_check_accepts_the_stream_backend_for_it(
    tmp_path: Path, gemma_store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, gemma_store, "stream")
    assert main(["config", "check", "-c", str(config)]) == 0
    assert ": OK" in capsys.readouterr().out


def test_the_door_refuses_it_before_loading_anything(gemma_store: Path) -> None:
    settings = ModelSettings(vocab=gemma_store, backend="deepspeed", store=gemma_store, device="cpu")
    with pytest.raises(BackendError, match="the deepspeed backend runs yalm models only, not gemma3"):
        Model.open(settings)


def test_model_generate_is_planned_for_its_prompts_not_for_the_models_whole_window(
    tmp_path: Path, tiny_tokenizer: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # A window of millions of positions (Gemma 3's is 32k): a plan for the whole window needs terabytes
    # of logits, so `model generate` through the door must plan the prompts it was given.
    import dataclasses

    wide = dataclasses.replace(GEMMA, max_position_embeddings=4_000_000)
    store = _random_store(wide, tmp_path / "store")
    tiny_tokenizer(wide.vocab_size, store)
    argv = ["model", "generate", "--store", str(store), "--greedy", "--max-new-tokens", "3", "--json"]
    assert main([*argv, "w5 w6 w7", "w8"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(row["new_tokens"], len(row["token_ids"])) for row in out] == [(3, 3), (3, 3)]
