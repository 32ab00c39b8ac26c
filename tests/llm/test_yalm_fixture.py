"""Our model against the reference outputs of the original code (tests/fixtures/yalm-tiny)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from robot_llm.llm.engine.memory import Yalm
from robot_llm.llm.families.original import generate_original
from robot_llm.llm.families.yalm import YalmConfig
from robot_llm.llm.tokenizer import YalmTokenizer


def test_token_ids_and_pieces(tokenizer: YalmTokenizer, expected: dict[str, Any]) -> None:
    for prompt in expected["prompts"]:
        ids = tokenizer.encode(prompt["text"])
        assert ids == prompt["token_ids"]
        assert tokenizer.pieces(ids) == prompt["pieces"]
        assert tokenizer.decode(ids) == prompt["text"]


def test_tokenizer_conventions(tokenizer: YalmTokenizer, expected: dict[str, Any]) -> None:
    ids = expected["tokenizer"]
    assert (tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id) == (ids["unk_id"], ids["bos_id"], ids["eos_id"])
    assert (tokenizer.nl_id, tokenizer.mask_id) == (ids["nl_id"], ids["mask_id"])
    assert tokenizer.vocab_size == ids["vocab_size"]
    assert tokenizer.encode("") == [1]
    encoded = tokenizer.encode("rate\nbank")
    assert tokenizer.nl_id in encoded
    assert tokenizer.decode(encoded) == "rate\nbank"
    assert tokenizer.encode("Рубль".encode() + b"\xff") == tokenizer.encode("Рубль")


def test_logits_every_position_fp32(
    tiny_model: Yalm, expected: dict[str, Any], reference_logits: dict[str, torch.Tensor]
) -> None:
    for i, prompt in enumerate(expected["prompts"]):
        logits = tiny_model.forward(torch.tensor([prompt["token_ids"]]))[0]
        ref = reference_logits[f"prompt_{i}"]
        assert logits.shape == ref.shape
        assert (logits - ref).abs().max() <= 1e-4
        assert (logits[-1] - torch.tensor(prompt["last_logits"])).abs().max() <= 1e-4
        assert int(logits[-1].argmax()) == prompt["last_argmax"]


def test_cached_decoding_matches_full_forward(
    tiny_model: Yalm, expected: dict[str, Any], reference_logits: dict[str, torch.Tensor]
) -> None:
    ids = expected["prompts"][2]["token_ids"]
    cache = tiny_model.new_cache(1, len(ids))
    prefill = tiny_model.forward(torch.tensor([ids[:5]]), cache)[0]
    steps = [tiny_model.forward(torch.tensor([[t]]), cache)[0, 0] for t in ids[5:]]
    cached = torch.cat([prefill, torch.stack(steps)])
    assert (cached - reference_logits["prompt_2"]).abs().max() <= 1e-4
    assert cache.length == len(ids)


def test_left_padded_batch_equals_each_alone(
    tiny_model: Yalm, expected: dict[str, Any], reference_logits: dict[str, torch.Tensor]
) -> None:
    rows = [p["token_ids"] for p in expected["prompts"]]
    width = max(map(len, rows))
    pad = torch.tensor([width - len(r) for r in rows])
    ids = torch.full((len(rows), width), 2)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :] = torch.tensor(r)
    logits = tiny_model.forward(ids, None, pad)
    for b in range(len(rows)):
        alone = tiny_model.forward(torch.tensor([rows[b]]))[0]
        assert (logits[b, int(pad[b]) :] - alone).abs().max() <= 1e-5
        assert (logits[b, int(pad[b]) :] - reference_logits[f"prompt_{b}"]).abs().max() <= 1e-4


@pytest.mark.parametrize("recompute", [False, True], ids=["kv-cache", "recompute"])
def test_greedy_continuations_original_loop(
    tiny_model: Yalm, tokenizer: YalmTokenizer, expected: dict[str, Any], recompute: bool
) -> None:
    gen = expected["generation"]
    for prompt in expected["prompts"]:
        sample = generate_original(
            tiny_model,
            tokenizer,
            prompt["text"],
            seq_length=gen["seq_length"],
            out_seq_length=gen["out_seq_length"],
            greedy=True,
            recompute=recompute,
        )
        assert sample is not None
        assert list(sample.new_token_ids) == prompt["greedy"]["new_token_ids"]
        assert list(sample.token_ids) == prompt["token_ids"] + prompt["greedy"]["new_token_ids"]
        assert sample.suffix == prompt["greedy"]["suffix_text"]
        assert sample.stopped_on_eos == prompt["greedy"]["stopped_on_eos"]
        assert tokenizer.decode(list(sample.token_ids)) == prompt["greedy"]["full_text"]


def test_fp16_within_spec_fidelity(
    tiny_dir: Any,
    tiny_config: YalmConfig,
    expected: dict[str, Any],
    reference_logits: dict[str, torch.Tensor],
) -> None:
    model = Yalm.from_release(str(tiny_dir / "weights"), tiny_config, dtype="fp16")
    assert model.weights.layers[0]["attention.dense.weight"].dtype == torch.float16
    for i, prompt in enumerate(expected["prompts"]):
        logits = model.forward(torch.tensor([prompt["token_ids"]]))[0]
        assert logits.dtype == torch.float32
        # docs/yalm-model.md §11: fp16 paths differ from fp32 by a few 1e-2.
        assert (logits - reference_logits[f"prompt_{i}"]).abs().max() <= 0.05
        assert int(logits[-1].argmax()) == prompt["last_argmax"]


def test_bf16_sanity(
    tiny_dir: Any,
    tiny_config: YalmConfig,
    expected: dict[str, Any],
    reference_logits: dict[str, torch.Tensor],
) -> None:
    model = Yalm.from_release(str(tiny_dir / "weights"), tiny_config, dtype=torch.bfloat16)
    for i, prompt in enumerate(expected["prompts"]):
        logits = model.forward(torch.tensor([prompt["token_ids"]]))[0]
        ref = reference_logits[f"prompt_{i}"]
        assert torch.isfinite(logits).all()
        # bf16 keeps 8 mantissa bits: ~0.4% relative error per op on logits up to ~15.
        assert (logits - ref).abs().max() <= 0.5
        top5 = set(ref[-1].topk(5).indices.tolist())
        assert int(logits[-1].argmax()) in top5
