"""Scoring continuations: by re-prefill (:func:`score`), and after a finished completion from its row's live KV cache.

A row that finished its thesis still holds its KV cache (masked, see
:mod:`robot_llm.llm.engine.slots`). Its followup (the stance cue, then each label) is fed as one
*tree* in the next batched step: the row is rewound to the longest prefix that the context
``prompt + text + cue`` shares with what the row was fed, the rest of the context is the
trunk, and every label's pieces but the last form a branch that sees the trunk and not the
other branches. Only the labels' tokens' log-probabilities are gathered
(:func:`token_logprobs`), never a log-softmax over the whole context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from robot_llm.llm.engine.finite import check_logits
from robot_llm.llm.families.family import ForwardModel
from robot_llm.llm.tokenizer import Tokenizer


@dataclass(frozen=True)
class Followup:
    """Continuations to score after a finished completion: ``prompt + text + cue``, then each of them.

    :func:`generate` scores them from the row's live KV cache (no re-prefill); the result
    equals :func:`score_pieces` on ``prompt + text + cue``. With ``after_prompt`` the
    context is ``prompt + cue``: the completion is not read (the row is rewound to its prompt).
    """

    cue: str
    continuations: tuple[str, ...]
    after_prompt: bool = False
    anchor: str | None = None  # with after_prompt: the prompt is cut before the last occurrence of this
    then: Followup | None = None  # scored in the step after this one, from the same row's cache
    hidden: bool = False  # keep the model's hidden state at the cue's last token (a stance head reads it)
    items: tuple[tuple[int, int], ...] = ()  # with after_prompt: news items' char spans in the prompt (see plan_items)

    def __post_init__(self) -> None:
        object.__setattr__(self, "continuations", tuple(self.continuations))

    def context(self, prompt: str, text: str) -> str:
        """The text the continuations are scored after."""
        if not self.after_prompt:
            return prompt + text + self.cue
        cut = prompt.rfind(self.anchor) if self.anchor else -1
        return (prompt[:cut] if cut >= 0 else prompt) + self.cue


#: Tokens a re-tokenised thesis may differ by from what the row fed (plus the cue) and still be scored from the cache.
TRUNK_SLACK = 16


def continuation_ids(tokenizer: Tokenizer, prompt_ids: list[int], prompt: str, continuation: str) -> list[int]:
    """Token ids of ``continuation`` after ``prompt`` as the model would see them.

    Uses the joint tokenization of ``prompt + continuation`` when it starts
    with the prompt's own tokens; otherwise (a piece straddles the boundary)
    the continuation's pieces tokenized on their own.
    """
    joint = tokenizer.encode(prompt + continuation)
    if joint[: len(prompt_ids)] == prompt_ids:
        return joint[len(prompt_ids) :]
    return tokenizer.encode_pieces_ids(continuation)


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """``log p(targets[n])`` under ``logits [N, V]``: only those N rows are normalised, no ``[N, V]`` copy is kept.

    The log-softmax is ``logit - logsumexp(logits)`` taken at the requested tokens, so
    scoring a few label pieces never materialises a log-softmax over the whole context.
    """
    logits = logits.float()
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


@dataclass(frozen=True)
class Tree:
    """A finished row's followup as one step: rewind to ``keep`` tokens, feed the trunk, then each branch."""

    keep: int
    trunk: list[int]
    branches: list[list[int]]  # every continuation's tokens but its last (which is only predicted)
    targets: list[list[int]]  # every continuation's tokens
    items: tuple[ItemBranches | None, ...] = ()  # one per Followup.items span; None: it could not be placed

    @property
    def tokens(self) -> list[int]:
        placed = [t for item in self.items if item is not None for branch in item.branches for t in branch]
        return self.trunk + [t for branch in self.branches for t in branch] + placed

    def placed(self) -> list[tuple[int, int, int, int]]:
        """The item branches as :data:`robot_llm.llm.engine.slots.Placed` entries, in feeding order."""
        return [
            (len(branch), item.end, item.below, item.start)
            for item in self.items
            if item is not None
            for branch in item.branches
        ]


