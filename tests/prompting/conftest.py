"""Fixtures for the prompting and plan tests: a real config file and the fixture tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from prompting_helpers import VOCAB, base_settings

from robot_llm.config import AppConfig, load_config
from robot_llm.llm.tokenizer import YalmTokenizer


@pytest.fixture(scope="session")
def tokenizer() -> YalmTokenizer:
    """The yalm-tiny SentencePiece model (the real tokenizer class, a small vocabulary)."""
    return YalmTokenizer(VOCAB)


@pytest.fixture
def make_config(tmp_path: Path) -> Callable[..., AppConfig]:
    """Write a YAML config (base settings updated section by section) and load it for real."""

    def make(db_url: str | None = None, **sections: Any) -> AppConfig:
        settings = base_settings(tmp_path)
        if db_url is not None:
            settings["database"] = {"url": db_url}
        for key, value in sections.items():
            if isinstance(value, dict) and isinstance(settings.get(key), dict):
                settings[key] = {**settings[key], **value}
            else:
                settings[key] = value
        path = tmp_path / "robot-llm.yaml"
        path.write_text(yaml.safe_dump(settings, allow_unicode=True), encoding="utf-8")
        return load_config(path)

    return make
