"""Which KV-cache slots each fed token sees: per-slot validity instead of copying rows.

A KV cache is a rectangle of slots, ``[B, max_len]`` per layer, and every step writes
slots ``length .. length + T - 1`` of every row. What a row *means* is kept separately,
on the CPU, and costs nothing to change:

* ``valid [B, max_len]``: the slot holds one of the row's tokens (False for left padding,
  for tokens fed to a finished row, for a branch scored and forgotten, for tokens rewound);
* ``pos [B, max_len]``: the position of the token in each slot (sliding windows measure in positions);
* ``next_pos [B]``: the rotary position the row's next token gets (its number of valid slots);
* ``active [B]``: the row is still fed by an ordinary step.

So a finished row is masked, not compacted by copying the cache; a row can be rewound to
any prefix of its tokens (invalidate the slots after it); and one step can feed a row a
*tree* of tokens — a trunk plus branches that each see the trunk but not each other — whose
slots are dropped again after the step (:class:`StepLayout`). Nothing here depends on the
model family: only token positions and which keys a query may attend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class StepLayout:
    """The tokens of one cached step and what each of them sees.

    ``real [B, T]``: the token belongs to its row (False: a filler the row does not see).
    ``positions [B, T]``: rotary positions. ``attend [B, T, T]``: token ``t`` of row ``b``
    attends step token ``u`` (itself included). ``keep [B, T]``: the slot stays valid for
    later steps (False for fillers and for branches scored within this step).
    ``window [B, T, 3]`` (None: no limit): token ``t`` sees a key held before the step (the
    shared prefix included) at position ``p`` only when ``p < a`` or ``b <= p < c`` for its
    ``(a, b, c)`` — how a news item's branch sees the prompt before the news and its own item.
    """

    real: Tensor
    positions: Tensor
    attend: Tensor
    keep: Tensor
    window: Tensor | None = None


@dataclass
class SlotState:
    """The meaning of a cache's slots (see the module docstring); CPU tensors."""

    valid: Tensor
    pos: Tensor
    next_pos: Tensor
    active: Tensor
    pad: Tensor
    prefix: int = 0

    @classmethod
    def empty(cls, batch: int, max_len: int, pad: Tensor) -> SlotState:
        """No slot valid yet; row ``b`` will ignore its first ``pad[b]`` fed tokens (left padding)."""
        return cls(
            valid=torch.zeros(batch, max_len, dtype=torch.bool),
            pos=torch.zeros(batch, max_len, dtype=torch.long),
            next_pos=torch.zeros(batch, dtype=torch.long),
            active=torch.ones(batch, dtype=torch.bool),
            pad=pad,
        )

    def share_prefix(self, tokens: int) -> None:
        """Every row continues a shared prefix of ``tokens`` tokens (positions 0 .. tokens-1, keys before slot 0)."""
        self.prefix = tokens
        self.next_pos += tokens

    def append_layout(self, start: int, num_tokens: int) -> StepLayout:
        """The ordinary step: every active row appends ``num_tokens`` tokens (slots under ``pad`` excepted)."""
        slots = torch.arange(start, start + num_tokens)
        real = (slots[None, :] >= self.pad[:, None]) & self.active[:, None]
        order = torch.cumsum(real.long(), dim=1) - 1
        positions = torch.where(real, self.next_pos[:, None] + order, torch.zeros_like(order))
        causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()
        eye = torch.eye(num_tokens, dtype=torch.bool)
        attend = (causal[None] & real[:, None, :]) | eye[None]
        return StepLayout(real=real, positions=positions, attend=attend, keep=real)

    def forbidden(self, start: int, layout: StepLayout) -> Tensor:
        """``[B, 1, T, prefix + start + T]`` bool, True where attention is forbidden."""
        batch, steps = layout.real.shape
        shared = torch.ones(batch, steps, self.prefix, dtype=torch.bool)
        before = self.valid[:, None, :start].expand(batch, steps, start)
        if layout.window is not None:
            held = torch.cat((torch.arange(self.prefix).expand(batch, self.prefix), self.pos[:, :start]), dim=1)
            sees = in_window(held[:, None, :], layout.window)
            shared, before = shared & sees[..., : self.prefix], before & sees[..., self.prefix :]
        return ~torch.cat((shared, before, layout.attend), dim=2)[:, None]

    def key_positions(self, start: int, layout: StepLayout) -> Tensor:
        """``[B, prefix + start + T]``: the position of every key this step may see."""
        shared = torch.arange(self.prefix).expand(layout.positions.shape[0], self.prefix)
        return torch.cat((shared, self.pos[:, :start], layout.positions), dim=1)

    def commit(self, start: int, layout: StepLayout) -> int:
        """Record the step's kept slots; returns the new length (the step's unkept tail is given back)."""
        steps = layout.keep.shape[1]
        self.valid[:, start : start + steps] = layout.keep
        self.pos[:, start : start + steps] = layout.positions
        self.next_pos += layout.keep.sum(dim=1)
        kept = torch.nonzero(layout.keep.any(dim=0)).flatten()
        return start + (int(kept[-1]) + 1 if kept.numel() else 0)

    def rewind(self, row: int, tokens: int) -> None:
        """Keep the first ``tokens`` tokens of ``row`` (shared prefix included); the next gets position ``tokens``."""
        held = torch.nonzero(self.valid[row]).flatten()
        own = tokens - self.prefix
        if not 0 <= own <= held.numel():
            raise ValueError(f"row {row} holds {self.prefix} + {held.numel()} tokens, cannot rewind to {tokens}")
        self.valid[row, held[own:]] = False
        self.next_pos[row] = tokens


