"""A night's work for the offload benchmark: theses from the shipped template, then their stance.

Two ways, each in its own child process of ``offload.py``:

* ``night``: what the worker does now. One template's prompts share their head (its KV
  computed once), the labels are scored from each finished row's KV cache, and the
  content-free calibration prior is scored once;
* ``night-rescore``: what it did before. Generation, then one re-prefill of prompt + thesis
  + cue per thesis to score the labels.

Every weight pass is counted and classified: a pass that only scores labels (a re-prefill,
or the tree step after the last row finished) is a stance pass; a decode step that also
carries the labels of rows that just finished is not.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import torch

from robot_llm.llm.engine.runtime import SHARE_PREFIX_MIN
from robot_llm.llm.generate import SamplingParams, generate
from robot_llm.llm.model import Model, ModelSettings, Policy
from robot_llm.llm.scoring import Followup, score_pieces
from robot_llm.llm.store.demo_checkpoint import train_vocab
from robot_llm.prompting.context import InstrumentView, NewsView, RenderContext
from robot_llm.prompting.loading import bundled_prompts_dir, load_template
from robot_llm.prompting.render import render_prompt
from robot_llm.prompting.stance_prompt import content_free_context

REPO = Path(__file__).resolve().parent.parent
NAMES = ["Сбербанк", "Газпром", "Лукойл", "Яндекс", "Норникель", "Роснефть", "Магнит", "Татнефть"]


def vocabulary(work: Path) -> Path:
    """The demo's SentencePiece vocabulary (trained on the bundled feeds and templates), once per work folder."""
    path = work / "night-vocab.model"
    if not path.exists():
        path.write_bytes(train_vocab([REPO / "robot_llm" / "demo_data" / "feeds", bundled_prompts_dir()]))
    return path


def night_prompts(count: int) -> tuple[list[str], str, Followup]:
    """``count`` thesis_ru prompts (one instrument and one news item each), the content-free context, the labels."""
    template = load_template(bundled_prompts_dir() / "thesis_ru.j2")
    assert template.stance is not None
    as_of = datetime(2026, 11, 27, 20, 0, tzinfo=timezone.utc)
    prompts = []
    for i in range(count):
        name = f"{NAMES[i % len(NAMES)]} {i}"
        news = NewsView(
            id=i,
            title=f"{name} отчитался о прибыли за третий квартал",
            summary=f"Выручка выросла на {i + 3}%, дивиденды сохранены.",
            feed="bench",
            published_at=as_of - timedelta(hours=2),
            fetched_at=as_of - timedelta(hours=1),
            at=as_of - timedelta(hours=2),
        )
        view = InstrumentView(f"T{i:03d}", name, (), "MOEX")
        prompts.append(render_prompt(template, RenderContext(view, as_of, "ru", (news,), ())))
    calibration = content_free_context(template, as_of, timezone.utc)
    return prompts, calibration, Followup(template.stance.cue, tuple(template.stance.labels))


def run_night(
    store: Path, run: dict[str, Any], tokenizer_path: Path, cold: Callable[[], None] = lambda: None
) -> dict[str, Any]:
    """Generate ``run['prompts']`` theses of ``run['new']`` tokens in batches of ``run['batch']``, then their stance.

    An untimed, uncounted warm-up pass (allocator, kernels, first reads) comes first; ``cold`` runs
    after it (the benchmark drops the store's page cache there), so the timed night starts from disk
    like the other rows.
    """
    # Through the door with this row's policy given (layers streamed from disk, fp32, this row's micro-batch):
    # the batches below are the benchmark's own, run on the engine the door built.
    policy = Policy(
        device="cpu",
        compute_dtype="fp32",
        weight_home="disk",
        threads=torch.get_num_threads(),
        micro_batch=run.get("micro"),
    )
    opened = Model.open(ModelSettings(vocab=tokenizer_path, store=store, device="cpu"), policy)
    model, tokenizer = opened.engine, opened.tokenizer
    prompts, calibration, labels = night_prompts(run["prompts"])
    model.forward(torch.tensor([[5, 6]]))
    cold()
    warm_bytes = model.stats.bytes_read
    passes = {"generation": 0, "stance": 0}
    inner = model.forward

    def counted(ids: Any, cache: Any = None, *args: Any, **kwargs: Any) -> Any:
        only_labels = cache is None or (cache.layout is not None and not bool(cache.slots.active.any()))
        passes["stance" if only_labels else "generation"] += 1
        return inner(ids, cache, *args, **kwargs)

    model.forward = counted  # type: ignore[method-assign]
    params = SamplingParams(max_new_tokens=run["new"], greedy=True)
    started = time.perf_counter()
    batches = 0
    for start in range(0, len(prompts), run["batch"]):
        chunk = prompts[start : start + run["batch"]]
        batches += 1
        if run["kind"] == "night":
            done = generate(
                model,
                tokenizer,
                chunk,
                params,
                batch_size=len(chunk),
                followups=[labels] * len(chunk),
                share_prefix=SHARE_PREFIX_MIN,
            )
            if any(c.followup_logprobs is None for c in done):
                raise SystemExit("night: a thesis has no label scores")
            if start == 0:  # the content-free prior: once per template per night
                score_pieces(model, tokenizer, calibration, labels.continuations)
        else:
            for prompt, c in zip(chunk, generate(model, tokenizer, chunk, params, batch_size=len(chunk)), strict=True):
                score_pieces(model, tokenizer, prompt + c.text + labels.cue, labels.continuations)
    elapsed = time.perf_counter() - started
    opened.close()
    theses = len(prompts)
    return {
        "seconds": elapsed,
        "theses": theses,
        "batches": batches,
        "generation_passes": passes["generation"],
        "stance_passes": passes["stance"],
        "passes_per_thesis": (passes["generation"] + passes["stance"]) / theses,
        "stance_passes_per_batch": passes["stance"] / batches,
        "bytes_streamed_per_thesis": (model.stats.bytes_read - warm_bytes) / theses,
    }
