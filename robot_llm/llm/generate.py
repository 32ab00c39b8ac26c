"""Batched generation with a KV cache.

:func:`generate` gives every prompt batch-1 semantics: its own token budget,
its own random generator (so a sampled result does not depend on batch-mates),
its own stop conditions. Prompts of different lengths share a batch by left
padding (see :mod:`robot_llm.llm.families.family`); a finished row stays in the KV cache, masked
(:mod:`robot_llm.llm.engine.slots`), until its stance is scored and its slot takes a waiting prompt.

:func:`robot_llm.llm.families.original.generate_original` reproduces the original
single-prompt loop; continuations are scored (by re-prefill, or from the cache) with :mod:`robot_llm.llm.scoring`.

The token filter (:func:`~robot_llm.llm.sampling.filter_logits`) follows §7.4 exactly: temperature,
then top-k keeping ties at the threshold, then top-p on the already filtered
logits keeping every token whose preceding cumulative probability is <= p.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from robot_llm.llm.engine.finite import check_logits, check_rows
from robot_llm.llm.engine.kv_cache import KVCache
from robot_llm.llm.engine.slots import tree_layout
from robot_llm.llm.families.family import ForwardModel
from robot_llm.llm.sampling import choose_tokens
from robot_llm.llm.scoring import (
    Followup,
    StepLogits,
    Tree,
    followup_slots,
    item_scores,
    plan_tree,
    tree_hidden,
    tree_scores,
    tree_select,
    tree_slots,
)
from robot_llm.llm.tokenizer import Tokenizer

FinishReason = Literal["eos", "stop", "length"]
#: Per news item, each label's per-token log-probabilities (None: the item could not be placed).
ItemScores = tuple[tuple[tuple[float, ...], ...] | None, ...]


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt.

    ``greedy`` takes the argmax (first index on ties) and ignores the other
    sampling fields; otherwise logits are divided by ``temperature``, filtered
    by ``top_k`` (0 = off) and ``top_p`` (0.0 = off) and one token is drawn with
    a generator seeded by ``seed``. Generation stops at EOS, when the decoded
    continuation contains one of ``stop``, after ``max_new_tokens`` tokens, or
    when the sequence fills the model's ``max_position_embeddings``.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    greedy: bool = False
    seed: int = 1234
    stop: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (use greedy=True for argmax), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


@dataclass(frozen=True)
class Completion:
    """One generated continuation.

    ``token_ids`` are the new tokens (an EOS that ended the generation is
    included, like the original); ``text`` is the continuation's text without
    the prompt, cut before the stop string when ``finish_reason == "stop"``.
    """

    text: str
    token_ids: tuple[int, ...]
    prompt_token_count: int
    new_token_count: int
    finish_reason: FinishReason
    followup_logprobs: tuple[tuple[float, ...], ...] | None = None
    then_logprobs: tuple[tuple[float, ...], ...] | None = None  # the followup's ``then``
    hidden: tuple[float, ...] | None = None  # the hidden state where a ``Followup(hidden=True)`` was scored
    item_logprobs: ItemScores | None = None  # per ``Followup.items`` span (the followup or its ``then``'s)


def continuation_text(tokenizer: Tokenizer, prompt_ids: list[int], new_ids: list[int]) -> str:
    """Text that ``new_ids`` add after the prompt.

    Decodes prompt + continuation together (so a piece's leading space is
    kept) and removes the decoded prompt. The original instead cuts the
    *raw* prompt's character length, which is off when SentencePiece
    normalisation changed the prompt (§9.12).
    """
    full = tokenizer.decode(prompt_ids + new_ids)
    head = tokenizer.decode(prompt_ids)
    if full.startswith(head):
        return full[len(head) :]
    return tokenizer.decode(new_ids)


@dataclass
class _Row:
    index: int
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    budget: int
    generator: torch.Generator | None
    followup: Followup | None = None
    new_ids: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    text: str = ""
    followup_logprobs: tuple[tuple[float, ...], ...] | None = None
    then_logprobs: tuple[tuple[float, ...], ...] | None = None
    hidden: tuple[float, ...] | None = None
    item_logprobs: ItemScores | None = None

    def push(self, token: int, tokenizer: Tokenizer) -> None:
        self.new_ids.append(token)
        if token == tokenizer.eos_id:
            self.finish = "eos"
            return
        if self.params.stop:
            text = continuation_text(tokenizer, self.prompt_ids, self.new_ids)
            cuts = [text.find(s) for s in self.params.stop if s in text]
            if cuts:
                self.text = text[: min(cuts)]
                self.finish = "stop"
                return
        if len(self.new_ids) >= self.budget:
            self.finish = "length"

    def completion(self, tokenizer: Tokenizer) -> Completion:
        text = self.text if self.finish == "stop" else continuation_text(tokenizer, self.prompt_ids, self.new_ids)
        return Completion(
            text=text,
            token_ids=tuple(self.new_ids),
            prompt_token_count=len(self.prompt_ids),
            new_token_count=len(self.new_ids),
            finish_reason=self.finish or "length",
            followup_logprobs=self.followup_logprobs,
            then_logprobs=self.then_logprobs,
            hidden=self.hidden,
            item_logprobs=self.item_logprobs,
        )

    def followup_context(self, tokenizer: Tokenizer, followup: Followup | None = None) -> str:
        followup = followup or self.followup
        assert followup is not None
        return followup.context(self.prompt, self.completion(tokenizer).text)


def shared_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens every prompt starts with, leaving each at least one token of its own (its logits come from it)."""
    if not prompts:
        return 0
    limit = min(len(p) for p in prompts) - 1
    n = 0
    while n < limit and all(p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n


def _run_batch(
    model: ForwardModel,
    tokenizer: Tokenizer,
    rows: list[_Row],
    on_step: Callable[[], None] | None,
    share_prefix: int,
    pending: deque[_Row],
    refill_slots: int,
) -> int:
    """Generate for ``rows`` (all with budget >= 1) in one left-padded batch, and score their followups.

    A finished row stays in the cache, masked (no copy); the step after it finished
    scores its followup as a tree of tokens from its cache, alongside the other rows'
    decode tokens, so followups cost no weight pass of their own except after the last row.
    With ``refill_slots`` more slots per row, a freed row takes the next ``pending`` prompt
    (prefilled in a decode step of the others) while the cache has room for it to finish;
    returns how many pending prompts were taken.
    """
    shared = shared_prefix_length([r.prompt_ids for r in rows]) if len(rows) > 1 else 0
    if not share_prefix or shared < share_prefix:
        shared = 0
    head = rows[0].prompt_ids[:shared]
    width = max(len(r.prompt_ids) for r in rows) - shared
    pad = torch.tensor([width + shared - len(r.prompt_ids) for r in rows], dtype=torch.long)
    ids = torch.full((len(rows), width), tokenizer.eos_id, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width + shared - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids[shared:])
    tree_width = max(followup_slots(tokenizer, r.followup) for r in [*rows, *pending])
    max_pos = model.config.max_position_embeddings
    # The last token of a row is never fed back, hence width + budget - 1 slots, plus one tree step.
    cache = model.new_cache(len(rows), width + max(r.budget for r in rows) - 1 + tree_width + refill_slots, pad)
    if shared:
        # The template's common head: one row of KV, computed once, attended by every row.
        prefix = model.new_cache(1, shared)
        check_logits(model.forward(torch.tensor([head]), prefix, last_only=True), model)
        if on_step is not None:
            on_step()
        cache.share_prefix(prefix)
    logits = model.forward(ids, cache, last_only=True)[:, -1]
    check_logits(logits, model)
    if on_step is not None:
        on_step()
    taken = 0
    freed: list[int] = []  # rows whose thesis and followup are done: free for a pending prompt
    carried: dict[int, Tree] = {}  # rows whose followup's ``then`` is scored in this step
    while True:
        trees: dict[int, Tree] = carried
        seconds, carried = set(trees), {}
        # Only live rows: a finished row's masked position means nothing.
        live = cache.slots.active.nonzero().flatten().tolist()
        check_rows(logits, live, model)
        chosen = choose_tokens(logits, live, [rows[b].params for b in live], [rows[b].generator for b in live])
        for b, token in zip(live, chosen, strict=True):
            r = rows[b]
            r.push(token, tokenizer)
            if r.finish is None:
                continue
            cache.slots.active[b] = False
            room = cache.max_len - cache.length
            tree = None
            if r.followup is not None:
                fed = r.prompt_ids + r.new_ids[:-1]  # the last token chosen is never fed back
                context = r.followup_context(tokenizer)
                tree = plan_tree(tokenizer, r.followup, context, fed, max_pos, room, shared)
            if tree is not None:
                cache.slots.rewind(b, tree.keep)
                trees[b] = tree
            else:
                freed.append(b)
        fills = _refill(rows, freed, pending, cache, trees, tree_width, head) if refill_slots else {}
        taken += len(fills)
        if not trees and not fills and not bool(cache.slots.active.any()):
            return taken
        steps = max([1, *(len(t.tokens) for t in trees.values()), *(len(f) for f in fills.values())])
        step = torch.full((len(rows), steps), tokenizer.eos_id, dtype=torch.long)
        for b, r in enumerate(rows):
            if b in trees:
                step[b, : len(trees[b].tokens)] = torch.tensor(trees[b].tokens)
            elif b in fills:
                step[b, : len(fills[b])] = torch.tensor(fills[b])
            elif bool(cache.slots.active[b]):
                step[b, 0] = r.new_ids[-1]
        out: Tensor | StepLogits
        if trees or fills:
            shapes = {b: (len(t.trunk), [len(x) for x in t.branches], False) for b, t in trees.items()}
            shapes |= {b: (len(f), [], True) for b, f in fills.items()}
            cache.layout = tree_layout(len(rows), steps, shapes, cache.slots, {b: t.placed() for b, t in trees.items()})
            # The head only where read: every row's first position (the live rows' next token), each tree's
            # label predictors, each refilled prompt's last token.
            select = tree_select(trees, len(rows), steps)
            select[:, 0] = True
            for b, f in fills.items():
                select[b, len(f) - 1] = True
            out = StepLogits(model.forward(step, cache, select=select), select)
        else:
            out = model.forward(step, cache, last_only=True)
        if on_step is not None:
            on_step()
        for b, tree in trees.items():
            check_logits(out[b, tree_slots(tree)], model)
        for b, scores in tree_scores(out, trees).items():
            if b in seconds:
                rows[b].then_logprobs = scores
            else:
                rows[b].followup_logprobs = scores
            _keep_hidden(model, rows[b], b, trees[b], out, then=b in seconds)
        for b, tree in trees.items():
            second = _then_tree(tokenizer, rows[b], tree, max_pos, cache, shared) if b not in seconds else None
            if second is not None:  # the row stays out of the refill until its second followup is read
                cache.slots.rewind(b, second.keep)
                carried[b] = second
            else:
                freed.append(b)
        logits = out[:, 0]
        for b, f in fills.items():
            logits[b] = out[b, len(f) - 1]
            cache.slots.active[b] = True


def _then_tree(tokenizer: Tokenizer, r: _Row, done: Tree, max_pos: int, cache: KVCache, shared: int) -> Tree | None:
    """The step scoring ``r``'s second followup from its cache, which now holds ``done.keep`` tokens (None: none)."""
    then = r.followup.then if r.followup is not None else None
    if then is None:
        return None
    fed = (r.prompt_ids + r.new_ids[:-1])[: done.keep]
    return plan_tree(
        tokenizer, then, r.followup_context(tokenizer, then), fed, max_pos, cache.max_len - cache.length, shared
    )


def _refill(
    rows: list[_Row],
    freed: list[int],
    pending: deque[_Row],
    cache: KVCache,
    trees: dict[int, Tree],
    tree_width: int,
    head: list[int],
) -> dict[int, list[int]]:
    """Give freed rows the next pending prompts that can still finish in the cache; their tokens to prefill by row."""
    fills: dict[int, list[int]] = {}
    while freed and pending and pending[0].prompt_ids[: len(head)] == head:
        own = pending[0].prompt_ids[len(head) :]
        steps = max([len(own), *(len(f) for f in fills.values())])
        left = [r.budget - len(r.new_ids) for b, r in enumerate(rows) if bool(cache.slots.active[b])]
        need = max([pending[0].budget, *(rows[b].budget for b in fills), *left])
        # After this step the shared length grows by the longest prompt fed; every live row must still finish.
        if max(steps, *(len(t.tokens) for t in trees.values()), 1) > cache.max_len - cache.length:
            break
        if cache.length + steps + need - 1 + tree_width > cache.max_len:
            break
        b = freed.pop(0)
        rows[b] = pending.popleft()
        cache.slots.rewind(b, len(head))
        fills[b] = own
    return fills


def generate(
    model: ForwardModel,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    *,
    batch_size: int = 8,
    on_progress: Callable[[int, int], None] | None = None,
    on_step: Callable[[], None] | None = None,
    followups: Sequence[Followup | None] | None = None,
    share_prefix: int = 0,
    refill_slots: int = 0,
) -> list[Completion]:
    """Continue every prompt; returns one :class:`Completion` per prompt, in order.

    ``params`` is one :class:`SamplingParams` for all prompts or one per prompt.
    Prompts are grouped by token length into batches of ``batch_size``; every
    prompt's result is what it would get alone. ``on_progress(done, total)`` is
    called after each batch, ``on_step()`` after every forward pass (prefill or one
    decode step of the batch: the unit of liveness when one batch takes long). A prompt
    longer than ``max_position_embeddings`` tokens (BOS included) raises ``ValueError``.

    ``followups`` (one per prompt, or None) are scored after each finished completion
    into ``Completion.followup_logprobs``, from the row's KV cache when they fit the
    step reserved for them, else by a re-prefill of their contexts (``batch_size`` rows per pass);
    they stay None when the context does not fit the model's window.

    ``share_prefix`` (0 = off): when the prompts of a batch start with at least that many
    common tokens (a template's head), their KV is computed once in a pass of its own,
    stored once and attended by every row; each row's logits stay what they would be alone.

    ``refill_slots`` (0 = off): KV slots per row reserved beyond the batch's own need, so
    that a row whose thesis is done can take the next waiting prompt (continuous batching)
    instead of idling until the whole batch is done.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
    max_pos = model.config.max_position_embeddings
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} pieces but the model only {model.config.vocab_size} rows"
        )
    per_followup = list(followups) if followups is not None else [None] * len(prompts)
    if len(per_followup) != len(prompts):
        raise ValueError(f"{len(per_followup)} followups for {len(prompts)} prompts")
    rows: list[_Row] = []
    for i, (prompt, p, f) in enumerate(zip(prompts, per_prompt, per_followup, strict=True)):
        ids = tokenizer.encode(prompt)
        if len(ids) > max_pos:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, the model takes at most {max_pos}")
        generator = None if p.greedy else torch.Generator().manual_seed(p.seed)
        rows.append(_Row(i, prompt, ids, p, min(p.max_new_tokens, max_pos - len(ids)), generator, f))
    for r in rows:
        if r.budget == 0:
            r.finish = "length"
    todo = deque(sorted((r for r in rows if r.finish is None), key=lambda r: len(r.prompt_ids)))
    done = len(rows) - len(todo)
    while todo:
        chunk = [todo.popleft() for _ in range(min(batch_size, len(todo)))]
        done += len(chunk) + _run_batch(model, tokenizer, chunk, on_step, share_prefix, todo, refill_slots)
        if on_progress is not None:
            on_progress(done, len(rows))
    _rescore([r for r in rows if r.followup is not None and r.followup_logprobs is None], model, tokenizer, batch_size)
    thens = [r for r in rows if r.followup is not None and r.followup.then is not None and r.then_logprobs is None]
    _rescore(thens, model, tokenizer, batch_size, then=True)
    return [r.completion(tokenizer) for r in rows]


def _rescore(
    rows: list[_Row], model: ForwardModel, tokenizer: Tokenizer, batch_size: int, *, then: bool = False
) -> None:
    """Followups the cache could not serve (no token generated, a thesis re-tokenised far back): re-prefilled.

    ``batch_size`` rows per weight pass, each row's context once with its continuations as
    branches (the tree of :func:`generate`'s cache path on an empty cache), not one pass per
    row and continuation. A context longer than the model's window stays unscored: the
    caller decides what to judge instead.
    """
    max_pos = model.config.max_position_embeddings
    planned = []
    for r in rows:
        assert r.followup is not None
        followup = r.followup.then if then else r.followup
        assert followup is not None
        tree = plan_tree(tokenizer, followup, r.followup_context(tokenizer, followup), [], max_pos, sys.maxsize, 0)
        if tree is not None:
            planned.append((r, tree))
    for start in range(0, len(planned), batch_size):
        chunk = planned[start : start + batch_size]
        trees = {b: tree for b, (_, tree) in enumerate(chunk)}
        steps = max(len(tree.tokens) for tree in trees.values())
        cache = model.new_cache(len(chunk), steps)
        step = torch.full((len(chunk), steps), tokenizer.eos_id, dtype=torch.long)
        for b, tree in trees.items():
            step[b, : len(tree.tokens)] = torch.tensor(tree.tokens)
        shapes = {b: (len(t.trunk), [len(x) for x in t.branches], False) for b, t in trees.items()}
        cache.layout = tree_layout(len(chunk), steps, shapes, cache.slots, {b: t.placed() for b, t in trees.items()})
        select = tree_select(trees, len(chunk), steps)
        out = StepLogits(model.forward(step, cache, select=select), select)
        for b, tree in trees.items():
            check_logits(out[b, tree_slots(tree)], model)
        for b, scores in tree_scores(out, trees).items():
            if then:
                chunk[b][0].then_logprobs = scores
            else:
                chunk[b][0].followup_logprobs = scores
            _keep_hidden(model, chunk[b][0], b, trees[b], out, then=then)


def _keep_hidden(model: ForwardModel, r: _Row, b: int, tree: Tree, logits: Tensor | StepLogits, *, then: bool) -> None:
    """Keep row ``r``'s hidden state at ``tree``'s trunk end, and its items' scores, when the followup asks."""
    assert r.followup is not None
    followup = r.followup.then if then else r.followup
    if followup is not None and followup.hidden:
        r.hidden = tree_hidden(model, b, tree)
    if followup is not None and followup.items:
        r.item_logprobs = item_scores(logits, b, tree)
