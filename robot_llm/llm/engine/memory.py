"""The whole model in memory, any family (:class:`InMemoryModel`); the ``memory`` backend's YaLM from a release."""

from __future__ import annotations

import torch
from torch import Tensor

from robot_llm.llm.engine.finite import FiniteWatch
from robot_llm.llm.engine.kv_cache import KVCache
from robot_llm.llm.families.config import ModelConfig
from robot_llm.llm.families.family import Weights, bind_layer, forward_pass, prepare_step, resolve_dtype
from robot_llm.llm.families.registry import family_of
from robot_llm.llm.families.yalm import YalmConfig


class InMemoryModel:
    """A whole model held in memory, any family; implements :class:`ForwardModel`."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Weights,
        *,
        dtype: str | torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = cfg
        self.family = family_of(cfg)
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        self.weights = weights.to(self.device, self.dtype)
        self.rope = self.family.rope(cfg)
        self.watch = FiniteWatch()
        #: The last pass's final hidden states before the output head (``[B, T, H]``, or ``[B, 1, H]`` with
        #: ``last_only``): what a stance head reads at a followup's branch, in the same weight pass.
        self.last_hidden: Tensor | None = None

    def new_cache(self, batch: int, max_len: int, pad: Tensor | None = None) -> KVCache:
        """An empty cache on the model's device in the compute dtype."""
        return KVCache.allocate(self.config, batch, max_len, dtype=self.dtype, device=self.device, pad=pad)

    @torch.inference_mode()
    def forward(
        self,
        ids: Tensor,
        cache: KVCache | None = None,
        pad: Tensor | None = None,
        *,
        last_only: bool = False,
        select: Tensor | None = None,
    ) -> Tensor:
        """See :meth:`ForwardModel.forward`."""
        cfg, w, fam = self.config, self.weights, self.family
        step = prepare_step(cfg, self.rope, cache, ids.shape[1], pad, self.device, self.dtype, batch=ids.shape[0])
        logits, self.last_hidden = forward_pass(
            ids,
            step,
            cache,
            embed=lambda ids: fam.embed(ids.to(self.device), w.resident, cfg),
            layers=((f"layer {i}", bind_layer(fam, p, cfg, i)) for i, p in enumerate(w.layers)),
            head=lambda x: fam.head(x, w.resident, cfg),
            watch=self.watch,
            last_only=last_only,
            select=select,
            num_layers=len(w.layers),
        )
        return logits

    __call__ = forward

    def first_nonfinite(self) -> str:
        """Where the last pass first went non-finite (:func:`robot_llm.llm.engine.finite.check_logits` asks)."""
        return self.watch.first_bad() or "the output head"


class Yalm(InMemoryModel):
    """The whole YaLM held in memory (see :class:`InMemoryModel`)."""

    @classmethod
    def from_release(
        cls,
        directory: str,
        cfg: YalmConfig,
        *,
        dtype: str | torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        trust_pickle: bool = False,
    ) -> Yalm:
        """Load a release-layout checkpoint folder (``layer_NN-model_00-model_states.pt`` files)."""
        from robot_llm.llm.store.checkpoint import load_release

        weights = load_release(directory, cfg, trust_pickle=trust_pickle)
        return cls(cfg, weights, dtype=resolve_dtype(dtype), device=device)
