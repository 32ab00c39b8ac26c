"""``model check-fixture`` (as a subprocess, as CI runs it) and ``model generate`` (in process)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from robot_llm.commands.model import main

REPO = Path(__file__).resolve().parents[2]


def _subprocess(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "robot_llm.commands.model", "model", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )


def test_check_fixture_passes(tiny_dir: Path) -> None:
    result = _subprocess("check-fixture", tiny_dir, "--engine", "memory")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    data = json.loads(lines[0])
    assert set(data) == {"max_abs_diff", "greedy_match", "greedy_total", "tokens_match"}
    assert data["max_abs_diff"] <= 1e-4
    assert (data["greedy_match"], data["greedy_total"], data["tokens_match"]) == (4, 4, True)


def _run(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = main(["model", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_check_fixture_fails_on_a_wrong_reference(
    tmp_path: Path, tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fixture = tmp_path / "fixture"
    shutil.copytree(tiny_dir, fixture)
    expected_path = fixture / "expected.json"
    expected_path.chmod(0o644)
    expected = json.loads(expected_path.read_text(encoding="utf-8"))
    expected["prompts"][1]["greedy"]["new_token_ids"][5] += 1
    expected["prompts"][2]["token_ids"][3] += 1
    expected_path.write_text(json.dumps(expected), encoding="utf-8")
    code, out, _ = _run(capsys, "check-fixture", fixture)
    assert code == 1
    data = json.loads(out)
    assert (data["greedy_match"], data["tokens_match"]) == (3, False)


def test_generate_command(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(
        capsys,
        "generate",
        "--checkpoint",
        tiny_dir / "weights",
        "--vocab",
        tiny_dir / "vocab" / "voc_tiny.sp",
        "--config",
        tiny_dir / "config.json",
        "--max-new-tokens",
        "12",
        "--greedy",
        "--json",
        "The central bank kept its key rate",
        "Рубль ослаб к доллару, а индекс",
    )
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    expected = json.loads((tiny_dir / "expected.json").read_text(encoding="utf-8"))
    assert [r["token_ids"] for r in records] == [
        expected["prompts"][0]["greedy"]["new_token_ids"],
        expected["prompts"][3]["greedy"]["new_token_ids"],
    ]
    assert records[0]["text"] == expected["prompts"][0]["greedy"]["suffix_text"]


def test_generate_refuses_a_missing_checkpoint(
    tmp_path: Path, tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(
        capsys,
        "generate",
        "--checkpoint",
        tmp_path,
        "--vocab",
        tiny_dir / "vocab" / "voc_tiny.sp",
        "--preset",
        "yalm-tiny",
        "hello",
    )
    assert code == 2
    assert "layer_00-model_00-model_states.pt" in err and "missing" in err
