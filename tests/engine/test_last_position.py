"""A step that keeps only its last position (``last_only``: a prefill before decoding) computes its last layer's
output there only, and still writes every position's keys and values: its logits and the decode steps after it are
the full step's, for every family, with left pads, a sliding window shorter than the prompt, and micro-batches."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import Tensor

from robot_llm.llm.engine.memory import InMemoryModel, Yalm
from robot_llm.llm.engine.streaming import StreamingModel
from robot_llm.llm.families import family, gemma3, llama, yalm
from robot_llm.llm.families.family import random_weights
from robot_llm.llm.families.gemma3 import Gemma3Config
from robot_llm.llm.families.llama import LlamaConfig
from robot_llm.llm.families.yalm import YalmConfig

SIZES = dict(num_layers=3, hidden_size=64, intermediate_size=96, max_position_embeddings=64, vocab_size=300)


def _gemma() -> Gemma3Config:
    return Gemma3Config(
        **SIZES,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
        sliding_window_size=5,
        query_pre_attn_scalar=16.0,
    )


def _qwen3() -> LlamaConfig:
    return LlamaConfig(**SIZES, num_attention_heads=4, num_key_value_heads=2, head_dim=16, qk_norm=True)


def _night(model: InMemoryModel | Yalm | StreamingModel, ids: Tensor, pad: Tensor, last_only: bool) -> list[Tensor]:
    """The prefill's last-position logits, then three greedy decode steps' (the tokens the full step chose)."""
    cache = model.new_cache(ids.shape[0], ids.shape[1] + 3, pad)
    out = [model.forward(ids, cache, last_only=last_only)[:, -1]]
    for token in (5, 17, 123):
        out.append(model.forward(torch.full((ids.shape[0], 1), token), cache)[:, -1])
    return out


def _rows_seen(module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row count of every product the family's module computes from now on (its own calls of ``linear``, and
    those of the products of one input, :func:`~robot_llm.llm.families.family.linears`: plain tensors here)."""
    rows: list[int] = []
    real = module.linear  # type: ignore[attr-defined]

    def counted(x: Tensor, *args: object) -> Tensor:
        rows.append(x.numel() // x.shape[-1])
        return real(x, *args)

    monkeypatch.setattr(module, "linear", counted)
    monkeypatch.setattr(family, "linear", counted)
    return rows


@pytest.mark.parametrize(
    ("make", "module"), [(_gemma, gemma3), (_qwen3, llama), (None, yalm)], ids=["gemma3", "qwen3", "yalm"]
)
def test_the_last_layer_computes_the_last_position_only(
    make: object, module: ModuleType, tiny_config: YalmConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tiny_config if make is None else make()  # type: ignore[operator]
    model = InMemoryModel(cfg, random_weights(cfg, seed=4, std=0.2), dtype="fp32")
    ids = torch.randint(3, 300, (3, 11), generator=torch.Generator().manual_seed(5))
    pad = torch.tensor([0, 3, 6])
    full = _night(model, ids, pad, last_only=False)
    rows = _rows_seen(module, monkeypatch)
    model.forward(ids, model.new_cache(3, 11, pad), last_only=True)
    # The first layers at all 3 x 11 positions; the last one's keys and values too, the rest of it (at least its
    # output projection and MLP) and the head at the 3 rows' last positions.
    assert set(rows) == {33, 3} and rows.count(3) >= 5
    kept = _night(model, ids, pad, last_only=True)
    for a, b in zip(full, kept, strict=True):
        assert (a - b).abs().max() <= 1e-5


def test_micro_batches_of_the_engine_keep_the_last_position(stores: dict[str, Path], reference: Yalm) -> None:
    model = StreamingModel(stores["fp16"], home="ram", device="cpu", micro_batch=2)
    ids = torch.randint(3, 300, (3, 9), generator=torch.Generator().manual_seed(6))
    pad = torch.tensor([2, 0, 5])
    for a, b in zip(_night(reference, ids, pad, False), _night(model, ids, pad, True), strict=True):
        assert (a - b).abs().max() <= 1e-4
    model.close()
