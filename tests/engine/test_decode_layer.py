"""A decode step's layer in one call of ours (``layer.c``): the family's Python path to the bit (logits and the cache
the step wrote) for Gemma 3, Qwen 3 (q/k norms) and Mistral (Llama's layer, a sliding window), over left-padded rows,
sliding and global layers, int4 and int8 stores, fp32 and bf16 compute, both caches the plan makes, one and two
threads; and the Python path wherever the call cannot serve."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor

from robot_llm.llm.engine.streaming import StreamingModel
from robot_llm.llm.families import decode_layer, gemma3, llama
from robot_llm.llm.families.config import ModelConfig, module_plan
from robot_llm.llm.families.family import random_weights
from robot_llm.llm.families.gemma3 import Gemma3Config
from robot_llm.llm.families.llama import LlamaConfig
from robot_llm.llm.plan.cpu import cpu_flags
from robot_llm.llm.store.int8act import ONE_CALL_ROWS, int8_activations_on_cpu
from robot_llm.llm.store.writer import write_store

pytestmark = pytest.mark.skipif(not {"avx2", "fma"} <= cpu_flags(), reason="built where gemv.c is (AVX2, FMA)")

#: Four query heads on two KV heads, a sliding window shorter than the prompt, every width our int8 products pad.
CFG = Gemma3Config(
    num_layers=2,
    hidden_size=128,
    intermediate_size=192,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=64,
    vocab_size=500,
    layer_types=("sliding_attention", "full_attention"),
    sliding_window_size=5,
    query_pre_attn_scalar=32,
)
LLAMA = dict(CFG.to_dict(), rms_norm_eps=1e-5)
for key in ("layer_types", "sliding_window_size", "query_pre_attn_scalar", "rope_local_base_freq"):
    LLAMA.pop(key)
for key in ("final_logit_softcapping", "attn_logit_softcapping", "rope_scaling_factor"):
    LLAMA.pop(key, None)
CONFIGS: dict[str, ModelConfig] = {
    "gemma3": CFG,
    "qwen3": LlamaConfig(**LLAMA, qk_norm=True),
    "mistral": LlamaConfig(**LLAMA, sliding_window_size=5),
}
#: Qwen 2's q, k and v have biases, which ``layer.c`` does not add.
BIASED = LlamaConfig(**LLAMA, qkv_bias=True)


@pytest.fixture(autouse=True)
def int8_activations(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """int8 activations on whatever this CPU's probe would say (``layer.c`` multiplies only with them)."""
    monkeypatch.setenv("ROBOT_LLM_INT8_ACTIVATIONS", "1")
    int8_activations_on_cpu.cache_clear()
    yield
    monkeypatch.undo()
    int8_activations_on_cpu.cache_clear()


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """Each family's random weights as an int4 and an int8 store."""
    root, out = tmp_path_factory.mktemp("one-call-layer"), {}
    for name, cfg in {**CONFIGS, "qwen2": BIASED}.items():
        weights = random_weights(cfg, seed=5, std=0.2)
        for dtype in ("int4", "int8"):
            modules = (
                (kind, index, weights.layers[index] if kind == "layer" else weights.resident[kind])
                for kind, index, _ in module_plan(cfg)
            )
            write_store(root / name / dtype, cfg, modules, dtype=dtype)
            out[name, dtype] = root / name / dtype
    return out


def _night(model: StreamingModel, ids: Tensor, pad: Tensor, steps: int) -> tuple[Tensor, list[Tensor]]:
    """The prompt, then ``steps`` greedy tokens a row: every step's logits, and the cache's keys and values."""
    cache = model.new_cache(ids.shape[0], ids.shape[1] + steps, pad)
    logits = [model.forward(ids, cache)[:, -1]]
    for _ in range(steps):
        logits.append(model.forward(logits[-1].argmax(-1)[:, None], cache)[:, -1])
    held = [t for i in range(CFG.num_layers) for t in (cache.layer(i).k, cache.layer(i).v)]
    # an int8 cache as its codes and scales
    tensors = [u for t in held for u in ((t,) if isinstance(t, Tensor) else (t.codes, t.scale))]
    return torch.stack(logits), [t.clone() for t in tensors]


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every layer call's answer from decode_layer: True where it computed the layer."""
    served: list[bool] = []
    real = decode_layer.decode_layer

    def counted(*args: object) -> Tensor | None:
        out = real(*args)  # type: ignore[arg-type]
        served.append(out is not None)
        return out

    monkeypatch.setattr(gemma3, "decode_layer", counted)
    monkeypatch.setattr(llama, "decode_layer", counted)
    return served