@dataclass(frozen=True)
class ItemBranches:
    """One news item's stance question: the cue (then each label's pieces but the last) placed after the item.

    Token positions: ``below`` is the first item's first token, ``start .. end - 1`` this
    item's tokens. Each branch (one per distinct ``cue + label[:-1]``) is positioned from
    ``end`` and sees only the keys before ``below`` and this item's own; ``label_branch[j]``
    is the branch label ``j`` is read from, ``targets[j]`` the label's tokens.
    """

    below: int
    start: int
    end: int
    cue: int
    branches: list[list[int]]
    label_branch: list[int]
    targets: list[list[int]]


def followup_slots(tokenizer: Tokenizer, followup: Followup | None) -> int:
    """The most tokens (and KV slots) the step scoring a row's followup from its cache may take (0 without one)."""
    if followup is None:
        return 0
    pieces = [len(tokenizer.encode_pieces_ids(c)) for c in followup.continuations]
    cue = len(tokenizer.encode_pieces_ids(followup.cue))
    own = cue + TRUNK_SLACK + sum(max(n - 1, 0) for n in pieces)
    # Per item: the cue (2 tokens of slack for its joint tokenization), once more per multi-piece label.
    per_item = (1 + sum(n > 1 for n in pieces)) * (cue + 2) + sum(max(n - 1, 0) for n in pieces)
    return max(own + len(followup.items) * per_item, followup_slots(tokenizer, followup.then))


def plan_tree(
    tokenizer: Tokenizer, followup: Followup, context: str, fed: list[int], max_pos: int, room: int, shared: int
) -> Tree | None:
    """The step that scores ``followup`` after ``context`` from the cache of a row that was fed ``fed``.

    None when it must be re-prefilled: the context leaves the model's window, parts from what
    was fed inside the shared prefix, or needs more than ``room`` slots.
    """
    ctx = tokenizer.encode(context)
    targets = [continuation_ids(tokenizer, ctx, context, c) for c in followup.continuations]
    if len(ctx) + max(len(t) for t in targets) > max_pos:
        return None
    keep = 0
    limit = min(len(fed), len(ctx) - 1)  # the context's last token must be fed: its logits predict the labels
    while keep < limit and fed[keep] == ctx[keep]:
        keep += 1
    if keep < shared:  # the context parts from the prompt inside the shared prefix
        return None
    items = plan_items(tokenizer, followup, context, ctx)
    tree = Tree(keep=keep, trunk=ctx[keep:], branches=[t[:-1] for t in targets], targets=targets, items=items)
    return tree if len(tree.tokens) <= room else None


def plan_items(
    tokenizer: Tokenizer, followup: Followup, context: str, ctx: list[int]
) -> tuple[ItemBranches | None, ...]:
    """Every news item's branches after ``context`` (tokens ``ctx``), None for an item that cannot be placed.

    Item ``i``'s stance question is the cue right after its last token, its queries seeing the
    keys before the first item and item ``i``'s own keys, not the other items'. Those own keys
    are the ones the night's pass computed (they attended the items before ``i``), so the scores
    depend not at all on the items after ``i`` and on those before it only through item ``i``'s
    keys; for the first item they equal :func:`score_pieces` on ``prompt[:end] + cue``. An item
    is placed when its span lies in the context and the tokenization of the prompt up to its
    start and its end are prefixes of ``ctx`` (otherwise it is None, never guessed).
    """
    if not followup.items:
        return ()

    def token_at(chars: int) -> int | None:
        ids = tokenizer.encode(context[:chars])
        return len(ids) if chars < len(context) and ids == ctx[: len(ids)] else None

    below = token_at(min(start for start, _ in followup.items))
    out: list[ItemBranches | None] = []
    for start, end in followup.items:
        first, last = token_at(start), token_at(end)
        if below is None or first is None or last is None or not below <= first < last:
            out.append(None)
            continue
        head = context[:end] + followup.cue
        cue = continuation_ids(tokenizer, ctx[:last], context[:end], followup.cue)
        targets = [continuation_ids(tokenizer, ctx[:last] + cue, head, c) for c in followup.continuations]
        branches: list[list[int]] = []
        label_branch = []
        for target in targets:
            branch = cue + target[:-1]
            if branch not in branches:
                branches.append(branch)
            label_branch.append(branches.index(branch))
        out.append(ItemBranches(below, first, last, len(cue), branches, label_branch, targets))
    return tuple(out)


