"""Llama-family and Gemma 3 forwards against transformers on tiny random models (fp32, max |Δlogit| <= 1e-4).

Each model is built by transformers from a tiny config with random weights, saved as a
Hugging Face folder, imported into a store by the production importer and run by the
in-memory model and the streaming engine: whole-sequence logits, KV-cached decoding
and left-padded batches must all match the reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from reference_deps import require

from robot_llm.llm.engine.memory import InMemoryModel
from robot_llm.llm.families.config import module_plan
from robot_llm.llm.families.family import Weights
from robot_llm.llm.store.importers import hf_config, import_model, iter_hf_modules

transformers = require("transformers")

TOLERANCE = 1e-4
COMMON = {
    "hidden_size": 64,
    "intermediate_size": 112,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "vocab_size": 211,
    "max_position_embeddings": 128,
}


def _configs() -> dict[str, Any]:
    t = transformers
    return {
        # Llama 3.1-style: grouped KV heads, llama3 rotary scaling, untied head.
        "llama": t.LlamaConfig(
            **COMMON,
            num_key_value_heads=2,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            rope_theta=500000.0,
            tie_word_embeddings=False,
        ),
        # Qwen 2: q/k/v biases, tied embeddings.
        "qwen2": t.Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6),
        # Qwen 3: per-head q/k RMSNorm, explicit head_dim.
        "qwen3": t.Qwen3Config(**COMMON, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True),
        # Mistral: a sliding window shorter than the prompts.
        "mistral": t.MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=5),
        # Gemma 3: local/global layers, window shorter than the prompts, one KV head.
        "gemma3": t.Gemma3TextConfig(
            **COMMON,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
        ),
    }


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral", "gemma3"])
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A random tiny transformers model (eager attention, fp32) saved as a Hugging Face folder."""
    torch.manual_seed(7)
    hf_cfg = _configs()[request.param]
    hf_cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    with torch.no_grad():  # norms and biases away from their 1/0 init so that every weight matters
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return model, folder


def _ids(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (17, 9, 12)]


def _ours(folder: Path) -> InMemoryModel:
    cfg = hf_config(folder)
    weights = Weights(resident={}, layers=[])
    for kind, _, params in iter_hf_modules(folder, cfg):
        if kind == "layer":
            weights.layers.append(params)
        else:
            weights.resident[kind] = params
    return InMemoryModel(cfg, weights)


def test_logits_match_transformers(reference: tuple[Any, Path]) -> None:
    model, folder = reference
    ours = _ours(folder)
    assert len(module_plan(ours.config)) == ours.config.num_layers + 2
    for ids in _ids(ours.config.vocab_size):
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0]
        got = ours.forward(torch.tensor([ids]))[0]
        assert (got - want).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("attend_where_stored", [False, True])
def test_cached_decoding_and_padded_batches_match(reference: tuple[Any, Path], attend_where_stored: bool) -> None:
    # attend_where_stored: FlexGen's CPU attention (a decode step attends on the cache's device in fp32,
    # only q and the output move); compute and cache share the CPU here, so nothing may change.
    model, folder = reference
    ours = _ours(folder)
    prompts = _ids(ours.config.vocab_size)
    with torch.no_grad():
        want = [model(torch.tensor([ids])).logits[0] for ids in prompts]
    # Left-padded batch without a cache.
    width = max(map(len, prompts))
    pad = torch.tensor([width - len(p) for p in prompts])
    batch = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    logits = ours.forward(batch, None, pad)
    for b in range(len(prompts)):
        assert (logits[b, int(pad[b]) :] - want[b]).abs().max().item() <= TOLERANCE
    # Prefill all but the last four tokens, then decode one token at a time from the cache.
    cache = ours.new_cache(len(prompts), width, pad)
    cache.attend_where_stored = attend_where_stored
    prefix = batch[:, : width - 4]
    steps = [ours.forward(prefix, cache)[:, -1]]
    steps += [ours.forward(batch[:, t : t + 1], cache)[:, -1] for t in range(width - 4, width - 1)]
    for b in range(len(prompts)):
        for i, t in enumerate(range(width - 5, width - 1)):
            assert (steps[i][b] - want[b][t - int(pad[b])]).abs().max().item() <= TOLERANCE


def test_streaming_engine_on_the_imported_store(
    reference: tuple[Any, Path], tmp_path: Path, tiny_tokenizer: Any, door: Any
) -> None:
    model, folder = reference
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    tiny_tokenizer(model.config.vocab_size, tokenizer_dir)
    import_model(folder, tmp_path / "store", dtype="fp32", tokenizer=tokenizer_dir / "tokenizer.json")
    opened = door(tmp_path / "store")
    try:
        ids = _ids(model.config.vocab_size)[0]
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0]
        assert (opened.engine.forward(torch.tensor([ids]))[0] - want).abs().max().item() <= TOLERANCE
    finally:
        opened.close()
    assert (tmp_path / "store" / "tokenizer.json").is_file()


def test_cli_generates_from_an_imported_store(
    reference: tuple[Any, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_tokenizer: Any
) -> None:
    from robot_llm.commands.model import main

    model, folder = reference
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    tiny_tokenizer(model.config.vocab_size, tokenizer_dir)
    assert (
        main(
            [
                "model",
                "convert",
                str(folder),
                str(tmp_path / "store"),
                "--dtype",
                "fp32",
                "--tokenizer",
                str(tokenizer_dir / "tokenizer.json"),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "model",
                "generate",
                "--store",
                str(tmp_path / "store"),
                "--greedy",
                "--max-new-tokens",
                "4",
                "--json",
                "w5 w6 w7",
            ]
        )
        == 0
    )
    import json

    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = [2, 5, 6, 7]  # BOS then the three words
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, eos_token_id=None)[0, 4:]
    assert record["token_ids"] == want.tolist()
