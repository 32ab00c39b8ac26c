"""The gated MLP's activation times its up projection (Gemma 3: ``gelu_tanh(gate) * up``, Llama and Qwen 3:
``silu(gate) * up``): our kernel (``gated.c``, one pass) on the CPU in fp32 or bf16 where it is built, torch's two
ops elsewhere. In bf16 the kernel rounds the activation to bf16 before the product, as torch's ops do."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from robot_llm.llm.store.gemv import kernels, plain_rows

#: The activations ``gated.c`` computes, by its codes.
ACTIVATIONS = {"gelu_tanh": 0, "silu": 1}
#: The dtypes ``gated.c`` reads and writes.
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def gated(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    """``act(gate) * up``, ``activation`` ``"gelu_tanh"`` or ``"silu"``: in fp32 or bf16 on the CPU ``gated.c``'s
    values (a new tensor; fp32: within a few units in the last place of torch's; bf16: torch's, but where the fp32
    activation lies within those units of a bf16 rounding boundary), else torch's ops."""
    kind = ACTIVATIONS[activation]
    dtype = gate.dtype
    if dtype in _KERNEL_DTYPES and up.dtype is dtype and plain_rows(gate) and plain_rows(up):
        lib = kernels()
        if lib is not None and gate.shape == up.shape:
            return lib.gated(gate, up, kind)
    act = F.gelu(gate, approximate="tanh") if activation == "gelu_tanh" else F.silu(gate)
    return act * up