Reads = list[tuple[list[int], list[int]]]  # (the step's positions whose logits predict them, the target tokens)


def _branch_reads(tree: Tree) -> Reads:
    """Each continuation's target and the positions that predict it (empty for an empty continuation)."""
    reads: Reads = []
    last, at = len(tree.trunk) - 1, len(tree.trunk)
    for branch, target in zip(tree.branches, tree.targets, strict=True):
        # Piece 0 is predicted by the trunk's last token, piece j by the branch's piece j - 1.
        reads.append(([last, *range(at, at + len(branch))] if target else [], target))
        at += len(branch)
    return reads


def _item_reads(tree: Tree) -> list[Reads | None]:
    """Per news item (None: unplaced), each label's target and the positions that predict it."""
    at = len(tree.trunk) + sum(len(branch) for branch in tree.branches)
    out: list[Reads | None] = []
    for item in tree.items:
        if item is None:
            out.append(None)
            continue
        starts = []
        for branch in item.branches:
            starts.append(at)
            at += len(branch)
        # Piece 0 is predicted by the cue's last token, piece k by the label's piece k - 1, in its branch.
        firsts = [starts[item.label_branch[j]] + item.cue - 1 for j in range(len(item.targets))]
        out.append([(list(range(f, f + len(t))), t) for f, t in zip(firsts, item.targets, strict=True)])
    return out


def tree_slots(tree: Tree) -> list[int]:
    """The positions of ``tree``'s step whose logits are read: the trunk's last and every label piece's predictor.

    The output head runs at these only (a trunk re-fed from a prompt is hundreds of positions, a head
    of 262k tokens costs as much as the layers at each)."""
    slots = {len(tree.trunk) - 1}
    for positions, _ in _branch_reads(tree):
        slots.update(positions)
    for item in _item_reads(tree):
        for positions, _ in item or ():
            slots.update(positions)
    return sorted(slots)


def tree_select(trees: dict[int, Tree], rows: int, steps: int) -> Tensor:
    """The ``[rows, steps]`` positions of a tree step whose logits are read (:func:`tree_slots` of each tree)."""
    select = torch.zeros(rows, steps, dtype=torch.bool)
    for b, tree in trees.items():
        select[b, tree_slots(tree)] = True
    return select


def _logprobs(logits: Tensor | StepLogits, b: int, reads: Reads) -> tuple[tuple[float, ...], ...]:
    return tuple(
        tuple(token_logprobs(logits[b, torch.tensor(slots)], torch.tensor(target)).tolist()) if target else ()
        for slots, target in reads
    )


def item_scores(logits: Tensor | StepLogits, b: int, tree: Tree) -> tuple[tuple[tuple[float, ...], ...] | None, ...]:
    """Row ``b``'s per-item label log-probabilities (per token) from the step's logits, None for unplaced items."""
    return tuple(None if reads is None else _logprobs(logits, b, reads) for reads in _item_reads(tree))


def tree_scores(logits: Tensor | StepLogits, trees: dict[int, Tree]) -> dict[int, tuple[tuple[float, ...], ...]]:
    """Each tree's continuation log-probabilities (per token), gathered from the step's logits ``[B, T, V]``."""
    return {b: _logprobs(logits, b, _branch_reads(tree)) for b, tree in trees.items()}


