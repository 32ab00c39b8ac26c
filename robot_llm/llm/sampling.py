"""Choosing the next token: the argmax, or a draw after temperature, top-k and top-p (§7.4).

The filter keeps the set the original keeps by sorting the whole vocabulary, without the sort
(:func:`kept_tokens`); a draw is one uniform number of the row's own generator against the kept tokens'
cumulative weights. A decode step's rows are chosen together (:func:`choose_tokens`) by ``sample.c``, the same
filter and draw in one pass or three over each row, where our kernels are built; torch's ops are the reference
and the fallback.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from robot_llm.llm.store.gemv import kernels

if TYPE_CHECKING:
    from robot_llm.llm.generate import SamplingParams

#: How far below the most probable token (in logits over the temperature) a top-p filter looks first: every
#: token within it is a candidate, which is the whole answer whenever their cumulative probability passes
#: ``top_p``; a flatter distribution looks twice as far, and again, up to every token.
TOP_P_REACH = 8.0


def kept_tokens(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """The tokens that temperature, top-k and top-p (§7.4) keep of one row of logits ``[V]``: their ids and
    their fp32 logits over ``temperature``; with top-p most probable first (ties in id order), else in id order.

    The same set as sorting the whole vocabulary (as the original does), without the sort: a 262k vocabulary
    took 27 ms a row to sort, every sampled token of a night, more than a batch-32 forward step's share of a
    row. Top-p looks at the tokens within :data:`TOP_P_REACH` of the most probable first: as every other token
    is less probable than each of them, the sorted order's first ranks are theirs; the probabilities are the
    softmax over every token top-k kept, as the original's.
    """
    out = logits.float() / temperature
    vocab = out.shape[-1]
    top_k = top_k if 0 < top_k < vocab else 0
    if top_k:
        out = out.masked_fill(out < torch.topk(out, top_k).values[-1], float("-inf"))  # ties with the k-th stay
    if top_p <= 0.0:
        ids = torch.isfinite(out).nonzero().flatten() if top_k else torch.arange(vocab)
        return ids, out[ids]
    top = out.max()
    total = torch.exp(out - top).sum()
    candidates = int(torch.isfinite(out).sum())  # every token top-k kept
    reach = TOP_P_REACH
    while True:
        ids = (out >= top - reach).nonzero().flatten()
        values = out[ids]
        order = torch.sort(values, descending=True, stable=True).indices
        ids, values = ids[order], values[order]
        cumulative = torch.cumsum(torch.exp(values - top).double() / float(total), dim=0)
        crossed = (cumulative > top_p).nonzero()
        if len(crossed):  # the first rank past p is kept, every later one removed
            last = int(crossed[0])
            return ids[: last + 1], values[: last + 1]
        if len(ids) == candidates:
            return ids, values  # the whole (top-k) set is within p
        reach *= 2


def filter_logits(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 0.0) -> Tensor:
    """Temperature, top-k and top-p exactly as the original (§7.4); returns new fp32 logits ``[..., V]``.

    Removed tokens get ``-inf``; ``softmax`` of the result is the sampling distribution.
    """
    rows = logits.reshape(-1, logits.shape[-1])
    out = torch.full(rows.shape, float("-inf"))
    for row, target in zip(rows, out, strict=True):
        ids, values = kept_tokens(row, temperature, top_k, top_p)
        target[ids] = values
    return out.reshape(logits.shape)


def greedy_tokens(logits: Tensor) -> Tensor:
    """``logits.argmax(-1)`` (the first largest value's index, the first NaN's in a row that holds one) of CPU
    rows ``[..., V]``: ``gemv.c``'s one pass over each row where it is built (torch's took 0.4-0.7 ms a row of
    262k logits), else torch's."""
    lib = kernels()
    if lib is not None and logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16):
        return lib.argmax_rows(logits)
    return torch.argmax(logits, dim=-1)


def choose_token(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from one row of fp32 logits ``[V]``: the argmax, or one draw from the softmax over
    :func:`kept_tokens` (one uniform number of ``generator`` against their cumulative weights)."""
    return choose_tokens(logits.reshape(1, -1), [0], [params], [generator])[0]


def choose_tokens(
    logits: Tensor,
    rows: Sequence[int],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """The next token of each row ``rows[j]`` of fp32 logits ``[B, V]`` by ``params[j]``, as :func:`choose_token`
    picks it (a sampled row's draw one uniform number of ``generators[j]``): ``sample.c``'s, every row in one call
    spread over the threads, where it is built and the rows are CPU fp32; else torch's, a row at a time
    (:func:`kept_tokens`). torch's took 33-89 ms to sample a batch-32 step of Gemma 3 270M's 262k vocabulary at
    temperature 0.7 and top-p 0.9 on one core, as much as the forward step; ours 4.5-5.7
    (``benchmarks/sampling.py``)."""
    lib = kernels()
    if lib is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        return [choose_in_torch(logits[b], p, g) for b, p, g in zip(rows, params, generators, strict=True)]
    draws = [
        0.0 if p.greedy else float(torch.rand(1, generator=g, dtype=torch.float64))
        for p, g in zip(params, generators, strict=True)
    ]
    temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64)
    u, index = torch.tensor(draws, dtype=torch.float64), torch.tensor(rows, dtype=torch.int64)
    out = torch.empty(len(rows), dtype=torch.int64)
    args = (temperature.data_ptr(), top_k.data_ptr(), top_p.data_ptr(), u.data_ptr(), out.data_ptr())
    vocab, threads = logits.shape[-1], torch.get_num_threads()
    if lib.lib.rl_sample_rows(logits.data_ptr(), logits.stride(0), vocab, index.data_ptr(), len(rows), *args, threads):
        raise MemoryError(f"choose_tokens: no memory for a row of {vocab} logits")
    return out.tolist()


def choose_in_torch(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """:func:`choose_token` by torch's ops, a row at a time: the reference ``sample.c`` is tested against, and the
    way where it is not built."""
    if params.greedy:
        return int(torch.argmax(logits, dim=-1))
    ids, values = kept_tokens(logits, params.temperature, params.top_k, params.top_p)
    cumulative = torch.cumsum(torch.exp(values - values.max()).double(), dim=0)  # fp32 sums lose the tail
    draw = torch.rand(1, generator=generator, dtype=torch.float64) * cumulative[-1]
    return int(ids[min(int(torch.searchsorted(cumulative, draw, right=True)), len(ids) - 1)])
