"""LLM inference in plain PyTorch: YaLM-100B, Gemma 3 and the Llama family, streamed from a weight store.

Subpackages, in the order a model is used:

* :mod:`robot_llm.llm.families` -- each family in one file: its config (sizes, weight names and
  shapes per module, the importer's names, named presets) and forward pass, behind one interface;
* :mod:`robot_llm.llm.store` -- the weight store: reading, writing, importing (release
  checkpoints, GGUF, Hugging Face folders), quantisation and large reads;
* :mod:`robot_llm.llm.plan` -- the memory planner and what it knows about the machine;
* :mod:`robot_llm.llm.engine` -- the engines that run a model (streaming, in memory, DeepSpeed),
  the policy fixed when one opens, and the KV cache;
* :mod:`robot_llm.llm.model` -- the one door: :meth:`~robot_llm.llm.model.Model.open` opens a model
  (planned, or placed by a given policy), then ``generate`` and ``score``;
* :mod:`robot_llm.llm.generate`, :mod:`robot_llm.llm.scoring`, :mod:`robot_llm.llm.tokenizer` --
  batched generation and scoring, the tokenizers.

Importing this package does not import torch; import the submodules you need.
"""
