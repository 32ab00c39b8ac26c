"""``config.model`` -> the settings of the one door (:meth:`robot_llm.llm.model.Model.open`).

Everything that needs the model the config describes (the worker, preflight's shape and
memory checks) starts here, so the mapping of the config onto the runtime's
:class:`~robot_llm.llm.engine.runtime.ModelSettings` lives in one place. The runtime itself is
imported only when a model is opened: this module stays free of torch (the daemon imports it).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from robot_llm.errors import RobotLLMError

if TYPE_CHECKING:
    from robot_llm.config import AppConfig
    from robot_llm.llm.engine.runtime import ModelSettings
    from robot_llm.llm.model import Model
    from robot_llm.llm.store.reader import Manifest
    from robot_llm.llm.tokenizer import Tokenizer
    from robot_llm.prompting.template import Template

__all__ = [
    "ModelConfigError",
    "NightFacts",
    "backend_refusal",
    "model_settings",
    "model_shape",
    "open_configured_model",
]


class ModelConfigError(RobotLLMError):
    """The configured weights' shape cannot be read (a damaged manifest or config.json)."""


def release_config_file(config: AppConfig) -> Path | None:
    checkpoint = config.model.checkpoint
    if checkpoint is None:
        return None
    for candidate in (checkpoint / "config.json", checkpoint.parent / "config.json"):
        if candidate.is_file():
            return candidate
    return None


def _store_family(store: Path) -> str | None:
    """The family a store's manifest names, read as plain JSON (no torch); None when it cannot be read."""
    import json

    try:
        data = json.loads((store / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # not converted yet, or damaged: preflight's store check says which
    family = data.get("family", "yalm") if isinstance(data, dict) else None
    return family if isinstance(family, str) else None


def backend_refusal(config: AppConfig) -> str | None:
    """Why ``model.backend`` cannot run the configured weights (``model.backend: ...``), or None.

    A release checkpoint is YaLM; a store's family is in its manifest (a store not written yet
    is not judged here).
    """
    from robot_llm.llm.engine.backends import refusal

    m = config.model
    family = "yalm" if m.store is None else _store_family(m.store)
    reason = None if family is None else refusal(m.backend, family)
    return None if reason is None else f"model.backend: {reason} (model.store {m.store} holds a {family} model)"


@dataclass(frozen=True)
class NightFacts:
    """What a night derives once from its config and hands down to preflight and the model's door.

    Each is None when it cannot be derived (no store; a damaged manifest, vocabulary or template):
    whoever needs it then derives it again, only to say why it fails (preflight names the problem).
    """

    manifest: Manifest | None
    tokenizer: Tokenizer | None
    templates: dict[str, Template] | None


def night_facts(config: AppConfig) -> NightFacts:
    """Read the store's manifest, build the tokenizer and load the templates, once for the night."""
    from robot_llm.llm.tokenizer import load_tokenizer
    from robot_llm.prompting.loading import load_templates

    manifest = None
    if config.model.store is not None:
        from robot_llm.llm.store.layout import StoreError
        from robot_llm.llm.store.reader import read_manifest

        with contextlib.suppress(StoreError):
            manifest = read_manifest(config.model.store)
    tokenizer: Tokenizer | None = None
    assert config.model.vocab is not None  # required by the config validator
    with contextlib.suppress(OSError, ValueError, RuntimeError):
        tokenizer = load_tokenizer(config.model.vocab)
    templates: dict[str, Template] | None = None
    with contextlib.suppress(RobotLLMError):
        templates = load_templates(config)
    return NightFacts(manifest=manifest, tokenizer=tokenizer, templates=templates)


def model_shape(config: AppConfig, manifest: Manifest | None = None) -> Any:
    """The :class:`~robot_llm.llm.families.yalm.YalmConfig` of the configured weights, as the runtime will see it.

    A store carries it in its manifest (``manifest``, when read already); a release checkpoint
    in a ``config.json`` next to (or one folder above) the weight files; a release without one (the published
    YaLM-100B) is the ``yalm-100b`` preset.
    """
    from robot_llm.llm.families.yalm import YalmConfig

    m = config.model
    if m.store is not None:
        from robot_llm.llm.store.layout import StoreError
        from robot_llm.llm.store.reader import read_manifest

        try:
            shape = (manifest if manifest is not None else read_manifest(m.store)).config
        except StoreError as exc:
            raise ModelConfigError(f"model.store: {exc}") from None
        reason = backend_refusal(config)
        if reason is not None:
            raise ModelConfigError(reason)
        return shape
    found = release_config_file(config)
    if found is None:
        return YalmConfig.preset("yalm-100b")
    try:
        return YalmConfig.from_json(found)
    except (ValueError, TypeError) as exc:
        raise ModelConfigError(f"{found}: {exc}") from None


def night_max_new_tokens(config: AppConfig, templates: dict[str, Template] | None = None) -> int:
    """The most tokens any template generates (the night's plan is made for it); ``templates``: loaded already."""
    from robot_llm.prompting.loading import load_templates

    try:
        templates = templates if templates is not None else load_templates(config)
    except RobotLLMError:  # doctor's templates check reports it
        return config.prompts.generation.max_new_tokens
    return max(t.generation_for(config).max_new_tokens for t in templates.values())


def model_settings(config: AppConfig, templates: dict[str, Template] | None = None) -> ModelSettings:
    """The runtime settings ``config.model`` means; the worker and doctor's plan both start here."""
    from robot_llm.llm.engine.runtime import ModelSettings

    m = config.model
    assert m.vocab is not None  # required by the config validator
    return ModelSettings(
        vocab=m.vocab,
        backend=m.backend,
        checkpoint=m.checkpoint,
        store=m.store,
        home=m.home,
        # int8/int4 are how a store keeps its weights, not compute dtypes: the plan picks one.
        dtype="auto" if m.dtype in ("int8", "int4") else m.dtype,
        threads=m.threads,
        micro_batch=m.micro_batch,
        kv_dtype=m.kv_dtype,
        device=m.device,
        max_batch_size=m.max_batch_size,
        refill_slots=m.refill_slots,
        memory_budget_bytes=m.memory_budget,
        gpu_memory_budget_bytes=m.gpu_memory_budget,
        offload_dir=m.offload_dir,
        offload=m.offload,
        preset="yalm-100b" if m.store is None and release_config_file(config) is None else None,
        max_new_tokens=night_max_new_tokens(config, templates),
        max_positions=m.max_positions,
        name=m.id,
    )


def open_configured_model(config: AppConfig, facts: NightFacts | None = None) -> Model:
    """Open the model ``config.model`` describes through the door, placed as the night's plan says.

    Raises the runtime's user-facing errors (RobotLLMError) with a one-line reason when the
    weights, the vocabulary or the backend are not usable, or the night cannot fit.
    ``facts``: the night's manifest, tokenizer and templates, derived once (:func:`night_facts`).
    """
    from robot_llm.llm.model import Model

    facts = facts or NightFacts(manifest=None, tokenizer=None, templates=None)
    model = Model.open(model_settings(config, facts.templates), manifest=facts.manifest, tokenizer=facts.tokenizer)
    try:
        model.tokenizer  # noqa: B018 - built now: a vocabulary that cannot load refuses the night, not a batch
    except BaseException:
        model.close()
        raise
    return model
