"""What a model takes in memory: its layers', resident modules', KV cache's and activations' bytes.

The planner's memory model (:mod:`robot_llm.llm.plan.planner`) is built from these. Pure Python.
"""

from __future__ import annotations

import math

from robot_llm.llm.families.config import ModelConfig, Shapes
from robot_llm.llm.store.quant import DEFAULT_INT4_GROUP, int4_bytes, int8_bytes

#: Bytes per element of a compute dtype.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def numel(shape: tuple[int, ...]) -> int:
    """Elements of a tensor of ``shape``."""
    return math.prod(shape)


def largest_layer(cfg: ModelConfig) -> Shapes:
    """Keys and shapes of the largest transformer layer (they differ by a norm at most)."""
    return max((cfg.layer_shapes(i) for i in range(cfg.num_layers)), key=lambda s: sum(map(numel, s.values())))


def is_matrix(key: str, shape: tuple[int, ...]) -> bool:
    """True for a 2-D weight (what the store quantises), not a norm or a bias."""
    return len(shape) == 2 and key.endswith(".weight")


def layer_params(cfg: ModelConfig) -> int:
    """Parameters of the largest transformer layer."""
    return sum(numel(s) for s in largest_layer(cfg).values())


def layer_bytes(cfg: ModelConfig, weight_dtype: str, group_size: int = DEFAULT_INT4_GROUP) -> int:
    """Stored bytes of one transformer layer (int8: matrices as int8 + a bf16 scale per row; int4: 4-bit codes +
    bf16 scale and zero per group, padded as the fused kernels want them; the rest fp16)."""
    shapes = largest_layer(cfg)
    if weight_dtype not in ("int4", "int8"):
        return layer_params(cfg) * DTYPE_BYTES[weight_dtype]
    total = 0
    for key, shape in shapes.items():
        if not is_matrix(key, shape):
            total += 2 * numel(shape)
        elif weight_dtype == "int4":
            total += int4_bytes((shape[0], shape[1]), group_size)
        else:
            total += int8_bytes((shape[0], shape[1]))
    return total


def pinned_bytes(nbytes: int) -> int:
    """Host memory a pinned buffer of ``nbytes`` takes: torch's caching host allocator rounds every pinned
    allocation up to a power of two (a YaLM-100B fp16 layer slot of 2.35 GiB pins 4 GiB)."""
    return 1 << max(nbytes - 1, 0).bit_length()


def embedding_params(cfg: ModelConfig) -> int:
    """Parameters of the token embedding."""
    return sum(numel(s) for s in cfg.resident_shapes()["embedding"].values())


def resident_params(cfg: ModelConfig) -> int:
    """Parameters that stay resident: embedding (also a tied LM head), YaLM's projector, the output head."""
    return sum(numel(s) for module in cfg.resident_shapes().values() for s in module.values())


def kv_bytes(cfg: ModelConfig, batch: int, slots: int, dtype_bytes: float) -> float:
    """K and V of every layer for ``batch`` sequences of ``slots`` positions."""
    return 2 * cfg.num_layers * batch * slots * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


def activation_bytes(cfg: ModelConfig, batch: int, rows: int, tokens: int, slots: int, dtype_bytes: int) -> int:
    """Peak activations of one layer: the whole batch's residual stream plus one micro-batch's temporaries."""
    H, inter, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    kv_width = cfg.num_key_value_heads * cfg.head_dim
    stream = 2 * batch * tokens * H
    temps = rows * tokens * (9 * H + 4 * inter) + 2 * rows * n * tokens * slots + 2 * rows * slots * kv_width
    return (stream + temps) * dtype_bytes