@pytest.mark.parametrize("family", CONFIGS)
@pytest.mark.parametrize(
    ("store", "dtype", "kv_dtype", "threads"),
    [
        ("int4", "fp32", "bf16", 1),
        ("int4", "fp32", None, 2),
        ("int8", "bf16", None, 2),
        ("int4", "bf16", None, 1),
        ("int4", "fp32", "int8", 2),
        ("int8", "bf16", "int8", 1),
    ],
)
def test_the_one_call_layer_is_the_python_paths_to_the_bit(
    stores: dict[tuple[str, str], Path],
    monkeypatch: pytest.MonkeyPatch,
    family: str,
    store: str,
    dtype: str,
    kv_dtype: str | None,
    threads: int,
) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = StreamingModel(stores[family, store], home="ram", device="cpu", dtype=dtype, kv_dtype=kv_dtype)
        ids = torch.randint(3, 500, (3, 9), generator=torch.Generator().manual_seed(1))
        pad = torch.tensor([0, 2, 6])  # the last row's prompt is three tokens: its masks differ from the others'
        served = _counting(monkeypatch)
        ours, our_cache = _night(model, ids, pad, steps=8)
        assert sum(served) == 8 * CFG.num_layers  # every decode step's every layer, no prefill
        monkeypatch.setattr(decode_layer, "enabled", lambda: False)
        python, python_cache = _night(model, ids, pad, steps=8)
        model.close()
    finally:
        torch.set_num_threads(before)
    assert torch.equal(ours, python)
    assert all(torch.equal(a, b) for a, b in zip(our_cache, python_cache, strict=True))
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "int8": torch.int8}
    assert our_cache[0].dtype == dtypes[kv_dtype or dtype]


def test_the_python_path_runs_what_one_call_cannot(
    stores: dict[tuple[str, str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    served = _counting(monkeypatch)
    ids = torch.randint(3, 500, (ONE_CALL_ROWS + 1, 4), generator=torch.Generator().manual_seed(2))
    model = StreamingModel(stores["gemma3", "int4"], home="ram", device="cpu", dtype="fp32")
    _night(model, ids, torch.zeros(ids.shape[0], dtype=torch.long), steps=1)  # more rows than one call takes
    _night(model, ids[:2], torch.zeros(2, dtype=torch.long), steps=1)
    assert served == [False] * 3 * CFG.num_layers + [True] * CFG.num_layers  # prefills: the Python path
    model.close()
    served.clear()
    # an int4 cache: its codes are written and read by the Python path
    model = StreamingModel(stores["gemma3", "int4"], home="ram", device="cpu", dtype="fp32", kv_dtype="int4")
    _night(model, ids[:2], torch.zeros(2, dtype=torch.long), steps=1)
    model.close()
    bf16 = StreamingModel(stores["gemma3", "int4"], home="ram", device="cpu", dtype="bf16", kv_dtype="fp32")
    _night(bf16, ids[:2], torch.zeros(2, dtype=torch.long), steps=1)  # an fp32 cache under bf16: cast for torch
    bf16.close()
    disk = StreamingModel(stores["gemma3", "int4"], home="disk", device="cpu", dtype="fp32")  # streamed: no int8 copy
    _night(disk, ids[:2], torch.zeros(2, dtype=torch.long), steps=1)
    disk.close()
    biased = StreamingModel(stores["qwen2", "int4"], home="ram", device="cpu", dtype="fp32")
    _night(biased, ids[:2], torch.zeros(2, dtype=torch.long), steps=1)
    biased.close()
    assert len(served) == 4 * 2 * CFG.num_layers and not any(served)  # four nights of a prefill and a step
    monkeypatch.setenv(decode_layer.ENV, "0")
    decode_layer.enabled.cache_clear()
    assert not decode_layer.enabled()
    monkeypatch.undo()
    decode_layer.enabled.cache_clear()
    assert decode_layer.enabled()


def test_what_a_layer_keeps_of_its_weights_goes_with_them(
    stores: dict[tuple[str, str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = torch.randint(3, 500, (2, 4), generator=torch.Generator().manual_seed(3))
    before = set(decode_layer._HELD)
    model = StreamingModel(stores["gemma3", "int4"], home="ram", device="cpu", dtype="fp32")
    first, _ = _night(model, ids, torch.zeros(2, dtype=torch.long), steps=2)
    assert len(set(decode_layer._HELD) - before) == CFG.num_layers  # one entry a layer, made on the first step
    # Another matrix in a layer's place (layer 1's q in layer 0): that layer's products are gathered again.
    params = model.ram_params[0]
    params["self_attn.q_proj.weight"] = model.ram_params[1]["self_attn.q_proj.weight"]
    swapped, _ = _night(model, ids, torch.zeros(2, dtype=torch.long), steps=2)
    monkeypatch.setattr(decode_layer, "enabled", lambda: False)
    python, _ = _night(model, ids, torch.zeros(2, dtype=torch.long), steps=2)
    monkeypatch.undo()
    assert torch.equal(swapped, python) and not torch.equal(swapped[1:], first[1:])
    model.close()
    del model, params
    gc.collect()
    assert set(decode_layer._HELD) <= before  # the engine's weights are gone, and what was kept of them
    again = StreamingModel(stores["gemma3", "int4"], home="ram", device="cpu", dtype="fp32")
    second, _ = _night(again, ids, torch.zeros(2, dtype=torch.long), steps=2)
    again.close()
    assert torch.equal(first, second)
