"""The token filter and the sampler without a sort of the vocabulary (generate.kept_tokens): the same kept set
as sorting every token, the draws distributed as the filtered softmax."""

from __future__ import annotations

import pytest
import torch

from robot_llm.llm.generate import SamplingParams
from robot_llm.llm.sampling import (
    TOP_P_REACH,
    choose_in_torch,
    choose_token,
    choose_tokens,
    filter_logits,
    greedy_tokens,
    kept_tokens,
)
from robot_llm.llm.store.gemv import kernels


def _sorted_filter(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> tuple[list[float], float]:
    """§7.4 by sorting the whole vocabulary, in float64: the kept tokens' logits (which of several tokens tied
    at the cut is kept is the sort's business), and how far the cumulative probability at the cut lies from p (a
    cut closer than rounding can tell is no test of the filter)."""
    out = logits.double() / temperature
    if top_k:
        out = out.masked_fill(out < torch.topk(out, min(top_k, len(out))).values[-1], float("-inf"))
    if not top_p:
        return sorted(logits[torch.isfinite(out)].tolist()), 1.0
    values, ids = torch.sort(out, descending=True, stable=True)
    cumulative = torch.cumsum(torch.softmax(values, 0), 0)
    keep = torch.ones_like(cumulative, dtype=torch.bool)
    keep[1:] = cumulative[:-1] <= top_p
    keep &= torch.isfinite(values)
    return sorted(logits[ids[keep]].tolist()), float((cumulative - top_p).abs().min())


def test_the_kept_set_is_the_sorted_vocabularys() -> None:
    g = torch.Generator().manual_seed(3)
    checked = 0
    for case in range(60):
        vocab = (50, 5000, 262144)[case % 3]
        scale = (0.3, 1.0, 3.0, 8.0)[case % 4]  # flat (thousands kept: the candidates grow) to peaked (a few)
        logits = torch.randn(vocab, generator=g) * scale
        if case % 5 == 0:
            logits = logits.bfloat16().float()  # a bf16 model's logits: ties everywhere
        temperature, top_k, top_p = (0.7, 1.0, 1.3)[case % 3], (0, 0, 40, 3000)[case % 4], (0.0, 0.5, 0.9)[case % 3]
        want, margin = _sorted_filter(logits, temperature, top_k, top_p)
        ids, values = kept_tokens(logits, temperature, top_k, top_p)
        assert len(set(ids.tolist())) == len(ids)
        assert torch.equal(values, logits[ids].float() / temperature)
        if top_p:
            assert torch.all(values[:-1] >= values[1:])  # most probable first
        if margin < 1e-9:
            continue
        checked += 1
        assert sorted(logits[ids].tolist()) == want, (case, len(ids), len(want))
        filtered = filter_logits(logits, temperature, top_k, top_p)
        assert torch.isfinite(filtered).nonzero().flatten().tolist() == sorted(ids.tolist())
    assert checked >= 50
    flat = torch.randn(5000, generator=g) * 0.3
    assert flat.max() - flat.min() < TOP_P_REACH and len(kept_tokens(flat, 1.0, 0, 0.9)[0]) > 4000  # all candidates
    # beyond the first reach, 10,000 tokens with 55 % of the mass: the reach grows to take some of them
    wide = torch.cat([torch.zeros(1), torch.full((10000,), -1.125 * TOP_P_REACH)])
    ids, _ = kept_tokens(wide, 1.0, 0, 0.5)
    assert 1 < len(ids) < 10001 and sorted(wide[ids].tolist()) == _sorted_filter(wide, 1.0, 0, 0.5)[0]


def test_draws_follow_the_filtered_softmax() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -1.0, -30.0, 0.9])
    for params in (
        SamplingParams(temperature=0.8, top_p=0.9, seed=0),
        SamplingParams(temperature=1.2, top_k=3, seed=0),
        SamplingParams(temperature=1.0, seed=0),
    ):
        want = torch.softmax(filter_logits(logits, params.temperature, params.top_k, params.top_p), -1).double()
        g = torch.Generator().manual_seed(11)
        draws = 20000
        counts = torch.bincount(torch.tensor([choose_token(logits, params, g) for _ in range(draws)]), minlength=7)
        seen = counts.double() / draws
        sigma = (want * (1 - want) / draws).sqrt()
        assert torch.all((seen - want).abs() <= 5 * sigma + 1e-12), (params, seen, want)
        assert torch.all(counts[want == 0] == 0)
    again = [choose_token(logits, SamplingParams(seed=0), torch.Generator().manual_seed(5)) for _ in range(2)]
    assert again[0] == again[1]  # one generator's draws are reproducible


