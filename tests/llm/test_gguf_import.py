"""GGUF import of a Llama-architecture file written the way llama.cpp's converter writes it.

A tiny random transformers Llama is saved as GGUF with llama.cpp's tensor names, its q/k
rows permuted for llama.cpp's interleaved rotary, and the MLP quantised to Q8_0; the
importer must undo all of it: the imported store's logits equal transformers' on the same
(dequantised) weights. Broken inputs are refused with the file and the tensor named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from reference_deps import require

from robot_llm.errors import RobotLLMError
from robot_llm.llm.store.importers import import_model
from robot_llm.llm.store.quant import DEFAULT_INT4_GROUP, GGUF_INT4_GROUP

transformers = require("transformers")
gguf = require("gguf")

HEADS, KV_HEADS, LAYERS = 4, 2, 2


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(model: Any, path: Path, *, drop: str | None = None) -> None:
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, tensor in model.state_dict().items():
        w = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            target = "token_embd.weight"
        elif name == "model.norm.weight":
            target = "output_norm.weight"
        elif name == "lm_head.weight":
            target = "output.weight"
        else:
            _, _, index, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            target = f"blk.{index}.{names[module]}.weight"
            if module == "self_attn.q_proj":
                w = _permute(w, HEADS)
            elif module == "self_attn.k_proj":
                w = _permute(w, KV_HEADS)
        if target == drop:
            continue
        if target.split(".")[-2].startswith("ffn_") and w.ndim == 2:
            writer.add_tensor(
                target, gguf.quantize(w, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0
            )
        else:
            writer.add_tensor(target, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def model() -> Any:
    torch.manual_seed(11)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=160,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "eager"
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
        # The reference sees the MLP exactly as the Q8_0 file stores it.
        for name, p in m.named_parameters():
            if ".mlp." in name:
                q = gguf.quantize(p.numpy(), gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(gguf.dequantize(q, gguf.GGMLQuantizationType.Q8_0)))
    return m


@pytest.fixture
def tokenizer_json(tmp_path: Path, tiny_tokenizer: Any) -> Path:
    tiny_tokenizer(160, tmp_path)
    return tmp_path / "tokenizer.json"


def test_llama_gguf_imports_faithfully(model: Any, tmp_path: Path, tokenizer_json: Path, door: Any) -> None:
    path = tmp_path / "tiny-llama.gguf"
    _write_gguf(model, path)
    manifest = import_model(path, tmp_path / "store", dtype="fp32", tokenizer=tokenizer_json)
    assert manifest.config.family == "llama" and manifest.config.num_key_value_heads == KV_HEADS
    opened = door(tmp_path / "store")
    try:
        ids = torch.randint(3, 160, (1, 21), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            want = model(ids).logits
        assert (opened.engine.forward(ids) - want).abs().max().item() <= 1e-4
    finally:
        opened.close()
    # int4 from a GGUF keeps the source's 32-weight blocks in their own groups; a float source gets 64.
    assert import_model(path, tmp_path / "q", dtype="int4", tokenizer=tokenizer_json).group_size == GGUF_INT4_GROUP
    assert import_model(path, tmp_path / "q64", dtype="int4", group_size=64, tokenizer=tokenizer_json).group_size == 64
    assert GGUF_INT4_GROUP == 32 < DEFAULT_INT4_GROUP


def test_missing_tensor_and_garbage_are_named(model: Any, tmp_path: Path, tokenizer_json: Path) -> None:
    path = tmp_path / "holey.gguf"
    _write_gguf(model, path, drop="blk.1.ffn_up.weight")
    with pytest.raises(RobotLLMError, match=r"holey\.gguf.*layer 1 'mlp\.up_proj\.weight'"):
        import_model(path, tmp_path / "store", dtype="fp32", tokenizer=tokenizer_json)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(RobotLLMError, match=r"garbage\.gguf"):
        import_model(garbage, tmp_path / "store2", dtype="fp32", tokenizer=tokenizer_json)


def test_each_importer_name_belongs_to_one_family() -> None:
    # A family's GGUF architectures and Hugging Face model types live on its config class; the registry finds
    # the one family that claims each (two claiming one name would import it as whichever is listed first).
    from robot_llm.llm.families.registry import config_classes, gguf_config_class, hf_config_class

    for cls in config_classes():
        assert all(gguf_config_class(arch) is cls for arch in cls.gguf_architectures), cls.family
        assert all(hf_config_class(model_type) is cls for model_type in cls.hf_model_types), cls.family
    assert gguf_config_class("qwen2").family == "llama" and hf_config_class("gemma3_text").family == "gemma3"
    assert gguf_config_class("phi3") is None and hf_config_class("yalm") is None
