"""Followups (the stance labels) scored from a finished row's live KV cache, on both fixtures.

Both fixtures: the yalm-tiny reference model in memory, and the demo checkpoint (the one
``robot-llm demo`` builds, with its own trained vocabulary) converted to a store and run by
the streaming engine. The cached scores must equal a re-prefill (:func:`score_pieces`)
within fp32 rounding, every completion must stay what it would be alone, and the whole
batch must take at most one weight pass more than generation alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from robot_llm.llm.engine.memory import InMemoryModel, Yalm
from robot_llm.llm.engine.slots import SlotState
from robot_llm.llm.engine.streaming import StreamingModel
from robot_llm.llm.families.family import ForwardModel
from robot_llm.llm.generate import SamplingParams, generate
from robot_llm.llm.scoring import Followup, score_pieces
from robot_llm.llm.tokenizer import YalmTokenizer

REPO = Path(__file__).resolve().parents[2]
RU = Followup("\nИтог для цены:", (" рост", " падение", " нейтрально"))
EN = Followup("\nPrice outlook:", (" up", " down", " flat", ""))
PARAMS = [
    SamplingParams(max_new_tokens=12, greedy=True),
    SamplingParams(max_new_tokens=9, temperature=0.9, top_p=0.9, seed=5, stop=(" ", "а")),
    SamplingParams(max_new_tokens=20, top_k=30, seed=11),
    SamplingParams(max_new_tokens=1, greedy=True),
    SamplingParams(max_new_tokens=6, temperature=1.3, seed=2, stop=("\n",)),
]


@dataclass
class Counting:
    """A model wrapper that records every forward pass and whether it used a cache."""

    inner: ForwardModel
    calls: list[tuple[int, int, bool]]
    heads: list[tuple[int, int]] = field(default_factory=list)  # (positions fed, positions the head ran at)

    @property
    def config(self) -> Any:
        return self.inner.config

    def new_cache(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.new_cache(*args, **kwargs)

    @property
    def last_hidden(self) -> Any:
        return getattr(self.inner, "last_hidden", None)

    def forward(self, ids: torch.Tensor, cache: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls.append((ids.shape[0], ids.shape[1], cache is not None))
        out = self.inner.forward(ids, cache, *args, **kwargs)
        self.heads.append((ids.numel(), out.shape[0] if out.dim() == 2 else out.shape[0] * out.shape[1]))
        return out


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[StreamingModel, YalmTokenizer]]:
    """The demo checkpoint, converted to an fp32 store and streamed from disk."""
    from robot_llm.llm.store.demo_checkpoint import build_demo_checkpoint
    from robot_llm.llm.store.writer import convert

    root = tmp_path_factory.mktemp("demo")
    sources = [REPO / "robot_llm" / "demo_data" / "feeds", REPO / "prompts"]
    checkpoint = build_demo_checkpoint(root / "release", sources)
    convert(checkpoint.weights_dir, root / "store", dtype="fp32", config=checkpoint.config, reserve_bytes=0)
    model = StreamingModel(root / "store", device="cpu", dtype="fp32", micro_batch=2)
    yield model, YalmTokenizer(checkpoint.vocab)
    model.close()


def _check(model: ForwardModel, tokenizer: YalmTokenizer, prompts: list[str], followups: list[Followup]) -> None:
    params = PARAMS[: len(prompts)]
    counted = Counting(model, [])
    got = generate(counted, tokenizer, prompts, params, batch_size=len(prompts), followups=followups)  # type: ignore[arg-type]
    plain = Counting(model, [])
    without = generate(plain, tokenizer, prompts, params, batch_size=len(prompts))  # type: ignore[arg-type]
    assert all(cached for _, _, cached in counted.calls), "a followup was re-prefilled instead of read from the cache"
    # One step more for the rows still scoring after the last token; two when that row has a second followup.
    assert len(counted.calls) <= len(plain.calls) + 1 + any(f.then is not None for f in followups)
    # The tree steps run the head only at the positions read, not at every position fed.
    trees = [(fed, head) for fed, head in counted.heads[1:] if fed > len(prompts)]
    assert trees and sum(head for _, head in trees) < sum(fed for fed, _ in trees)
    for prompt, p, f, c, w in zip(prompts, params, followups, got, without, strict=True):
        assert replace(c, followup_logprobs=None, then_logprobs=None, hidden=None) == w
        assert w == generate(model, tokenizer, [prompt], p)[0]
        assert c.followup_logprobs is not None
        want = score_pieces(model, tokenizer, f.context(prompt, c.text), f.continuations)
        assert [len(x) for x in c.followup_logprobs] == [len(x) for x in want]
        for mine, ref in zip(c.followup_logprobs, want, strict=True):
            assert mine == pytest.approx(ref, abs=1e-4)
        if f.then is not None:  # the second followup, read from the same cache in the next step
            assert c.then_logprobs is not None
            want = score_pieces(model, tokenizer, f.then.context(prompt, c.text), f.then.continuations)
            for mine, ref in zip(c.then_logprobs, want, strict=True):
                assert mine == pytest.approx(ref, abs=1e-4)
        asked = f if f.hidden else f.then if f.then is not None and f.then.hidden else None
        assert (c.hidden is not None) == (asked is not None)
        if asked is not None:  # the state at the cue, from the pass that scored it: a re-prefill's
            model.forward(torch.tensor([tokenizer.encode(asked.context(prompt, c.text))]))
            want_hidden = model.last_hidden[0, -1]  # type: ignore[attr-defined]
            assert torch.tensor(c.hidden) == pytest.approx(want_hidden, abs=1e-4 * float(want_hidden.abs().max()))


def test_the_head_at_selected_positions_is_the_full_passes(tiny_model: Yalm) -> None:
    from robot_llm.llm.scoring import StepLogits

    ids = torch.randint(0, tiny_model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(0))
    select = torch.rand(3, 7, generator=torch.Generator().manual_seed(1)) < 0.4
    select[:, 0] = True
    full = tiny_model.forward(ids)
    packed = tiny_model.forward(ids, select=select)
    assert packed.shape == (int(select.sum()), full.shape[-1])
    step = StepLogits(packed, select)
    for b, t in select.nonzero().tolist():
        assert torch.allclose(step[b, t], full[b, t], atol=1e-5)
    assert torch.allclose(step[:, 0], full[:, 0], atol=1e-5)
    unread = (~select).nonzero()[0].tolist()
    with pytest.raises(IndexError, match="not computed"):
        step[unread[0], unread[1]]


def test_followups_from_the_cache_on_the_tiny_fixture(
    tiny_model: Yalm, tokenizer: YalmTokenizer, prompts: list[str]
) -> None:
    _check(tiny_model, tokenizer, [*prompts, prompts[0][:11]], [RU, EN, RU, EN, RU])


def test_followups_after_the_prompt_read_the_cache_rewound_past_the_thesis(
    tiny_model: Yalm, tokenizer: YalmTokenizer, prompts: list[str]
) -> None:
    # The news stance: the cue follows the prompt, not the thesis the row went on to write.
    ru, en = replace(RU, after_prompt=True), replace(EN, after_prompt=True)
    _check(tiny_model, tokenizer, [*prompts, prompts[0][:11]], [ru, EN, en, RU, ru])


def test_a_second_followup_reads_the_news_from_the_same_cache(
    tiny_model: Yalm, tokenizer: YalmTokenizer, prompts: list[str]
) -> None:
    # The thesis's stance, then the news stance: the prompt cut before its open slot, another cue.
    news = Followup(" итог", RU.continuations, after_prompt=True, anchor=" ", hidden=True)
    both = [replace(RU, then=news), EN, replace(EN, then=replace(news, continuations=EN.continuations))]
    _check(tiny_model, tokenizer, [*prompts[:3]], both)


def test_followups_from_the_cache_on_the_demo_store(demo: tuple[StreamingModel, YalmTokenizer]) -> None:
    model, tokenizer = demo
    prompts = [
        "### Обзор аналитика\nИнструмент: Сбербанк (SBER)\nТезис:",
        "### Analyst note\nInstrument: Apple (AAPL), exchange NASDAQ\nNews:\n- no significant news.\nThesis:",
        "Новости:\n- Нефть подорожала\nТезис:",
        "Thesis:",
    ]
    _check(model, tokenizer, prompts, [RU, replace(EN, after_prompt=True, hidden=True), RU, EN])


def test_followups_from_the_cache_on_gemma3_with_sliding_windows(
    tokenizer: YalmTokenizer, prompts: list[str], sliding_gemma: InMemoryModel
) -> None:
    # Windows of 5 positions, shorter than every prompt: the masks measure in positions, across masked slots.
    model = sliding_gemma
    _check(model, tokenizer, [*prompts, prompts[2][:9]], [RU, EN, RU, EN, RU])


def test_a_followup_too_long_for_the_window_is_left_out(tiny_model: Yalm, tokenizer: YalmTokenizer) -> None:
    prompt = "Рубль ослаб " * 4
    room = tiny_model.config.max_position_embeddings - len(tokenizer.encode(prompt))
    long = Followup("\nИтог" * room, (" рост",))
    got = generate(tiny_model, tokenizer, [prompt], SamplingParams(max_new_tokens=2, greedy=True), followups=[long])
    assert got[0].followup_logprobs is None and got[0].new_token_count == 2


def test_slot_state_masks_rewinds_and_gives_back_unkept_slots() -> None:
    state = SlotState.empty(2, 16, torch.tensor([2, 0]))
    length = state.commit(0, state.append_layout(0, 4))
    assert length == 4
    assert state.valid[:, :4].tolist() == [[False, False, True, True], [True, True, True, True]]
    assert state.next_pos.tolist() == [2, 4]
    state.active[0] = False
    layout = state.append_layout(4, 1)
    assert layout.real.tolist() == [[False], [True]] and layout.positions.tolist() == [[0], [4]]
    length = state.commit(4, layout)
    assert length == 5 and state.valid[0].sum() == 2
    state.rewind(1, 3)
    assert state.valid[1, :5].tolist() == [True, True, True, False, False] and int(state.next_pos[1]) == 3
    # A step that keeps nothing gives all its slots back.
    state.active[1] = False
    assert state.commit(5, state.append_layout(5, 3)) == 5
    with pytest.raises(ValueError, match="cannot rewind"):
        state.rewind(0, 3)


HEAD = "### Обзор аналитика\nИнструмент: Северный Лес (SVLS), биржа MOEX\nТезис: рост экспорта.\n\nИнструмент:"
TAILS = [" Сбербанк (SBER)\nТезис:", " Apple\nТезис:", " Газпром, биржа MOEX, новостей нет\nТезис:"]


def _shared_vs_unshared(model: ForwardModel, tokenizer: YalmTokenizer, prompts: list[str]) -> None:
    """Prefill and three decode steps with the common head shared, against the plain left-padded path."""
    from robot_llm.llm.generate import shared_prefix_length

    ids = [tokenizer.encode(p) for p in prompts]
    shared = shared_prefix_length(ids)
    assert shared >= 8
    width = max(len(x) for x in ids)
    pad = torch.tensor([width - len(x) for x in ids])
    full = torch.tensor([[tokenizer.eos_id] * (width - len(x)) + x for x in ids])
    plain = model.new_cache(len(ids), width + 3, pad)
    want = [model.forward(full, plain)]
    prefix = model.new_cache(1, shared)
    model.forward(torch.tensor([ids[0][:shared]]), prefix)
    cache = model.new_cache(len(ids), width - shared + 3, pad)
    cache.share_prefix(prefix)
    got = [model.forward(full[:, shared:], cache)]
    for step in range(3):
        token = torch.full((len(ids), 1), 5 + step)
        want.append(model.forward(token, plain))
        got.append(model.forward(token, cache))
    for b, n in enumerate(len(x) for x in ids):
        # Row b's own tokens: the last n - shared prefill slots, then every decode step.
        assert (got[0][b, -(n - shared) :] - want[0][b, -(n - shared) :]).abs().max() <= 1e-4
    for g, w in zip(got[1:], want[1:], strict=True):
        assert (g - w).abs().max() <= 1e-4
    assert cache.k[0].shape[1] == plain.k[0].shape[1] - shared  # the head is stored once, not per row


def test_shared_prefix_logits_equal_the_unshared_path_on_the_tiny_fixture(
    tiny_model: Yalm, tokenizer: YalmTokenizer
) -> None:
    _shared_vs_unshared(tiny_model, tokenizer, ["Рубль ослаб к доллару, а" + t[:6] for t in TAILS])


def test_shared_prefix_logits_equal_the_unshared_path_on_the_demo_store(
    demo: tuple[StreamingModel, YalmTokenizer],
) -> None:
    model, tokenizer = demo
    _shared_vs_unshared(model, tokenizer, [HEAD + t for t in TAILS])


def test_shared_prefix_in_generation_changes_no_result(demo: tuple[StreamingModel, YalmTokenizer]) -> None:
    model, tokenizer = demo
    prompts = [HEAD + t for t in TAILS]
    params = PARAMS[:3]
    followups = [RU, RU, EN]
    passes = Counting(model, [])
    shared = generate(passes, tokenizer, prompts, params, followups=followups, share_prefix=8)  # type: ignore[arg-type]
    alone = generate(model, tokenizer, prompts, params, followups=followups, batch_size=1)
    from robot_llm.llm.generate import shared_prefix_length

    head = shared_prefix_length([tokenizer.encode(p) for p in prompts])
    assert head >= 8 and passes.calls[0] == (1, head, True)  # the head's own pass, one row
    assert passes.calls[1][:2] == (3, max(len(tokenizer.encode(p)) for p in prompts) - head)
    assert all(cached for _, _, cached in passes.calls)
    for s, a in zip(shared, alone, strict=True):
        assert replace(s, followup_logprobs=None) == replace(a, followup_logprobs=None)
        assert s.followup_logprobs is not None and a.followup_logprobs is not None
        for x, y in zip(s.followup_logprobs, a.followup_logprobs, strict=True):
            assert x == pytest.approx(y, abs=1e-4)


def _refill_check(model: ForwardModel, tokenizer: YalmTokenizer, prompts: list[str], share: int) -> None:
    params = (PARAMS * 2)[: len(prompts)]
    followups = [RU, EN] * (len(prompts) // 2) + [RU] * (len(prompts) % 2)
    refilled = Counting(model, [])
    got = generate(
        refilled,  # type: ignore[arg-type]
        tokenizer,
        prompts,
        params,
        batch_size=2,
        followups=followups,
        share_prefix=share,
        refill_slots=48,
    )
    batched = Counting(model, [])
    generate(batched, tokenizer, prompts, params, batch_size=2, followups=followups, share_prefix=share)  # type: ignore[arg-type]
    # Freed rows took waiting prompts: fewer batches, so fewer weight passes, and nothing re-prefilled.
    assert len(refilled.calls) < len(batched.calls)
    assert all(cached for _, _, cached in refilled.calls)
    for prompt, p, f, c in zip(prompts, params, followups, got, strict=True):
        assert replace(c, followup_logprobs=None) == generate(model, tokenizer, [prompt], p)[0]
        want = score_pieces(model, tokenizer, f.context(prompt, c.text), f.continuations)
        assert c.followup_logprobs is not None
        for mine, ref in zip(c.followup_logprobs, want, strict=True):
            assert mine == pytest.approx(ref, abs=1e-4)
        if f.then is not None:  # the second followup, read from the same cache in the next step
            assert c.then_logprobs is not None
            want = score_pieces(model, tokenizer, f.then.context(prompt, c.text), f.then.continuations)
            for mine, ref in zip(c.then_logprobs, want, strict=True):
                assert mine == pytest.approx(ref, abs=1e-4)


def test_refill_on_the_tiny_fixture(tiny_model: Yalm, tokenizer: YalmTokenizer, prompts: list[str]) -> None:
    _refill_check(tiny_model, tokenizer, [*prompts, prompts[0][:11], prompts[3][:14]], share=0)


def test_refill_with_a_shared_head_on_the_demo_store(demo: tuple[StreamingModel, YalmTokenizer]) -> None:
    model, tokenizer = demo
    _refill_check(model, tokenizer, [HEAD + t for t in [*TAILS, " Яндекс\nТезис:", " Лукойл (LKOH)\nТезис:"]], share=8)


@pytest.mark.slow
def test_shared_prefix_and_followups_on_gemma3_270m(gemma_fp32_store: Path) -> None:
    # Real Gemma 3 weights (the packaged GGUF): a shared head longer than the 512-position sliding
    # window, so local layers must hide prefix keys by position; then stance followups from the cache.
    from robot_llm.llm.reference import long_prompt
    from robot_llm.llm.tokenizer import load_tokenizer

    model = StreamingModel(gemma_fp32_store, home="ram", device="cpu", dtype="fp32")
    tokenizer = load_tokenizer(gemma_fp32_store)
    try:
        head = long_prompt(560, tokenizer) + "\nCompany:"
        tails = [" Apple\nThesis:", " Sberbank, MOEX\nThesis:", " Nvidia, with no news today\nThesis:"]
        _shared_vs_unshared(model, tokenizer, [head + t for t in tails])  # type: ignore[arg-type]
        _check(model, tokenizer, ["Market news: Apple shares rose.\nThesis:", "Thesis:"], [EN, EN])  # type: ignore[arg-type]
    finally:
        model.close()


def test_followups_the_cache_cannot_serve_are_rescored_a_batch_per_pass(
    tiny_model: Yalm, tokenizer: YalmTokenizer, prompts: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # No slot reserved for the followup step: every row's labels must be re-prefilled (as when a
    # thesis re-tokenises far back), each row's context once with its labels as branches,
    # a batch of rows per weight pass, equal to scoring each continuation on its own.
    import robot_llm.llm.generate as generation

    monkeypatch.setattr(generation, "followup_slots", lambda tokenizer, followup: 0)
    rows = [*prompts, prompts[0][:11]]
    params = PARAMS[: len(rows)]
    followups = [RU, EN, RU, EN, RU]
    counted = Counting(tiny_model, [])
    got = generate(counted, tokenizer, rows, params, batch_size=2, followups=followups)  # type: ignore[arg-type]
    plain = Counting(tiny_model, [])
    generate(plain, tokenizer, rows, params, batch_size=2)  # type: ignore[arg-type]
    assert len(counted.calls) == len(plain.calls) + 3  # 5 rows, 2 per rescoring pass
    for prompt, f, c in zip(rows, followups, got, strict=True):
        want = score_pieces(tiny_model, tokenizer, prompt + c.text + f.cue, f.continuations)
        assert c.followup_logprobs is not None
        assert [len(x) for x in c.followup_logprobs] == [len(x) for x in want]
        for mine, ref in zip(c.followup_logprobs, want, strict=True):
            assert mine == pytest.approx(ref, abs=1e-4)
