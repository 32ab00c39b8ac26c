"""Other shapes than the fixture: random weights in the release layout, cached vs uncached vs batched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from robot_llm.llm.engine.memory import Yalm
from robot_llm.llm.families.family import random_weights
from robot_llm.llm.families.yalm import YalmConfig
from robot_llm.llm.generate import SamplingParams, generate
from robot_llm.llm.scoring import score
from robot_llm.llm.store.checkpoint import save_release
from robot_llm.llm.tokenizer import YalmTokenizer

SHAPES = {
    # E == H (no projector padding), 3 layers, 6 heads of 8, padded vocabulary rows beyond the 600 pieces.
    "e-eq-h": YalmConfig(
        num_layers=3,
        hidden_size=48,
        embedding_size=48,
        intermediate_size=100,
        num_attention_heads=6,
        max_position_embeddings=40,
        vocab_size=608,
    ),
    # E = H / 4, one layer (only the layer without input LayerNorm), 2 wide heads.
    "e-quarter": YalmConfig(
        num_layers=1,
        hidden_size=96,
        embedding_size=24,
        intermediate_size=64,
        num_attention_heads=2,
        max_position_embeddings=48,
        vocab_size=600,
    ),
}

PROMPTS = ["Рубль", "The central bank kept its key rate", "Brent\ncrude", ""]


@pytest.fixture(scope="module", params=sorted(SHAPES))
def shaped_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Yalm:
    cfg = SHAPES[request.param]
    folder: Path = tmp_path_factory.mktemp(request.param)
    save_release(folder, cfg, random_weights(cfg, seed=5, std=0.15))
    return Yalm.from_release(str(folder), cfg, dtype="fp32")


def _ids(tokenizer: YalmTokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


def test_cached_equals_uncached(shaped_model: Yalm, tokenizer: YalmTokenizer) -> None:
    for ids in _ids(tokenizer):
        full = shaped_model.forward(torch.tensor([ids]))[0]
        cache = shaped_model.new_cache(1, len(ids))
        steps = [shaped_model.forward(torch.tensor([[t]]), cache)[0, 0] for t in ids]
        assert (torch.stack(steps) - full).abs().max() <= 1e-5


def test_batched_prefill_equals_alone(shaped_model: Yalm, tokenizer: YalmTokenizer) -> None:
    rows = _ids(tokenizer)
    width = max(map(len, rows))
    pad = torch.tensor([width - len(r) for r in rows])
    ids = torch.full((len(rows), width), 2)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :] = torch.tensor(r)
    cache = shaped_model.new_cache(len(rows), width + 1, pad)
    cached = shaped_model.forward(ids, cache)
    nxt = shaped_model.forward(torch.full((len(rows), 1), 7), cache)[:, 0]
    uncached = shaped_model.forward(ids, None, pad)
    for b, r in enumerate(rows):
        alone = shaped_model.forward(torch.tensor([[*r, 7]]))[0]
        assert (cached[b, int(pad[b]) :] - alone[:-1]).abs().max() <= 1e-5
        assert (uncached[b, int(pad[b]) :] - alone[:-1]).abs().max() <= 1e-5
        assert (nxt[b] - alone[-1]).abs().max() <= 1e-5


def test_generation_batched_equals_alone(shaped_model: Yalm, tokenizer: YalmTokenizer) -> None:
    params = [
        SamplingParams(max_new_tokens=10, greedy=True),
        SamplingParams(max_new_tokens=6, top_k=50, top_p=0.9, seed=3),
        SamplingParams(max_new_tokens=100, temperature=1.5, seed=5),  # its draws meet no EOS before the window fills
        SamplingParams(max_new_tokens=8, greedy=True),
    ]
    batched = generate(shaped_model, tokenizer, PROMPTS, params, batch_size=4)
    for prompt, p, got in zip(PROMPTS, params, batched, strict=True):
        assert got == generate(shaped_model, tokenizer, [prompt], p)[0]
    assert batched[2].prompt_token_count + batched[2].new_token_count == shaped_model.config.max_position_embeddings


def test_score_batched_equals_single(shaped_model: Yalm, tokenizer: YalmTokenizer) -> None:
    conts = [" rate", " крупнейшей нефтяной", "\n"]
    together = score(shaped_model, tokenizer, "Рубль ослаб", conts, batch_size=3)
    single = [score(shaped_model, tokenizer, "Рубль ослаб", [c])[0] for c in conts]
    assert together == pytest.approx(single, abs=1e-4)
    assert all(s < 0 for s in together)


def test_fp16_and_bf16_close_to_fp32(shaped_model: Yalm, tokenizer: YalmTokenizer) -> None:
    ids = torch.tensor([tokenizer.encode(PROMPTS[1])])
    ref = shaped_model.forward(ids)
    for dtype, tol in ((torch.float16, 0.05), (torch.bfloat16, 0.5)):
        low = Yalm(shaped_model.config, shaped_model.weights, dtype=dtype)
        full = low.forward(ids)
        assert (full - ref).abs().max() <= tol
        cache = low.new_cache(1, ids.shape[1])
        steps = torch.cat([low.forward(ids[:, :5], cache), low.forward(ids[:, 5:], cache)], dim=1)
        assert (steps - full).abs().max() <= tol


def test_vocabulary_smaller_than_tokenizer_is_refused(tokenizer: YalmTokenizer) -> None:
    cfg = YalmConfig(**{**SHAPES["e-quarter"].to_dict(), "vocab_size": 500})
    model = Yalm(cfg, random_weights(cfg))
    with pytest.raises(ValueError, match="600 pieces"):
        generate(model, tokenizer, ["x"], SamplingParams(max_new_tokens=2, greedy=True))
