"""Compressed KV cache: int8/int4 round trips within half a step, the engine generates from it, memory shrinks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from robot_llm.llm.engine import StreamingModel
from robot_llm.llm.family import KVCache
from robot_llm.llm.generate import SamplingParams, generate
from robot_llm.llm.kvquant import QuantKV, kv_bits_per_value
from robot_llm.llm.tokenizer import YalmTokenizer

PROMPTS = ["Акции выросли", "The index fell after the report", "Нефть", "Brent and WTI both rose on Monday"]


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_slots_written_step_by_step_read_back_within_half_a_step(kv_dtype: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 10, 2, 16, generator=g)
    cache = QuantKV.empty((3, 12, 2, 16), kv_dtype, "cpu")
    cache.write(0, x[:, :7])  # a prefill, then three decode steps
    for t in range(7, 10):
        cache.write(t, x[:, t : t + 1])
    out = cache.read(10, torch.device("cpu"), torch.float32)
    assert out.shape == (3, 10, 2, 16)
    half_step = cache.scale[:, :10].float() / 2
    assert bool(((out - x).abs() <= half_step + 1e-3 * x.abs().amax()).all())
    assert cache.rows(1, 2).read(10, torch.device("cpu"), torch.float32).equal(out[1:2])


def test_compressed_cache_is_smaller_by_its_bits(tiny_config) -> None:  # type: ignore[no-untyped-def]
    def nbytes(cache: KVCache) -> int:
        return sum(
            sum(t.nbytes for t in (q.codes, q.scale, q.low) if t is not None) if isinstance(q, QuantKV) else q.nbytes
            for q in cache.k + cache.v
        )

    plain = nbytes(KVCache.allocate(tiny_config, 4, 32, dtype=torch.float32))
    for kv_dtype in ("int8", "int4"):
        packed = nbytes(KVCache.allocate(tiny_config, 4, 32, dtype=torch.float32, kv_dtype=kv_dtype))
        assert packed == plain * kv_bits_per_value(kv_dtype, tiny_config.head_dim) / 32


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_the_engine_generates_from_a_compressed_cache(
    stores: dict[str, Path], tokenizer: YalmTokenizer, kv_dtype: str
) -> None:
    params = SamplingParams(max_new_tokens=8, greedy=True)
    plain = StreamingModel(stores["fp16"], home="ram", device="cpu")
    packed = StreamingModel(stores["fp16"], home="ram", device="cpu", kv_dtype=kv_dtype)
    ours = generate(packed, tokenizer, PROMPTS, params, batch_size=4)
    theirs = generate(plain, tokenizer, PROMPTS, params, batch_size=4)
    same = sum(a.token_ids == b.token_ids for a, b in zip(ours, theirs, strict=True))
    # int8 KV (16-wide heads, fp16 scale each) keeps every greedy continuation of the fixture; the coarser
    # int4 KV keeps most (measured: 4 of 4 int8, see the report for int4) and never breaks generation.
    assert all(c.new_token_count == 8 for c in ours)
    assert same == 4 if kv_dtype == "int8" else same >= 1
    ids = torch.tensor([tokenizer.encode(p)[:3] for p in PROMPTS])
    cache, ref = packed.new_cache(4, 8), plain.new_cache(4, 8)
    first, want = packed.forward(ids, cache), plain.forward(ids, ref)
    step, want_step = packed.forward(want[:, -1:].argmax(-1), cache), plain.forward(want[:, -1:].argmax(-1), ref)
    # Attention reads every slot back from the compressed cache, this pass's own too.
    bound = 0.05 if kv_dtype == "int8" else 0.5
    for ours_logits, want_logits in ((first, want), (step, want_step)):
        assert 0 < float((ours_logits - want_logits).abs().max()) <= bound
    plain.close()
    packed.close()
