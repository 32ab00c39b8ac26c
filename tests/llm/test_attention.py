"""A prefill's attention in query chunks (attention._chunked_attention) computes what the whole call does, for the
masks a night makes: causal with left pads (a chunk of pad slots only), a sliding window that hides far keys, a
shared prefix ahead of the step's own slots, grouped and plain heads."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from robot_llm.llm.families import attention
from robot_llm.llm.families.attention import QUERY_CHUNK, grouped_attention


def _naive(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """fp64 attention written out: query head j reads KV head j // group; a row with no allowed key is zero."""
    B, T, n, hd = q.shape
    group = n // k.shape[2]
    keys = k.double().repeat_interleave(group, dim=2)  # [B, S, n, hd]
    values = v.double().repeat_interleave(group, dim=2)
    scores = torch.einsum("btnd,bsnd->bnts", q.double(), keys) * scale
    scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bnts,bsnd->btnd", probs, values).reshape(B, T, n * hd)


def _mask(pads: list[int], T: int, prefix: int, window: int | None) -> Tensor:
    """[B, 1, T, prefix + T]: True where forbidden; the step's slots follow a shared prefix of ``prefix`` slots."""
    S = prefix + T
    slot = torch.arange(S)
    query = prefix + torch.arange(T)
    rows = []
    for pad in pads:
        forbidden = (slot[None, :] > query[:, None]) | ((slot[None, :] >= prefix) & (slot[None, :] < prefix + pad))
        pos_k = torch.where(slot < prefix, slot, slot - pad)
        pos_q = query - pad
        if window is not None:
            forbidden |= pos_k[None, :] <= pos_q[:, None] - window
        forbidden[:pad] = True  # a pad slot's query sees nothing
        rows.append(forbidden)
    return torch.stack(rows)[:, None]


def _counted(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """A list that grows by one at every call of ``attention.<name>`` (which still runs)."""
    calls: list[int] = []
    function = getattr(attention, name)

    def counted(*args: object) -> Tensor:
        calls.append(1)
        return function(*args)

    monkeypatch.setattr(attention, name, counted)
    return calls


@pytest.mark.parametrize(
    ("n", "kv", "pads", "prefix", "window"),
    [
        (4, 1, [0, 37, 0], 0, None),  # causal, one row left-padded
        (4, 1, [0, 2 * QUERY_CHUNK + 5], 0, None),  # a row whose first chunks are pad slots only
        (2, 2, [3, 0], 0, QUERY_CHUNK + 7),  # plain heads, a window shorter than the prompt
        (4, 2, [0, 11], 24, None),  # a shared prefix ahead of the rows' own slots
    ],
)
def test_chunked_prefill_attention_is_the_whole_calls(
    n: int, kv: int, pads: list[int], prefix: int, window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    T, hd, scale = 4 * QUERY_CHUNK + 9, 16, 0.25
    g = torch.Generator().manual_seed(7)
    q = torch.randn(len(pads), T, n, hd, generator=g)
    k = torch.randn(len(pads), prefix + T, kv, hd, generator=g)
    v = torch.randn(len(pads), prefix + T, kv, hd, generator=g)
    mask = _mask(pads, T, prefix, window)
    calls = _counted(monkeypatch, "_chunked_attention")
    got = grouped_attention(q, k, v, mask, scale)
    assert calls, "a prefill this long takes the chunks"
    expected = _naive(q, k, v, mask, scale)
    assert (got.double() - expected).abs().max() <= 1e-5
    # pad slots' queries come out zero, as the whole call's fully masked rows do
    for b, pad in enumerate(pads):
        assert torch.count_nonzero(got[b, :pad]) == 0
    monkeypatch.setattr(attention, "QUERY_CHUNK", T)  # too long a chunk: the one whole call
    whole = grouped_attention(q, k, v, mask, scale)
    assert len(calls) == 1
    assert (got - whole).abs().max() <= 1e-5


@pytest.mark.parametrize(("n", "kv", "pads", "window"), [(4, 1, [0, 2 * QUERY_CHUNK + 5], None), (2, 2, [3, 0], 70)])
def test_bf16_chunks_take_the_eager_way_where_bf16_is_native(
    n: int, kv: int, pads: list[int], window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the CPU multiplies bf16 natively a chunk is two matmuls and a softmax (transformers' eager way, 2-3x
    torch's fused kernel in bf16), unless one of its queries sees no key: that chunk stays fused, its pad slots zero."""
    T, hd, scale = 4 * QUERY_CHUNK + 9, 16, 0.25
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(len(pads), T, width, hd, generator=g).bfloat16() for width in (n, kv, kv))
    mask = _mask(pads, T, 0, window)
    eager = _counted(monkeypatch, "_eager")
    monkeypatch.setattr(attention, "cpu_has_native_bf16", lambda: True)
    got = grouped_attention(q, k, v, mask, scale)
    chunks = -(-T // QUERY_CHUNK)
    with_pads = sum(1 for t0 in range(0, T, QUERY_CHUNK) if any(pad > t0 for pad in pads))
    assert len(eager) == chunks - with_pads > 0
    assert (got.double() - _naive(q, k, v, mask, scale)).abs().max() <= 0.03  # bf16 probabilities and output
    for b, pad in enumerate(pads):
        assert torch.count_nonzero(got[b, :pad]) == 0
    monkeypatch.setattr(attention, "cpu_has_native_bf16", lambda: False)
    fused = grouped_attention(q, k, v, mask, scale)
    assert len(eager) == chunks - with_pads  # no more
    assert (got.double() - fused.double()).abs().max() <= 0.03
