"""YaLM-100B inference in plain PyTorch.

Submodules:

* :mod:`robot_llm.llm.config` -- :class:`YalmConfig` and named presets (no torch import);
* :mod:`robot_llm.llm.yalm` -- the functional forward pieces, the KV cache and the
  in-memory :class:`~robot_llm.llm.yalm.Yalm` model;
* :mod:`robot_llm.llm.checkpoint` -- the release checkpoint reader/writer;
* :mod:`robot_llm.llm.tokenizer` -- SentencePiece with YaLM conventions;
* :mod:`robot_llm.llm.generate` -- batched generation and scoring;
* :mod:`robot_llm.llm.backends` -- registry of model factories used by the CLI;
* :mod:`robot_llm.llm.cli` -- ``model generate`` / ``model check-fixture``.

Importing this package does not import torch; import the submodules you need.
"""

from robot_llm.llm.config import PRESETS, YalmConfig

__all__ = ["PRESETS", "YalmConfig"]
