"""Model hyperparameters of YaLM (docs/yalm-model.md §1) and named presets."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class YalmConfig:
    """Shape of a YaLM model.

    Only the quantities that vary between checkpoints are fields; everything
    the released launch scripts fix (GeGLU, rotary, pre-LN, no query-key layer
    scaling) is built into :mod:`robot_llm.llm.yalm`.
    """

    num_layers: int
    hidden_size: int
    embedding_size: int
    intermediate_size: int
    num_attention_heads: int
    max_position_embeddings: int
    vocab_size: int
    layernorm_epsilon: float = 1e-5

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
