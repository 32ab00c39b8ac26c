"""What every model config provides (:class:`ModelConfig`) and what the families' configs share.

Every model family has one frozen dataclass config, in its own file beside its forward pass
(:mod:`~robot_llm.llm.families.yalm`, :mod:`~robot_llm.llm.families.llama`,
:mod:`~robot_llm.llm.families.gemma3`), that satisfies :class:`ModelConfig`: the common sizes the
engine, store, planner and generation need, plus the weight keys and shapes of each module the
store holds (``embedding``, optionally ``projector``, one ``layer`` per transformer layer,
``output``). This module is pure Python: importing it does not import torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal, Protocol

ModuleKind = Literal["embedding", "projector", "layer", "output"]
Shapes = dict[str, tuple[int, ...]]


class ModelConfig(Protocol):
    """What every family's config provides (:class:`~robot_llm.llm.families.yalm.YalmConfig` is a complete one)."""

    family: ClassVar[str]
    #: The compute dtype on a GPU under ``dtype: auto``: where the GPU has native bf16, and where it has not.
    gpu_dtypes: ClassVar[tuple[str, str]]
    #: Whether a decode step attends a bf16 KV cache as stored under fp32 compute on the CPU (the families of
    #: :func:`~robot_llm.llm.families.attention.grouped_attention`; YaLM's own attention casts it up each step).
    kv_read_as_stored: ClassVar[bool]
    #: The importer's names for the family: GGUF ``general.architecture`` values, Hugging Face
    #: ``config.json`` ``model_type`` values, GGUF norm tensor names (after ``blk.N.``) -> store keys,
    #: what llama.cpp adds to a stored norm gain, and the architectures whose q/k rows llama.cpp permuted.
    gguf_architectures: ClassVar[tuple[str, ...]]
    hf_model_types: ClassVar[tuple[str, ...]]
    gguf_norms: ClassVar[dict[str, str]]
    gguf_norm_offset: ClassVar[float]
    gguf_permuted: ClassVar[tuple[str, ...]]
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    max_position_embeddings: int
    vocab_size: int

    @property
    def num_key_value_heads(self) -> int:
        """Heads of the KV cache (fewer than query heads with grouped-query attention)."""
        ...

    @property
    def head_dim(self) -> int:
        """Per-head dimension of queries, keys and values."""
        ...

    def sliding_window(self, layer_index: int) -> int | None:
        """How many most recent positions layer ``layer_index`` attends to (None: all)."""
        ...

    def resident_shapes(self) -> dict[ModuleKind, Shapes]:
        """Keys and shapes of the modules that stay resident, in forward order (``output`` last)."""
        ...

    def layer_shapes(self, layer_index: int) -> Shapes:
        """Keys and shapes of transformer layer ``layer_index`` (0-based)."""
        ...

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON serialisable), without the family name."""
        ...


def module_plan(cfg: ModelConfig) -> list[tuple[ModuleKind, int, Shapes]]:
    """Every module of the model in forward order: ``(kind, index, {key: shape})``.

    ``index`` is the 0-based layer index for ``"layer"`` and 0 otherwise.
    """
    resident = cfg.resident_shapes()
    plan: list[tuple[ModuleKind, int, Shapes]] = [(k, 0, s) for k, s in resident.items() if k != "output"]
    plan += [("layer", i, cfg.layer_shapes(i)) for i in range(cfg.num_layers)]
    plan.append(("output", 0, resident["output"]))
    return plan


def embedding_is_head(cfg: ModelConfig) -> bool:
    """True when the output head multiplies by the embedding matrix (YaLM, Gemma, tied Llama/Qwen).

    An untied model (its output module holds its own ``[vocab, ...]`` matrix) needs the
    embedding only for the lookup, which the streaming engine then does in host RAM.
    """
    output = cfg.resident_shapes()["output"]
    return not any(len(shape) == 2 and shape[0] == cfg.vocab_size for shape in output.values())


# --------------------------------------------------------------------------- shared by the Hugging Face families


def from_fields(cls: Any, data: dict[str, Any]) -> Any:
    """A config dataclass ``cls`` from a dict of its fields (extra keys ignored; a missing field is refused)."""
    names = {f.name for f in dataclasses.fields(cls)}
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in data and f.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{cls.family} config lacks {', '.join(missing)}")
    return cls(**{k: v for k, v in data.items() if k in names})


def hf_rope(hf: dict[str, Any], layer_type: str | None = None) -> tuple[float | None, dict[str, Any] | None]:
    """``(rope_theta, scaling dict or None)`` from a ``config.json`` of either generation: transformers 4
    writes ``rope_theta`` and ``rope_scaling``, transformers 5 one ``rope_parameters`` dict (per layer type
    for Gemma 3)."""
    params = hf.get("rope_parameters")
    if params is not None:
        params = params.get(layer_type, {}) if layer_type else params
        scaling = None if params.get("rope_type", "default") == "default" else params
        return params.get("rope_theta"), scaling
    return hf.get("rope_theta"), hf.get("rope_scaling")


def check_positive(cfg: Any, names: tuple[str, ...]) -> None:
    """Refuse a Hugging Face family config whose sizes ``names`` are not positive or whose heads do not fit."""
    for name in names:
        if getattr(cfg, name) <= 0:
            raise ValueError(f"{type(cfg).__name__}.{name} must be positive, got {getattr(cfg, name)}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads {cfg.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {cfg.num_key_value_heads}"
        )
    if cfg.head_dim % 2:
        raise ValueError(f"rotary needs an even head dim, got {cfg.head_dim}")


def decoder_shapes(cfg: Any) -> Shapes:
    """The weights every Hugging Face decoder layer here has: two norms, q/k/v/o, a gated MLP."""
    H, n, kv, d, inter = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    )
    return {
        "input_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (n * d, H),
        "self_attn.k_proj.weight": (kv * d, H),
        "self_attn.v_proj.weight": (kv * d, H),
        "self_attn.o_proj.weight": (H, n * d),
        "post_attention_layernorm.weight": (H,),
        "mlp.gate_proj.weight": (inter, H),
        "mlp.up_proj.weight": (inter, H),
        "mlp.down_proj.weight": (H, inter),
    }


#: The sizes every Hugging Face family config checks (:func:`check_positive`).
HF_SIZES = (
    "num_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "vocab_size",
)
