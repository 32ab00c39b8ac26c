"""LLM inference in plain PyTorch: YaLM-100B, Gemma 3 and the Llama family, streamed from a weight store.

Submodules:

* :mod:`robot_llm.llm.families.config` / :mod:`robot_llm.llm.families.config_hf` -- the families' configs
  (sizes, weight names and shapes per module) and named presets (no torch import);
* :mod:`robot_llm.llm.families.family` -- the family interface, the KV cache, step masks and the
  in-memory model every family shares;
* :mod:`robot_llm.llm.families.yalm`, :mod:`robot_llm.llm.families.llama`, :mod:`robot_llm.llm.families.gemma3` --
  each family's forward pass;
* :mod:`robot_llm.llm.store.checkpoint` -- the release checkpoint reader/writer;
* :mod:`robot_llm.llm.tokenizer` -- SentencePiece with YaLM conventions, Hugging Face ``tokenizers``;
* :mod:`robot_llm.llm.generate` -- batched generation and scoring;
* :mod:`robot_llm.llm.engine.backends` -- registry of model factories used by the CLI;
* :mod:`robot_llm.commands.model` -- ``model generate`` / ``model check-fixture``.

Importing this package does not import torch; import the submodules you need.
"""

from robot_llm.llm.families.config import PRESETS, YalmConfig

__all__ = ["PRESETS", "YalmConfig"]
