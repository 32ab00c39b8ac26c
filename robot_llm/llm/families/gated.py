"""The gated MLP's activation times its up projection (Gemma 3: ``gelu_tanh(gate) * up``, Llama and Qwen 3:
``silu(gate) * up``): our kernel (``gated.c``, one pass) on the CPU in fp32 where it is built, torch's two ops
elsewhere. bf16 stays torch's: its ops round the activation to bf16 before the product, which one pass would not."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from robot_llm.llm.store.gemv import kernels, plain_rows

#: The activations ``gated.c`` computes, by its codes.
ACTIVATIONS = {"gelu_tanh": 0, "silu": 1}


def gated(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    """``act(gate) * up``, ``activation`` ``"gelu_tanh"`` or ``"silu"``: in fp32 on the CPU ``gated.c``'s values
    (within a few units in the last place of torch's; a new tensor), else torch's ops."""
    kind = ACTIVATIONS[activation]
    if gate.dtype is torch.float32 and up.dtype is torch.float32 and plain_rows(gate) and plain_rows(up):
        lib = kernels()
        if lib is not None and gate.shape == up.shape:
            out = torch.empty_like(gate)
            threads = torch.get_num_threads()
            lib.lib.rl_gated(gate.data_ptr(), up.data_ptr(), gate.numel(), kind, out.data_ptr(), threads)
            return out
    act = F.gelu(gate, approximate="tanh") if activation == "gelu_tanh" else F.silu(gate)
    return act * up
