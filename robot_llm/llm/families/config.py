"""Model configs: the shape of a model and the names and shapes of its weights, per streamed module.

Every model family has one frozen dataclass config (YaLM's is here; the
Hugging Face families' are in :mod:`robot_llm.llm.families.config_hf`) that satisfies
:class:`ModelConfig`: the common sizes the engine, store, planner and
generation need, plus the weight keys and shapes of each module the store
holds (``embedding``, optionally ``projector``, one ``layer`` per transformer
layer, ``output``). Pure Python: importing it does not import torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

ModuleKind = Literal["embedding", "projector", "layer", "output"]
Shapes = dict[str, tuple[int, ...]]


class ModelConfig(Protocol):
    """What every family's config provides (see :class:`YalmConfig` for a complete example)."""

    family: ClassVar[str]
    #: The compute dtype on a GPU under ``dtype: auto``: where the GPU has native bf16, and where it has not.
    gpu_dtypes: ClassVar[tuple[str, str]]
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


@dataclass(frozen=True)
class YalmConfig:
    """Shape of a YaLM model.

    Only the quantities that vary between checkpoints are fields; everything
    the released launch scripts fix (GeGLU, rotary, pre-LN, no query-key layer
    scaling) is built into :mod:`robot_llm.llm.families.yalm`.
    """

    num_layers: int
    hidden_size: int
    embedding_size: int
    intermediate_size: int
    num_attention_heads: int
    max_position_embeddings: int
    vocab_size: int
    layernorm_epsilon: float = 1e-5

    family: ClassVar[str] = "yalm"
    #: YaLM-100B was released and computes in fp16 (the original inference is fp16 throughout).
    gpu_dtypes: ClassVar[tuple[str, str]] = ("fp16", "fp16")
    #: A YaLM release is its own layout (:mod:`robot_llm.llm.store.checkpoint`), never a GGUF or HF folder.
    gguf_architectures: ClassVar[tuple[str, ...]] = ()
    hf_model_types: ClassVar[tuple[str, ...]] = ()
    gguf_norms: ClassVar[dict[str, str]] = {}
    gguf_norm_offset: ClassVar[float] = 0.0
    gguf_permuted: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "embedding_size",
            "intermediate_size",
            "num_attention_heads",
            "max_position_embeddings",
            "vocab_size",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"YalmConfig.{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"rotary needs an even head dim, got {self.head_dim}")
        if self.embedding_size > self.hidden_size:
            raise ValueError(
                f"embedding_size {self.embedding_size} exceeds hidden_size {self.hidden_size}: "
                "the projector only zero-pads E up to H"
            )

    @property
    def head_dim(self) -> int:
        """Per-head dimension ``hn = H / n``."""
        return self.hidden_size // self.num_attention_heads

    @property
    def num_key_value_heads(self) -> int:
        """YaLM has one key/value head per query head."""
        return self.num_attention_heads

    def sliding_window(self, layer_index: int) -> int | None:
        """Every YaLM layer attends to the whole sequence."""
        del layer_index
        return None

    def layer_shapes(self, layer_index: int) -> Shapes:
        """Release keys and shapes of transformer layer ``layer_index`` (docs/yalm-model.md §5.3)."""
        H, intermediate = self.hidden_size, self.intermediate_size
        shapes: Shapes = {}
        if layer_index > 0:  # the first layer has no input LayerNorm (§9.1)
            shapes["input_layernorm.weight"] = (H,)
            shapes["input_layernorm.bias"] = (H,)
        shapes.update(
            {
                "attention.query_key_value.weight": (3 * H, H),
                "attention.query_key_value.bias": (3 * H,),
                "attention.dense.weight": (H, H),
                "attention.dense.bias": (H,),
                "post_attention_layernorm.weight": (H,),
                "post_attention_layernorm.bias": (H,),
                "mlp.dense_ffn_hidden.weight": (intermediate, H),
                "mlp.dense_ffn_hidden.bias": (intermediate,),
                "mlp.dense_ffn_gate.weight": (intermediate, H),
                "mlp.dense_ffn_gate.bias": (intermediate,),
                "mlp.dense_ffn_output.weight": (H, intermediate),
                "mlp.dense_ffn_output.bias": (H,),
            }
        )
        return shapes

    def resident_shapes(self) -> dict[ModuleKind, Shapes]:
        """Release keys and shapes of the embedding, projector and output layer (§5.3)."""
        H, E, V = self.hidden_size, self.embedding_size, self.vocab_size
        return {
            "embedding": {"word_embeddings.weight": (V, E)},
            "projector": {"input_layernorm.weight": (E,), "input_layernorm.bias": (E,)},
            "output": {
                "input_layer_norm.weight": (H,),
                "input_layer_norm.bias": (H,),
                "dense.weight": (E, H),
                "dense.bias": (E,),
                "output_layer_norm.weight": (E,),
                "output_layer_norm.bias": (E,),
                "output_bias": (V,),
            },
        }

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON serialisable)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> YalmConfig:
        """Build from a dict; keys that are not fields (fixture extras) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in data and f.default is dataclasses.MISSING]
        if missing:
            raise ValueError(f"model config lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_json(cls, path: str | Path) -> YalmConfig:
        """Read a fixture-style ``config.json`` (extra keys such as ``weight_files`` are ignored).

        Refuses a config that asks for a variant this implementation does not
        compute (an activation other than geglu, a position encoding other
        than rotary, query-key layer scaling or post-LN residuals).
        """
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        expected = {
            "activation": "geglu",
            "pos_encoding": "rotary",
            "apply_residual_connection_post_layernorm": False,
        }
        for key, value in expected.items():
            if key in data and data[key] != value:
                raise ValueError(f"{path}: {key}={data[key]!r} is not supported (only {value!r})")
        return cls.from_dict(data)

    @classmethod
    def preset(cls, name: str) -> YalmConfig:
        """Return the named preset (see :data:`PRESETS`)."""
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None


PRESETS: dict[str, YalmConfig] = {
    # The released model (docs/yalm-model.md §1).
    "yalm-100b": YalmConfig(
        num_layers=80,
        hidden_size=10240,
        embedding_size=2048,
        intermediate_size=27308,
        num_attention_heads=128,
        max_position_embeddings=1024,
        vocab_size=128000,
    ),
    # The shared fixture (shared/fixtures/yalm-tiny/config.json).
    "yalm-tiny": YalmConfig(
        num_layers=2,
        hidden_size=64,
        embedding_size=32,
        intermediate_size=172,
        num_attention_heads=4,
        max_position_embeddings=64,
        vocab_size=600,
    ),
    # Small shapes for tests and CPU benchmarks; same E/H ratio and head dim as the release.
    "yalm-small": YalmConfig(
        num_layers=4,
        hidden_size=640,
        embedding_size=128,
        intermediate_size=1708,
        num_attention_heads=8,
        max_position_embeddings=256,
        vocab_size=600,
    ),
    # A mid-size model (~1.3 G parameters) for offload-engine benchmarks.
    "yalm-mid": YalmConfig(
        num_layers=8,
        hidden_size=3840,
        embedding_size=768,
        intermediate_size=10240,
        num_attention_heads=48,
        max_position_embeddings=1024,
        vocab_size=32000,
    ),
}


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
