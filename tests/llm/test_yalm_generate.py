"""Batched generation, sampling filters, the original loop's corner cases and scoring."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from robot_llm.llm.engine.memory import Yalm
from robot_llm.llm.families.original import generate_original
from robot_llm.llm.generate import Completion, SamplingParams, generate
from robot_llm.llm.sampling import filter_logits
from robot_llm.llm.scoring import score
from robot_llm.llm.tokenizer import YalmTokenizer

GREEDY12 = SamplingParams(max_new_tokens=12, greedy=True)


def _eos_model(model: Yalm) -> Yalm:
    """The fixture model with a huge output bias on EOS, so that the first generated token is EOS."""
    output = dict(model.weights.resident["output"])
    bias = output["output_bias"].clone()
    bias[2] = 1000.0
    output["output_bias"] = bias
    weights = dataclasses.replace(model.weights, resident={**model.weights.resident, "output": output})
    return Yalm(model.config, weights, dtype=model.dtype)


def test_batched_greedy_equals_alone_and_reference(
    tiny_model: Yalm, tokenizer: YalmTokenizer, expected: dict[str, Any], prompts: list[str]
) -> None:
    batched = generate(tiny_model, tokenizer, prompts, GREEDY12, batch_size=4)
    for prompt, ref, got in zip(prompts, expected["prompts"], batched, strict=True):
        alone = generate(tiny_model, tokenizer, [prompt], GREEDY12, batch_size=1)[0]
        assert got == alone
        assert list(got.token_ids) == ref["greedy"]["new_token_ids"]
        assert got.text == ref["greedy"]["suffix_text"]
        assert got.prompt_token_count == ref["num_tokens"]
        assert (got.new_token_count, got.finish_reason) == (12, "length")


def test_sampled_continuation_independent_of_batch(
    tiny_model: Yalm, tokenizer: YalmTokenizer, prompts: list[str]
) -> None:
    mine = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=7)
    alone = generate(tiny_model, tokenizer, [prompts[1]], mine)[0]
    others = [SamplingParams(max_new_tokens=n, top_k=20, seed=n) for n in (5, 9, 30)]
    batch = generate(
        tiny_model,
        tokenizer,
        [prompts[0], prompts[1], prompts[2], prompts[3]],
        [others[0], mine, *others[1:]],
        batch_size=4,
    )
    assert batch[1] == alone
    assert [c.new_token_count for c in batch] == [5, 16, 9, 30]
    again = generate(tiny_model, tokenizer, [prompts[1]], mine)[0]
    assert again == alone
    other_seed = generate(tiny_model, tokenizer, [prompts[1]], dataclasses.replace(mine, seed=8))[0]
    assert other_seed.token_ids != alone.token_ids


def test_sampling_filter_matches_original(expected: dict[str, Any], reference_logits: dict[str, torch.Tensor]) -> None:
    for check in expected["sampling_filter_checks"]:
        logits = reference_logits[f"prompt_{check['prompt_index']}"][-1]
        filtered = filter_logits(logits, check["temperature"], check["top_k"], check["top_p"])
        kept = torch.isfinite(filtered).nonzero().flatten().tolist()
        assert kept == check["kept_token_ids"]
        probs = torch.softmax(filtered, dim=-1)[kept]
        assert torch.allclose(probs, torch.tensor(check["kept_probs"]), atol=1e-6)


def test_filter_corner_cases() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.5])
    # top-k keeps every token tied with the k-th largest.
    assert torch.isfinite(filter_logits(logits, top_k=2)).tolist() == [False, True, True, True, False]
    # top-p keeps the top token even when it alone exceeds p ...
    peaked = torch.tensor([10.0, 0.0, 0.0])
    assert torch.isfinite(filter_logits(peaked, top_p=0.1)).tolist() == [True, False, False]
    # ... and the token that first crosses p.
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert torch.isfinite(filter_logits(probs.log(), top_p=0.6)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(probs.log(), top_p=0.75)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(probs.log(), top_p=0.85)).tolist() == [True, True, True, False]
    # top-k larger than the vocabulary keeps everything.
    assert torch.isfinite(filter_logits(logits, top_k=100)).all()


def test_original_loop_token_counts(tiny_model: Yalm, tokenizer: YalmTokenizer, prompts: list[str]) -> None:
    ctx = len(tokenizer.encode(prompts[0]))
    assert ctx == 17
    normal = generate_original(tiny_model, tokenizer, prompts[0], seq_length=64, out_seq_length=5, greedy=True)
    assert normal is not None and len(normal.new_token_ids) == 5
    # The sample budget is the limit: seq_length - ctx tokens.
    limited = generate_original(tiny_model, tokenizer, prompts[0], seq_length=40, out_seq_length=30, greedy=True)
    assert limited is not None and not limited.stopped_on_eos
    assert len(limited.new_token_ids) == 40 - ctx
    # Off-by-one corner: seq_length - 1 == ctx + out gives out + 1 tokens.
    corner = generate_original(tiny_model, tokenizer, prompts[0], seq_length=64, out_seq_length=46, greedy=True)
    assert corner is not None and not corner.stopped_on_eos
    assert len(corner.new_token_ids) == 47
    # Prompts of >= seq_length // 2 tokens are skipped.
    assert generate_original(tiny_model, tokenizer, prompts[0], seq_length=34, out_seq_length=4) is None
    assert generate_original(tiny_model, tokenizer, prompts[0], seq_length=36, out_seq_length=4) is not None


def test_eos_stops_and_is_kept(tiny_model: Yalm, tokenizer: YalmTokenizer, prompts: list[str]) -> None:
    model = _eos_model(tiny_model)
    sample = generate_original(model, tokenizer, prompts[0], seq_length=64, out_seq_length=12, greedy=True)
    assert sample is not None and sample.stopped_on_eos
    assert sample.new_token_ids == (2,)
    assert sample.suffix == ""
    done = generate(model, tokenizer, prompts[:2], SamplingParams(max_new_tokens=12, temperature=0.7, seed=1))
    assert all(c == Completion("", (2,), c.prompt_token_count, 1, "eos") for c in done)


def test_stop_strings_and_per_row_budgets(
    tiny_model: Yalm, tokenizer: YalmTokenizer, expected: dict[str, Any], prompts: list[str]
) -> None:
    # Greedy continuation of prompt 0 is " инinciceam2тототото доingsec".
    stop = dataclasses.replace(GREEDY12, stop=("ice", "zzz"))
    params = [
        stop,
        dataclasses.replace(GREEDY12, max_new_tokens=3),
        GREEDY12,
        dataclasses.replace(GREEDY12, max_new_tokens=0),
    ]
    out = generate(tiny_model, tokenizer, prompts, params, batch_size=4)
    assert out[0].finish_reason == "stop"
    assert out[0].text == " инinc"
    assert 0 < out[0].new_token_count < 12
    assert list(out[0].token_ids) == expected["prompts"][0]["greedy"]["new_token_ids"][: out[0].new_token_count]
    assert list(out[1].token_ids) == expected["prompts"][1]["greedy"]["new_token_ids"][:3]
    assert (out[1].finish_reason, out[1].new_token_count) == ("length", 3)
    assert list(out[2].token_ids) == expected["prompts"][2]["greedy"]["new_token_ids"]
    assert out[3] == Completion("", (), expected["prompts"][3]["num_tokens"], 0, "length")


def test_budget_capped_by_max_positions(tiny_model: Yalm, tokenizer: YalmTokenizer, prompts: list[str]) -> None:
    calls: list[tuple[int, int]] = []
    out = generate(
        tiny_model,
        tokenizer,
        prompts[:2],
        SamplingParams(max_new_tokens=500, greedy=True),
        on_progress=lambda done, total: calls.append((done, total)),
    )
    for c in out:
        assert c.prompt_token_count + c.new_token_count == tiny_model.config.max_position_embeddings
        assert c.finish_reason == "length"
    assert calls == [(2, 2)]
    with pytest.raises(ValueError, match="at most 64"):
        generate(tiny_model, tokenizer, ["rate " * 80], GREEDY12)


def test_sampling_params_validation() -> None:
    with pytest.raises(ValueError):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError):
        SamplingParams(stop=("",))
    assert SamplingParams(temperature=0.0, greedy=True).greedy
    assert SamplingParams(stop=["a"]).stop == ("a",)  # type: ignore[arg-type]


def test_score_consistent_with_logits(tiny_model: Yalm, tokenizer: YalmTokenizer, prompts: list[str]) -> None:
    prompt = prompts[0]
    continuations = [" инinc", " bank rate", "", "\nРубль"]
    scores = score(tiny_model, tokenizer, prompt, continuations, batch_size=3)
    prompt_ids = tokenizer.encode(prompt)
    for text, got in zip(continuations, scores, strict=True):
        ids = tokenizer.encode(prompt + text)
        assert ids[: len(prompt_ids)] == prompt_ids
        logprobs = torch.log_softmax(tiny_model.forward(torch.tensor([ids]))[0], dim=-1)
        want = sum(float(logprobs[t - 1, ids[t]]) for t in range(len(prompt_ids), len(ids)))
        assert got == pytest.approx(want, abs=1e-4)
    assert scores[2] == 0.0
    assert score(tiny_model, tokenizer, prompt, continuations[:1]) == pytest.approx(scores[:1], abs=1e-5)


def test_progress_per_batch_and_liveness_per_forward_pass(
    tiny_model: Yalm, tokenizer: YalmTokenizer, prompts: list[str]
) -> None:
    forwards: list[int] = []

    class Counting:
        config = tiny_model.config

        def new_cache(self, *args: Any, **kwargs: Any) -> Any:
            return tiny_model.new_cache(*args, **kwargs)

        def forward(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            forwards.append(ids.shape[1])
            return tiny_model.forward(ids, *args, **kwargs)

    steps: list[int] = []
    progress: list[tuple[int, int]] = []
    out = generate(
        Counting(),  # type: ignore[arg-type]
        tokenizer,
        prompts,
        GREEDY12,
        batch_size=2,
        on_progress=lambda done, total: progress.append((done, total)),
        on_step=lambda: steps.append(len(forwards)),
    )
    # on_step follows every forward pass (prefills and decode steps), right after it.
    assert steps == list(range(1, len(forwards) + 1))
    assert len(forwards) > len(prompts)
    assert progress == [(2, 4), (4, 4)]
    assert out == generate(tiny_model, tokenizer, prompts, GREEDY12, batch_size=2)