def in_window(pos: Tensor, window: Tensor) -> Tensor:
    """Whether keys at ``pos [B, 1|T, K]`` lie in each query's ``window [B, T, 3]`` (see :class:`StepLayout`)."""
    a, b, c = window[..., 0:1], window[..., 1:2], window[..., 2:3]
    return (pos < a) | ((pos >= b) & (pos < c))


#: A branch placed inside the row: ``(length, first_position, seen_below, own_start)``: its tokens get
#: positions from ``first_position`` and see only the row's keys at ``p < seen_below`` or
#: ``own_start <= p < first_position`` (a news item's span), plus their own branch's earlier tokens.
Placed = tuple[int, int, int, int]


def tree_layout(
    rows: int,
    steps: int,
    trees: dict[int, tuple[int, list[int], bool]],
    state: SlotState,
    placed: dict[int, list[Placed]] | None = None,
) -> StepLayout:
    """One step in which row ``b`` of ``trees`` feeds a trunk then branches; active rows append one token.

    ``trees[b] = (trunk, branch_lengths, keep_trunk)``: step tokens ``0 .. trunk-1``
    continue row ``b`` (positions from ``next_pos[b]``; kept when ``keep_trunk``, as for a
    prompt prefilled into a freed row), then each branch's tokens in turn, each branch
    seeing the trunk and its own earlier tokens, positioned right after the trunk (never
    kept), then the row's ``placed`` branches (:data:`Placed`, never kept). Every other active
    row feeds its next token at step index 0 (kept); everything else is filler.
    """
    real = torch.zeros(rows, steps, dtype=torch.bool)
    positions = torch.zeros(rows, steps, dtype=torch.long)
    attend = torch.eye(steps, dtype=torch.bool).repeat(rows, 1, 1)
    keep = torch.zeros(rows, steps, dtype=torch.bool)
    unlimited = torch.tensor([torch.iinfo(torch.long).max, 0, 0])
    window = unlimited.repeat(rows, steps, 1) if placed else None
    for b in range(rows):
        base = int(state.next_pos[b])
        if b in trees:
            trunk, branches, keep_trunk = trees[b]
            real[b, :trunk] = True
            keep[b, :trunk] = keep_trunk
            positions[b, :trunk] = torch.arange(base, base + trunk)
            attend[b, :trunk, :trunk] = torch.ones(trunk, trunk, dtype=torch.bool).tril()
            at = trunk
            for n in branches:
                real[b, at : at + n] = True
                positions[b, at : at + n] = torch.arange(base + trunk, base + trunk + n)
                attend[b, at : at + n, :trunk] = True
                attend[b, at : at + n, at : at + n] = torch.ones(n, n, dtype=torch.bool).tril()
                at += n
            for n, first, below, own in (placed or {}).get(b, []):
                assert window is not None
                real[b, at : at + n] = True
                positions[b, at : at + n] = torch.arange(first, first + n)
                window[b, at : at + n] = torch.tensor([below, own, first])
                attend[b, at : at + n, :trunk] = in_window(positions[b, None, :trunk], window[b, at : at + n])
                attend[b, at : at + n, at : at + n] = torch.ones(n, n, dtype=torch.bool).tril()
                at += n
        elif bool(state.active[b]):
            real[b, 0] = keep[b, 0] = True
            positions[b, 0] = base
    return StepLayout(real=real, positions=positions, attend=attend, keep=keep, window=window)
