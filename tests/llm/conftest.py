"""Fixtures for the model tests: the in-repo yalm-tiny fixture, models built on it, a tiny tokenizer.json writer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from robot_llm.llm.engine.memory import Yalm
from robot_llm.llm.families.yalm import YalmConfig

# The models here are tiny: intra-op threads only add synchronisation cost, which
# explodes when the test machine's cores are shared.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def expected(tiny_dir: Path) -> dict[str, Any]:
    return json.loads((tiny_dir / "expected.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def reference_logits(tiny_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(tiny_dir / "logits.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir: Path, tiny_config: YalmConfig) -> Yalm:
    """The fixture model computing in fp32."""
    return Yalm.from_release(str(tiny_dir / "weights"), tiny_config, dtype="fp32")


@pytest.fixture(scope="session")
def sliding_gemma(tokenizer: Any) -> Any:
    """A random two-layer Gemma 3 on the fixture's vocabulary whose sliding windows (5 positions) are shorter
    than the prompts: masks must measure in positions, across masked slots."""
    from robot_llm.llm.engine.memory import InMemoryModel
    from robot_llm.llm.families.family import random_weights
    from robot_llm.llm.families.gemma3 import Gemma3Config

    cfg = Gemma3Config(
        num_layers=2,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        vocab_size=tokenizer.vocab_size,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window_size=5,
        query_pre_attn_scalar=16.0,
    )
    return InMemoryModel(cfg, random_weights(cfg, seed=3, std=0.2))


@pytest.fixture(scope="session")
def door() -> Callable[..., Any]:
    """Opens a store through the door (``Model.open``) with the policy these tests compute under: the CPU,
    one thread, layers streamed from disk, ``dtype`` (fp32 by default)."""
    from robot_llm.llm.model import Model, ModelSettings, Policy

    def open_store(store: Path, dtype: str = "fp32") -> Model:
        policy = Policy(device="cpu", compute_dtype=dtype, weight_home="disk", threads=1)
        return Model.open(ModelSettings(vocab=store, store=store, device="cpu"), policy)

    return open_store


@pytest.fixture(scope="session")
def prompts(expected: dict[str, Any]) -> list[str]:
    return [p["text"] for p in expected["prompts"]]


def _write_tiny_tokenizer(vocab_size: int, folder: Path) -> None:
    """A word-level ``tokenizers`` tokenizer of ``vocab_size`` tokens with its tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Any:
    """``write(vocab_size, folder)``: a word-level tokenizer.json (``w3`` .. ``wN``) with its tokenizer_config.json."""
    return _write_tiny_tokenizer
