"""The gated MLP's activation times its up projection: gated.c against the float64 formula and torch's ops."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from robot_llm.llm.families.gated import gated
from robot_llm.llm.store.gemv import kernels


def _in_fp64(gate: torch.Tensor, up: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula in float64 with its constants as fp32 holds them, and the sigmoid's argument t; gelu's
    x / 2 (1 + tanh(u)) as x sigmoid(2u), the same number but for the cancellation of 1 + tanh(u) far below zero
    (in float64 too)."""
    x = gate.double()
    if activation == "gelu_tanh":
        beta, kappa = (float(torch.tensor(c)) for c in (math.sqrt(2 / math.pi), 0.044715))
        t = 2 * beta * (x + kappa * x**3)
    else:
        t = x
    return x * torch.sigmoid(t) * up.double(), t


@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])
def test_the_kernel_is_the_formula_within_fp32_roundings(activation: str) -> None:
    assert kernels() is not None
    g = torch.Generator().manual_seed(3)
    # a tail past the vectors (2,051 columns), values from tiny to far in either tail of the sigmoid, exact zeros
    for scale, rows in ((0.01, 3), (1.0, 5), (8.0, 7), (60.0, 2)):
        gate, up = torch.randn(rows, 2051, generator=g) * scale, torch.randn(rows, 2051, generator=g)
        gate[0, :3] = torch.tensor([0.0, -0.0, 1e-30])
        got, (want, t) = gated(gate, up, activation), _in_fp64(gate, up, activation)
        assert got.dtype == torch.float32 and got.shape == gate.shape
        # each value within a few fp32 roundings of its own size (the exponential's two units, the products'), and
        # the few of t's own fp32 evaluation, which the sigmoid's lower tail multiplies by |t|; far in that tail
        # (below exp(-87), FLT_MIN's order) within 1e-30 of zero, as torch's
        bound = (8 + 8 * t.abs()) * 2**-24 * want.abs() + 1e-30
        assert bool(((got.double() - want).abs() <= bound).all()), (activation, scale)
        # and torch's ops within their own error: gelu's 1 + tanh cancels where x is far below zero
        torch_ops = (F.gelu(gate, approximate="tanh") if activation == "gelu_tanh" else F.silu(gate)) * up
        assert float((got - torch_ops).abs().max()) <= 1e-6 * float(torch_ops.abs().max())


def test_split_over_threads_the_values_are_one_threads() -> None:
    g = torch.Generator().manual_seed(4)
    gate, up = torch.randn(64, 2048, generator=g), torch.randn(64, 2048, generator=g)  # past the threads' bound
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gated(gate, up, "gelu_tanh")
        torch.set_num_threads(3)
        assert torch.equal(gated(gate, up, "gelu_tanh"), one)
    finally:
        torch.set_num_threads(before)


def _bf16_steps(b: torch.Tensor, steps: int) -> torch.Tensor:
    """bf16 values ``steps`` representable values away from ``b`` in magnitude (sign kept; none below zero)."""
    bits = b.view(torch.int16).int()
    magnitude = ((bits & 0x7FFF) + steps).clamp(min=0)
    return (magnitude | (bits & 0x8000)).short().view(torch.bfloat16)


@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])
def test_bf16_rounds_the_activation_before_the_product_as_torchs_ops(activation: str) -> None:
    g = torch.Generator().manual_seed(6)
    for scale, rows in ((0.01, 3), (1.0, 16), (8.0, 7), (60.0, 2)):
        gate = (torch.randn(rows, 2051, generator=g) * scale).bfloat16()  # a tail past the vectors
        up = torch.randn(rows, 2051, generator=g).bfloat16()
        gate[0, 1], gate[-1, 2050] = float("nan"), float("nan")  # in a vector and in the tail
        got = gated(gate, up, activation)
        assert got.dtype == torch.bfloat16 and got.shape == gate.shape
        # the exact activation rounded to bf16, or (a few fp32 units off a rounding boundary) its neighbour, then
        # the product rounded once: each value is one of those three, nothing else; far in the sigmoid's lower tail
        # (below exp(-87), FLT_MIN's order) within 1e-30 of zero, as in fp32
        act = _in_fp64(gate, torch.ones_like(up), activation)[0]
        exact = act.float().bfloat16()
        allowed = [(_bf16_steps(exact, s).float() * up.float()).bfloat16() for s in (-1, 0, 1)]
        hit = (got.double().abs() <= 1e-30) & ((act * up.double()).abs() <= 1e-30)
        hit |= got.isnan() & act.isnan()  # a NaN stays one
        for candidate in allowed:
            hit |= got.view(torch.int16) == candidate.view(torch.int16)
        assert bool(hit.all()), (activation, scale, int((~hit).sum()))
        if scale == 1.0:  # torch's own activation cancels far below zero (1 + tanh), so compare where it does not
            torch_ops = (F.gelu(gate, approximate="tanh") if activation == "gelu_tanh" else F.silu(gate)) * up
            assert float((got == torch_ops).float().mean()) >= 0.999, activation


def test_strided_operands_are_torchs_ops() -> None:
    g = torch.Generator().manual_seed(5)
    gate, up = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)
    assert torch.equal(gated(gate.t(), up.t(), "silu"), F.silu(gate.t()) * up.t())
    half, half_up = gate.bfloat16().t(), up.bfloat16().t()
    assert torch.equal(gated(half, half_up, "gelu_tanh"), F.gelu(half, approximate="tanh") * half_up)
