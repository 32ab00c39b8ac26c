"""Gemma 3 270M (the packaged GGUF) against transformers on the same dequantised weights: tokens, logits, greedy.

Slow (both sides read a 240 MB GGUF and build a 262k-token tokenizer). CI installs the model
package with scripts/install.sh; elsewhere the test is skipped when the package is missing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from reference_deps import require

from robot_llm.llm.reference import GREEDY_TOKENS, LOGIT_TOLERANCE, check_gemma
from robot_llm.llm.store.demo_checkpoint import gemma_gguf

pytestmark = pytest.mark.slow
require("transformers")


def test_gemma_270m_matches_transformers(gemma_fp32_store: Path) -> None:
    gguf = gemma_gguf()
    assert gguf is not None  # the fixture converted it
    result = check_gemma(gguf, gemma_fp32_store)  # our import of the GGUF, shared with the other Gemma tests
    assert result["long_prompt_tokens"] > 600  # beyond the 512-token sliding window
    assert result["tokens_match"] == result["tokens_total"]
    assert result["max_abs_diff"] <= LOGIT_TOLERANCE
    assert result["greedy_match"] == result["greedy_total"] == 3, f"{GREEDY_TOKENS} greedy tokens differ"
