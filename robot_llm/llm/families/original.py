"""The original batch-1 generation loop of YaLM (docs/yalm-model.md §7), for the fidelity checks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from robot_llm.llm.families.family import ForwardModel
from robot_llm.llm.generate import SamplingParams
from robot_llm.llm.sampling import choose_token
from robot_llm.llm.tokenizer import Tokenizer


@dataclass(frozen=True)
class OriginalSample:
    """Result of :func:`generate_original`: all tokens (BOS + prompt + new) and the text after the prompt."""

    token_ids: tuple[int, ...]
    new_token_ids: tuple[int, ...]
    suffix: str
    stopped_on_eos: bool


def generate_original(
    model: ForwardModel,
    tokenizer: Tokenizer,
    prompt: str,
    *,
    seq_length: int = 256,
    out_seq_length: int = 128,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 0.0,
    seed: int = 1234,
    recompute: bool = False,
) -> OriginalSample | None:
    """The original batch-1 loop (§7): same token counts, same stop rule, same output cut.

    Returns None for a prompt the original skips (``len(tokens) >= seq_length // 2``).
    ``recompute`` re-runs the whole sequence every step instead of using the cache.
    """
    if seq_length > model.config.max_position_embeddings:
        raise ValueError(f"seq_length {seq_length} exceeds {model.config.max_position_embeddings}")
    tokens = tokenizer.encode(prompt)
    ctx_len = len(tokens)
    if ctx_len >= seq_length // 2:
        return None
    maxlen = seq_length - 1
    if maxlen > ctx_len + out_seq_length:
        maxlen = ctx_len + out_seq_length - 1
    params = SamplingParams(
        max_new_tokens=out_seq_length, temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy, seed=seed
    )
    generator = None if greedy else torch.Generator().manual_seed(seed)
    cache = None if recompute else model.new_cache(1, seq_length)
    stopped = False
    cur = ctx_len
    while cur <= maxlen:
        if recompute:
            logits = model.forward(torch.tensor([tokens]))[0, cur - 1]
        else:
            feed = tokens if cur == ctx_len else tokens[-1:]
            logits = model.forward(torch.tensor([feed]), cache, last_only=True)[0, -1]
        token = choose_token(logits, params, generator)
        tokens.append(token)
        cur += 1
        if token == tokenizer.eos_id:
            stopped = True
            break
    return OriginalSample(
        token_ids=tuple(tokens),
        new_token_ids=tuple(tokens[ctx_len:]),
        suffix=tokenizer.decode(tokens)[len(prompt) :],
        stopped_on_eos=stopped,
    )
