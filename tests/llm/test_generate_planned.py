"""``robot-llm model generate --store``: the stream engine opened and planned the way a night opens it."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from robot_llm.commands.main import main
from robot_llm.llm.families.yalm import YalmConfig
from robot_llm.llm.store.writer import convert


def test_generate_from_a_store_runs_the_planned_engine(
    tmp_path: Path,
    tiny_dir: Path,
    tiny_config: YalmConfig,
    expected: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store = tmp_path / "store"
    convert(tiny_dir / "weights", store, dtype="fp32", config=tiny_config)
    prompts = [expected["prompts"][0], expected["prompts"][3]]
    argv = ["-v", "model", "generate", "--store", str(store), "--vocab", str(tiny_dir / "vocab" / "voc_tiny.sp")]
    argv += ["--greedy", "--max-new-tokens", "12", "--batch-size", "4", "--json", *(p["text"] for p in prompts)]
    with caplog.at_level(logging.INFO):
        assert main(argv) == 0
    runtime = [r.getMessage() for r in caplog.records if r.name == "robot_llm.llm.engine.runtime"]
    # The night's plan at the door (weight home, KV home, threads), then this job's batch planned for it.
    assert any(m.startswith("the night's plan:") for m in runtime), runtime
    assert any(m.startswith("plan: batch 2,") for m in runtime), runtime
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["token_ids"] for r in records] == [p["greedy"]["new_token_ids"] for p in prompts]
