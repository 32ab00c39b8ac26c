"""Per-news-item stance branches, scored in the step that reads the news stance (no weight pass of their own).

Item ``i``'s branch is the cue placed right after item ``i``'s last token, seeing the prompt's
keys before the first item and item ``i``'s own keys (:func:`robot_llm.llm.scoring.plan_items`).
Checked on the tiny YaLM fixture: the cache path equals the re-prefill path; the first item
equals a plain re-prefill of the prompt up to it; a later item's text never moves an earlier
item's scores; an item not in the context is left unplaced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from robot_llm.llm.engine.memory import InMemoryModel, Yalm
from robot_llm.llm.families.family import ForwardModel
from robot_llm.llm.generate import Completion, SamplingParams, generate
from robot_llm.llm.scoring import Followup, score_pieces
from robot_llm.llm.tokenizer import YalmTokenizer

LABELS = (" рост", " падение", " нейтрально")
ANCHOR = "\nТезис:"


def _prompt(items: list[str]) -> tuple[str, tuple[tuple[int, int], ...]]:
    """A prompt with a news block, and each item's char span (from its "- " to its end)."""
    prompt, spans = "Инструмент: Сбербанк\nНовости:", []
    for item in items:
        prompt += "\n"
        spans.append((len(prompt), len(prompt) + 2 + len(item)))
        prompt += "- " + item
    return prompt + ANCHOR, tuple(spans)


def _news(spans: tuple[tuple[int, int], ...]) -> Followup:
    return Followup("\nИтог:", LABELS, after_prompt=True, anchor=ANCHOR, items=spans)


def _run(
    model: ForwardModel, tokenizer: YalmTokenizer, news: Sequence[list[str]], *, then: bool = True
) -> list[Completion]:
    prompts, followups = [], []
    for items in news:
        prompt, spans = _prompt(items)
        prompts.append(prompt)
        thesis = Followup("\nИтог:", LABELS)
        followups.append(replace(thesis, then=_news(spans)) if then else _news(spans))
    params = [SamplingParams(max_new_tokens=n, greedy=True) for n in (3, 6, 2)][: len(prompts)]
    return generate(model, tokenizer, prompts, params, batch_size=len(prompts), followups=followups)


NEWS = [
    ["Рубль ослаб", "Нефть подорожала на 5%", "Банк повысил дивиденды"],
    ["Газпром снизил добычу", "Рубль ослаб к доллару"],
    ["Нефть подешевела"],
]


def _items(c: Completion) -> list[tuple[tuple[float, ...], ...]]:
    assert c.item_logprobs is not None and all(item is not None for item in c.item_logprobs)
    return [item for item in c.item_logprobs if item is not None]


def _close(a: list[tuple[tuple[float, ...], ...]], b: list[tuple[tuple[float, ...], ...]], tol: float) -> None:
    assert [[len(x) for x in item] for item in a] == [[len(x) for x in item] for item in b]
    for x, y in zip(a, b, strict=True):
        for p, q in zip(x, y, strict=True):
            assert p == pytest.approx(q, abs=tol)


def _gap(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float:
    """The largest difference between two items' label piece scores."""
    return max(abs(p - q) for x, y in zip(a, b, strict=True) for p, q in zip(x, y, strict=True))


def test_item_scores_from_the_cache_equal_the_rescored_path_and_the_first_item_a_plain_prefill(
    tiny_model: Yalm, tokenizer: YalmTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    for then in (True, False):
        cached = _run(tiny_model, tokenizer, NEWS, then=then)
        import robot_llm.llm.generate as generation

        with monkeypatch.context() as m:  # no slot for the followup step: every followup is re-prefilled
            m.setattr(generation, "followup_slots", lambda tokenizer, followup: 0)
            rescored = _run(tiny_model, tokenizer, NEWS, then=then)
        for c, r, items in zip(cached, rescored, NEWS, strict=True):
            assert len(_items(c)) == len(items)
            _close(_items(c), _items(r), 1e-4)
            prompt, spans = _prompt(items)
            first = score_pieces(tiny_model, tokenizer, prompt[: spans[0][1]] + "\nИтог:", LABELS)
            _close(_items(c)[:1], [tuple(tuple(x) for x in first)], 1e-4)


def test_item_branches_take_no_weight_pass_of_their_own(tiny_model: Yalm, tokenizer: YalmTokenizer) -> None:
    calls: list[int] = []
    forward = tiny_model.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return forward(*args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(tiny_model, "forward", counted)
        _run(tiny_model, tokenizer, NEWS)
        with_items = len(calls)
        calls.clear()
        prompts = [_prompt(items)[0] for items in NEWS]
        thesis = Followup("\nИтог:", LABELS)
        plain = [replace(thesis, then=_news(())) for _ in prompts]  # the same followups, no items
        params = [SamplingParams(max_new_tokens=n, greedy=True) for n in (3, 6, 2)]
        generate(tiny_model, tokenizer, prompts, params, batch_size=len(prompts), followups=plain)
    assert with_items == len(calls)


def test_item_scores_on_gemma3_with_sliding_windows(
    tokenizer: YalmTokenizer, monkeypatch: pytest.MonkeyPatch, sliding_gemma: InMemoryModel
) -> None:
    # Windows of 5 positions, shorter than the news block: an item branch's keys are limited by its
    # item's span and by the sliding window, both measured in positions, across masked slots.
    import robot_llm.llm.generate as generation

    model = sliding_gemma
    cached = _run(model, tokenizer, NEWS)
    monkeypatch.setattr(generation, "followup_slots", lambda tokenizer, followup: 0)
    for c, r in zip(cached, _run(model, tokenizer, NEWS), strict=True):
        _close(_items(c), _items(r), 1e-4)


def test_an_item_ignores_the_items_after_it_and_differs_from_its_neighbours(
    tiny_model: Yalm, tokenizer: YalmTokenizer
) -> None:
    base = _items(_run(tiny_model, tokenizer, NEWS[:1])[0])
    changed = _items(_run(tiny_model, tokenizer, [[*NEWS[0][:2], "Банк разорился"]])[0])
    _close(base[:2], changed[:2], 1e-5)
    assert _gap(base[2], changed[2]) > 1e-3
    # Item 1 does not see item 0's keys: its scores are not those of the prompt up to it.
    prompt, spans = _prompt(NEWS[0])
    whole = score_pieces(tiny_model, tokenizer, prompt[: spans[1][1]] + "\nИтог:", LABELS)
    assert _gap(base[1], whole) > 1e-4


def test_an_item_outside_the_context_is_not_placed(tiny_model: Yalm, tokenizer: YalmTokenizer) -> None:
    prompt, spans = _prompt(NEWS[2])
    outside = (len(prompt) + 5, len(prompt) + 9)  # past the anchor: not in the news stance's context
    got = generate(
        tiny_model,
        tokenizer,
        [prompt],
        SamplingParams(max_new_tokens=2, greedy=True),
        followups=[_news((*spans, outside))],
    )[0]
    assert got.item_logprobs is not None and got.item_logprobs[0] is not None and got.item_logprobs[1] is None