def test_greedy_tokens_are_torchs_argmax() -> None:
    g = torch.Generator().manual_seed(4)
    # 262,155 = 8,192 passes of 32 (four vectors of 8 at once), then 11 single values
    rows = torch.randn(8, 262155, generator=g)
    rows[0, 59] = 90.0  # in the fourth running maximum's lanes
    rows[1, 7], rows[1, 70000] = 50.0, 50.0  # a tie: the first
    rows[2, 262146] = 60.0  # in the tail past the last whole pass
    rows[3, 5], rows[3, 9] = float("nan"), 99.0  # a NaN wins, as torch's
    rows[4] = float("-inf")
    rows[5, 262154] = 70.0  # the tail's last
    rows[6, 262150] = float("nan")  # a NaN in the tail
    rows[7, 27], rows[7, 262148] = 80.0, 80.0  # a tie across a running maximum and the tail
    for dtype in (torch.float32, torch.bfloat16):
        x = rows.to(dtype)
        assert torch.equal(greedy_tokens(x), torch.argmax(x, -1)), dtype
        assert greedy_tokens(x[1]).shape == () and int(greedy_tokens(x[1])) == 7
    assert greedy_tokens(rows[:, :5].t().contiguous().t()).tolist() == torch.argmax(rows[:, :5], -1).tolist()


@pytest.mark.skipif(kernels() is None, reason="sample.c is built where gemv.c is (AVX2, FMA, a C compiler)")
def test_a_batch_of_rows_is_chosen_as_torch_chooses_each() -> None:
    """sample.c, every row in one call, against torch's ops a row at a time: the same tokens, with the same draws
    of each row's generator, for logits as peaked as a model's (a few dozen tokens within reach of the top; a flat
    row keeps thousands, and there the exponentials' last bits move a draw by a rank)."""
    g = torch.Generator().manual_seed(7)
    for case in range(24):
        vocab = (7, 50, 5003, 262144)[case % 4]  # below, at and past a vector's width; a tail past the last vector
        rows = 9
        logits = torch.randn(rows, vocab, generator=g) * (4.0, 6.0, 10.0)[case % 3]
        if case % 5 == 0:
            logits = logits.bfloat16().float()  # ties
        if case % 6 == 1:
            logits[:, ::4] = float("-inf")  # masked tokens
        logits[3] = logits[3].max() + 1.0  # a whole row tied at its top
        logits = torch.cat([logits, torch.zeros(rows, 3)], 1)[:, :vocab]  # rows apart by more than their width
        params = [
            SamplingParams(
                temperature=(0.7, 1.0, 1.3)[(case + b) % 3],
                top_k=(0, 0, 5, 40, 3000)[(case + b) % 5],
                top_p=(0.9, 0.0, 0.5, 1.0)[(case + b) % 4],
                greedy=b == 4,
            )
            for b in range(rows)
        ]
        chosen = [1, 3, 4, 6, 8]  # some rows only, in order: a finished row is not chosen for
        generators = [torch.Generator().manual_seed(100 * case + b) for b in chosen]
        ours = choose_tokens(logits, chosen, [params[b] for b in chosen], generators)
        generators_again = [torch.Generator().manual_seed(100 * case + b) for b in chosen]
        want = [choose_in_torch(logits[b], params[b], gen) for b, gen in zip(chosen, generators_again, strict=True)]
        assert ours == want, (case, vocab)
        # one draw of each sampled row's generator, none of the greedy row's: the next draws are torch's next
        assert [float(torch.rand(1, generator=a)) for a in generators] == [
            float(torch.rand(1, generator=b)) for b in generators_again
        ]


@pytest.mark.skipif(kernels() is None, reason="sample.c is built where gemv.c is (AVX2, FMA, a C compiler)")
def test_the_draws_ends_are_the_kept_sets() -> None:
    """A uniform number of 0 draws the most probable kept token and one just below 1 the least probable: the
    kept set's ends, which must be kept_tokens' (the sorted vocabulary's) on flat rows too."""
    lib = kernels()
    assert lib is not None
    g = torch.Generator().manual_seed(9)
    checked = 0
    for case in range(30):
        vocab = (50, 5000, 262144)[case % 3]
        logits = torch.randn(vocab, generator=g) * (0.3, 1.0, 3.0)[case % 3]
        temperature, top_k, top_p = (0.7, 1.3)[case % 2], (0, 40, 3000)[case % 3], (0.5, 0.9)[case % 2]
        _, margin = _sorted_filter(logits, temperature, top_k, top_p)
        if margin < 1e-6:  # a cut within rounding of p: either side is right
            continue
        ids, _ = kept_tokens(logits, temperature, top_k, top_p)
        ends = []
        for u in (0.0, 1.0 - 2.0**-53):
            out = torch.empty(1, dtype=torch.int64)
            args = [torch.tensor(v, dtype=d) for v, d in ((temperature, torch.float32), (top_k, torch.int64))]
            args += [torch.tensor(top_p, dtype=torch.float64), torch.tensor(u, dtype=torch.float64)]
            index = torch.zeros(1, dtype=torch.int64)
            failed = lib.lib.rl_sample_rows(
                logits.data_ptr(), vocab, vocab, index.data_ptr(), 1, *[a.data_ptr() for a in args], out.data_ptr(), 1
            )
            assert failed == 0
            ends.append(int(out))
        assert ends == [int(ids[0]), int(ids[-1])], (case, len(ids))
        checked += 1
    assert checked >= 20