class StepLogits:
    """A step's logits computed at the ``select``ed positions only (``[N, V]``, row-major), indexed like the
    ``[B, T, V]`` tensor they stand for; reading a position that was not computed raises ``IndexError``."""

    def __init__(self, packed: Tensor, select: Tensor) -> None:
        self.packed = packed
        self.index = torch.full(select.shape, -1, dtype=torch.long)
        self.index[select] = torch.arange(packed.shape[0])

    def __getitem__(self, key: object) -> Tensor:
        at = self.index[key]
        if bool((at < 0).any()):
            raise IndexError(f"logits at {key} were not computed in this step")
        return self.packed[at]


def tree_hidden(model: ForwardModel, b: int, tree: Tree) -> tuple[float, ...] | None:
    """Row ``b``'s hidden state (before the output head) at ``tree``'s trunk end, from the pass that scored it.

    The token whose logits predict the labels: a stance head reads the same position in the
    same weight pass. None for an engine that keeps no ``last_hidden`` (DeepSpeed).
    """
    hidden = getattr(model, "last_hidden", None)
    if hidden is None:
        return None
    return tuple(hidden[b, len(tree.trunk) - 1].float().cpu().tolist())


def score_pieces(
    model: ForwardModel,
    tokenizer: Tokenizer,
    prompt: str,
    continuations: Sequence[str],
    *,
    batch_size: int = 8,
) -> list[list[float]]:
    """Log-probability of every token of each continuation after ``prompt`` (an empty list for no tokens).

    A re-prefill of prompt + continuation per row; :func:`generate` with ``followups``
    computes the same from the live KV cache of a finished row instead.
    """
    prompt_ids = tokenizer.encode(prompt)
    seqs = [(prompt_ids, continuation_ids(tokenizer, prompt_ids, prompt, c)) for c in continuations]
    max_pos = model.config.max_position_embeddings
    for i, (p, c) in enumerate(seqs):
        if len(p) + len(c) > max_pos:
            raise ValueError(f"prompt + continuation {i} has {len(p) + len(c)} tokens, the model takes {max_pos}")
    scores: list[list[float]] = []
    for start in range(0, len(seqs), batch_size):
        chunk = seqs[start : start + batch_size]
        width = max(len(p) + len(c) for p, c in chunk)
        pad = torch.tensor([width - len(p) - len(c) for p, c in chunk], dtype=torch.long)
        ids = torch.full((len(chunk), width), tokenizer.eos_id, dtype=torch.long)
        # Token at sequence index t is predicted by the logits at slot pad + t - 1: the head runs there only.
        slots = [torch.arange(len(p) - 1, len(p) + len(c) - 1) + int(pad[b]) for b, (p, c) in enumerate(chunk)]
        select = torch.zeros(len(chunk), width, dtype=torch.bool)
        for b, (p, c) in enumerate(chunk):
            ids[b, int(pad[b]) :] = torch.tensor(p + c)
            select[b, slots[b]] = True
        logits = StepLogits(model.forward(ids, None, pad, select=select), select)
        for b, (_, c) in enumerate(chunk):
            check_logits(logits[b, slots[b]], model)
            scores.append(token_logprobs(logits[b, slots[b]], torch.tensor(c, dtype=torch.long)).tolist())
    return scores


def score(
    model: ForwardModel,
    tokenizer: Tokenizer,
    prompt: str,
    continuations: Sequence[str],
    *,
    batch_size: int = 8,
) -> list[float]:
    """Sum of log-probabilities of each continuation's tokens after ``prompt`` (0.0 for no tokens)."""
    return [
        float(sum(pieces)) for pieces in score_pieces(model, tokenizer, prompt, continuations, batch_size=batch_size)
    ]
