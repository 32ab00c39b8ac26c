"""The model families: one line each, naming the family's config class and the module of its forward pass.

A config class is imported without torch; the forward module, which imports torch, only when a
model is built. A family is its forward module here (a
:class:`~robot_llm.llm.families.family.Family` named ``FAMILY``), its config class (``config.py``
for YaLM, ``config_hf.py`` for the Hugging Face families: they stay torch-free for the command
line and the planner), which carries the importer's names for it (GGUF architectures, Hugging Face
model types, GGUF norm names: :mod:`robot_llm.llm.store.importers` reads them here), and one line below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from robot_llm.llm.families.config import ModelConfig, YalmConfig
from robot_llm.llm.families.config_hf import Gemma3Config, LlamaConfig

if TYPE_CHECKING:
    from robot_llm.llm.families.family import Family

#: family name -> (its config class, the module whose ``FAMILY`` computes it)
FAMILIES: dict[str, tuple[type[Any], str]] = {
    "yalm": (YalmConfig, "robot_llm.llm.families.yalm"),
    "llama": (LlamaConfig, "robot_llm.llm.families.llama"),
    "gemma3": (Gemma3Config, "robot_llm.llm.families.gemma3"),
}


def config_class(family: str) -> Any:
    """The config dataclass of ``family`` (``yalm``, ``llama``, ``gemma3``)."""
    try:
        return FAMILIES[family][0]
    except KeyError:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}") from None


def config_from_dict(data: dict[str, Any], family: str = "yalm") -> ModelConfig:
    """Build the config of ``family`` from its :meth:`ModelConfig.to_dict` form."""
    config: ModelConfig = config_class(family).from_dict(data)
    return config


def gguf_config_class(architecture: str) -> Any:
    """The config class of the family that computes GGUF ``general.architecture`` (None: no family does)."""
    return next((cls for cls, _ in FAMILIES.values() if architecture in cls.gguf_architectures), None)


def hf_config_class(model_type: str) -> Any:
    """The config class of the family that computes Hugging Face ``model_type`` (None: no family does)."""
    return next((cls for cls, _ in FAMILIES.values() if model_type in cls.hf_model_types), None)


def family_of(cfg: ModelConfig) -> Family:
    """The :class:`~robot_llm.llm.families.family.Family` that computes models of this config."""
    family: Family = importlib.import_module(FAMILIES[cfg.family][1]).FAMILY
    return family
