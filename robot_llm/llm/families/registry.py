"""The model families: one line each, naming the module that is the family.

A family is one file: its forward pass (a :class:`~robot_llm.llm.families.family.Family` named
``FAMILY``), its config class (``CONFIG``, which carries the importer's names for the family: its
GGUF architectures, Hugging Face model types, GGUF norm names, and the ``from_gguf`` / ``from_hf``
that read its config from either) and its named configs (``PRESETS``); and one line below. A
family's module imports torch, so this one imports it only when asked (importing the registry does
not import torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import ModuleType

    from robot_llm.llm.families.config import ModelConfig
    from robot_llm.llm.families.family import Family

#: family name -> the module that is the family (its ``FAMILY``, ``CONFIG`` and ``PRESETS``)
FAMILIES: dict[str, str] = {
    "yalm": "robot_llm.llm.families.yalm",
    "llama": "robot_llm.llm.families.llama",
    "gemma3": "robot_llm.llm.families.gemma3",
}


def _module(family: str) -> ModuleType:
    try:
        return importlib.import_module(FAMILIES[family])
    except KeyError:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}") from None


def config_class(family: str) -> Any:
    """The config dataclass of ``family`` (``yalm``, ``llama``, ``gemma3``)."""
    return _module(family).CONFIG


def config_classes() -> list[Any]:
    """Every family's config class, in the registry's order."""
    return [config_class(family) for family in FAMILIES]


def config_from_dict(data: dict[str, Any], family: str = "yalm") -> ModelConfig:
    """Build the config of ``family`` from its :meth:`ModelConfig.to_dict` form."""
    config: ModelConfig = config_class(family).from_dict(data)
    return config


def gguf_config_class(architecture: str) -> Any:
    """The config class of the family that computes GGUF ``general.architecture`` (None: no family does)."""
    return next((cls for cls in config_classes() if architecture in cls.gguf_architectures), None)


def hf_config_class(model_type: str) -> Any:
    """The config class of the family that computes Hugging Face ``model_type`` (None: no family does)."""
    return next((cls for cls in config_classes() if model_type in cls.hf_model_types), None)


def presets() -> dict[str, ModelConfig]:
    """Every family's named configs (``yalm-100b``, ``llama-3.1-70b``, ``gemma-3-270m``...)."""
    return {name: cfg for family in FAMILIES for name, cfg in _module(family).PRESETS.items()}


def preset(name: str) -> ModelConfig:
    """The named config of any family; ValueError naming the known ones otherwise."""
    known = presets()
    if name not in known:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(known))}")
    return known[name]


def family_of(cfg: ModelConfig) -> Family:
    """The :class:`~robot_llm.llm.families.family.Family` that computes models of this config."""
    family: Family = _module(cfg.family).FAMILY
    return family
