"""int4_grid: the per-group grid of int4 stores.

The stores are mostly made from GGUF files whose matrices are already on 16-level grids (Q4_K)
or on finer ones (Q5_0, Q6_K, Q8_0); requantising them min-max costs the model a lot of its
quality (Gemma 3 270M: +86 % Russian perplexity at group 64). These tests pin what the grid
search promises: a group already on a 16-level grid comes back exactly, whatever codes it uses;
no group ever gets a larger squared error than min-max would give it; flat and tiny groups work.
"""

from __future__ import annotations

import pytest
import torch

from robot_llm.llm.store.quant import dequantize_int4_into, int4_grid, quantize_int4


def _error(groups: torch.Tensor, step: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """Squared error per group with every value rounded to its nearest code (what the store writes)."""
    codes = torch.round((groups - minimum[:, None]) / step[:, None]).clamp(0, 15)
    return ((codes * step[:, None] + minimum[:, None] - groups) ** 2).sum(dim=1)


def _min_max(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = groups.amin(dim=1), groups.amax(dim=1)
    return ((hi - lo) / 15).clamp_min(2**-14), lo


def _on_grids(count: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups on random grids (random step, offset and used codes a..b, both ends present): values, steps."""
    gen = torch.Generator().manual_seed(seed)
    step = torch.exp(torch.empty(count).uniform_(-9, 0, generator=gen))  # 1e-4 .. 1
    offset = torch.randn(count, generator=gen) * 4 * step
    first = torch.randint(0, 15, (count,), generator=gen)
    width = 1 + (torch.rand(count, generator=gen) * (15 - first)).long()  # 1 .. 15 - first
    codes = first[:, None] + (torch.rand(count, size, generator=gen) * (width[:, None] + 1)).long()
    codes[:, 0], codes[:, 1] = first, first + width  # both ends of the used range
    codes = codes[:, torch.randperm(size, generator=gen)]
    return offset[:, None] + codes.float() * step[:, None], step


@pytest.mark.parametrize("size", [32, 64, 128])
def test_groups_already_on_a_16_level_grid_come_back_exactly(size: int) -> None:
    groups, step = _on_grids(4000, size, seed=size)
    found_step, minimum = int4_grid(groups)
    assert found_step.dtype == minimum.dtype == torch.float32 and found_step.shape == minimum.shape == (4000,)
    worst = (_error(groups, found_step, minimum) / size).sqrt() / step  # RMS error in steps of the source grid
    # float32 rounding of values up to 20 steps from zero: ~1e-6 of a step; min-max is far off when a..b < 15.
    assert float(worst.max()) < 1e-4
    assert float((_error(groups, *_min_max(groups)) / size).sqrt().div(step).max()) > 0.1


def test_groups_that_use_few_codes_with_gaps_come_back_exactly() -> None:
    # Codes 3, 5, 9 and 12 only (no neighbour of an end, gaps of 2 to 4 levels): the gaps' common step.
    gen = torch.Generator().manual_seed(7)
    codes = torch.tensor([3.0, 5.0, 9.0, 12.0])[torch.randint(0, 4, (500, 32), generator=gen)]
    codes[:, :4] = torch.tensor([3.0, 5.0, 9.0, 12.0])
    groups = 0.01 * codes - 0.05
    step, minimum = int4_grid(groups)
    assert float(_error(groups, step, minimum).max()) < 1e-12


@pytest.mark.parametrize(
    "sample",
    [
        lambda g: torch.randn(20000, 64, generator=g),
        lambda g: torch.distributions.StudentT(2.5).sample((20000, 64)),  # heavy tails
        lambda g: torch.empty(20000, 32).exponential_(generator=g) * torch.randn(20000, 1, generator=g).sign(),
        lambda g: (torch.randn(20000, 32, generator=g) * 0.02).half().float(),  # fp16 weights: ties, repeats
        lambda g: torch.round(torch.randn(20000, 32, generator=g) * 8) / 8,  # a 5-bit-like source grid
    ],
    ids=["normal", "student-t", "laplace-ish", "fp16", "coarse"],
)
def test_no_group_is_worse_than_min_max_and_the_total_is_much_better(sample: object) -> None:
    torch.manual_seed(3)
    groups = sample(torch.Generator().manual_seed(3))  # type: ignore[operator]
    ours, min_max = _error(groups, *int4_grid(groups)), _error(groups, *_min_max(groups))
    # Closed-form errors decide; they are exact to float32 rounding of the group's sum of squares.
    slack = 1e-5 * ((groups - groups.mean(dim=1, keepdim=True)) ** 2).sum(dim=1)
    assert bool((ours <= min_max + slack).all())
    assert float(ours.sum()) < 0.9 * float(min_max.sum())


def test_flat_tiny_and_two_valued_groups() -> None:
    groups = torch.stack(
        [
            torch.full((32,), 0.37),  # flat
            torch.zeros(32),
            torch.linspace(0, 1e-7, 32),  # below the smallest step stored (fp16 normal)
            torch.tensor([-1.0, 2.0] * 16),  # two values
            torch.tensor([1e4] + [0.0] * 31),  # one outlier
        ]
    )
    step, minimum = int4_grid(groups)
    assert bool(torch.isfinite(step).all() and torch.isfinite(minimum).all() and (step > 0).all())
    err = _error(groups, step, minimum)
    assert float(err[:2].max()) == 0 and float(err[3]) < 1e-10 and float(err[4]) < 1e-4
    assert float(err[2]) <= float(_error(groups[2:3], *_min_max(groups[2:3]))[0])


def test_quantize_int4_uses_the_grid_and_big_matrices_go_in_chunks() -> None:
    # A matrix whose rows are on Q4_K-like grids (two sub-blocks of 32 per group of 64 at group 32) round-trips
    # to bf16 rounding of the stored scale and zero (the fused kernel's); far more groups than one chunk holds.
    groups, step = _on_grids(12000, 32, seed=11)
    weight = groups.reshape(-1, 320)
    codes, scales_and_zeros = quantize_int4(weight, group_size=32)
    out = dequantize_int4_into(codes, scales_and_zeros, torch.empty_like(weight))
    # bf16 keeps 8 significant bits of the scale (8 of them add up) and of the zero (code 8's value, up to
    # 8 steps beyond the group when it uses the low codes only).
    bound = 16 * 2**-8 * step + 2**-8 * groups.abs().amax(dim=1)
    assert bool(((out.reshape(-1, 32) - groups).abs() <= bound[:, None]).all())
