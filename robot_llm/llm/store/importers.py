"""Importers into the weight store: GGUF files and Hugging Face folders, streamed tensor by tensor.

:func:`import_model` reads the source's config, writes its tokenizer beside the
store (``tokenizer.json`` + ``tokenizer_config.json``, loaded by
:class:`~robot_llm.llm.tokenizer.HFTokenizer`) and hands the modules, one at a
time, to :func:`~robot_llm.llm.store.writer.convert_modules`, which writes the same
store a YaLM release converts into (fp32/fp16/bf16/int8/int4).

* **GGUF** (read with ``gguf``, the llama.cpp project's own library): tensors are
  dequantised (Q4_K, Q5_0, Q6_K, Q8_0, F16, F32, ...) to float32 and renamed to
  the Hugging Face keys; what llama.cpp's converter changed is undone as
  transformers' GGUF loader does (Llama's q/k row permutation, Gemma's norms
  stored as ``1 + weight``). The tokenizer is rebuilt from the GGUF metadata with
  the ``tokenizers`` library exactly as transformers' GGUF integration builds it
  (Gemma's SentencePiece-style BPE: merges derived from the vocabulary order).
  ``--dtype int4`` keeps int8 the matrices the file holds at more than 4-bit types
  (:func:`gguf_int8_tensors`), so no matrix loses the bits its quantiser gave it.
* **Hugging Face folder** (``config.json``, ``*.safetensors``, ``tokenizer.json``):
  tensors are read one at a time from the shards; the tokenizer files are copied.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from robot_llm.errors import RobotLLMError
from robot_llm.llm.families.config import ModelConfig, ModuleKind, module_plan
from robot_llm.llm.families.family import Params
from robot_llm.llm.families.registry import config_classes, gguf_config_class, hf_config_class
from robot_llm.llm.store.quant import DEFAULT_INT4_GROUP, GGUF_INT4_GROUP
from robot_llm.llm.store.reader import Manifest, StoreFile, file_name, is_quantized_key
from robot_llm.llm.store.writer import convert_modules
from robot_llm.llm.tokenizer import TOKENIZER_CONFIG

log = logging.getLogger(__name__)


class ModelImportError(RobotLLMError):
    """A GGUF file or Hugging Face folder cannot be imported; the message names the file and tensor."""


#: Most bits per weight a GGUF matrix may spend and still be converted to int4 by ``--dtype int4``: what int4
#: itself spends at the GGUF group of 32 (4-bit codes, a bf16 scale and zero per 32 weights), so Q4_1 (5.0),
#: Q4_0/Q4_K/IQ4_NL (4.5) and fewer stay int4; Q5_0/Q5_K (5.5), Q6_K (6.56), Q8_0 (8.5) are stored int8.
GGUF_INT4_MAX_BITS = 5.0


# --------------------------------------------------------------------------- GGUF

#: GGUF tensor name (after ``blk.N.``) -> Hugging Face key, per architecture (llama.cpp's names).
_GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_RESIDENT: dict[str, tuple[ModuleKind, str]] = {
    "token_embd.weight": ("embedding", "embed_tokens.weight"),
    "output_norm.weight": ("output", "norm.weight"),
    "output.weight": ("output", "lm_head.weight"),
}
#: Each family's own names (its architectures, its norms) are on its config class (the registry finds it).
_SUPPORTED = ", ".join(a for cls in config_classes() for a in cls.gguf_architectures)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader: Any, path: Path) -> ModelConfig:
    """The family config a GGUF file describes (``general.architecture`` and its hyperparameters)."""
    arch = _field(reader, "general.architecture")
    family = gguf_config_class(arch)
    if family is None:
        raise ModelImportError(f"{path}: GGUF architecture {arch!r} is not supported ({_SUPPORTED})")

    def get(key: str, default: Any = None, *, required: bool = True) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if value is None and required:
            raise ModelImportError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    names = {t.name for t in reader.tensors}
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    common = {
        "num_layers": int(get("block_count")),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": int(
            len(_field(reader, "tokenizer.ggml.tokens", [])) or _tensor(reader, "token_embd.weight").shape[1]
        ),
    }
    try:  # the rest is the family's own (its config's from_gguf)
        config: ModelConfig = family.from_gguf(common, get, names)
    except ValueError as exc:
        raise ModelImportError(f"{path}: {exc}") from None
    return config


def _tensor(reader: Any, name: str) -> Any:
    for t in reader.tensors:
        if t.name == name:
            return t
    raise KeyError(name)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for its interleaved rotary (transformers' reverse permute)."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _gguf_by_module(reader: Any, path: Path) -> tuple[dict[tuple[str, int], dict[str, Any]], list[str]]:
    """The file's tensors by store module ``(kind, index)`` and Hugging Face key; the names of those it ignores."""
    arch = _field(reader, "general.architecture")
    layer_names = _GGUF_LAYER | gguf_config_class(arch).gguf_norms
    by_module: dict[tuple[str, int], dict[str, Any]] = {}
    ignored = []
    for t in reader.tensors:
        if t.name in _GGUF_RESIDENT:
            kind, key = _GGUF_RESIDENT[t.name]
            by_module.setdefault((kind, 0), {})[key] = t
        elif t.name.startswith("blk."):
            _, index, rest = t.name.split(".", 2)
            if rest not in layer_names:
                raise ModelImportError(f"{path}: unexpected tensor {t.name!r} for architecture {arch}")
            by_module.setdefault(("layer", int(index)), {})[layer_names[rest]] = t
        else:
            ignored.append(t.name)
    return by_module, ignored


def gguf_bits_per_weight(tensor_type: Any) -> float:
    """Bits a GGUF tensor type spends per weight, block scales included (Q4_K 4.5, Q5_0 5.5, Q8_0 8.5, F16 16)."""
    from gguf import GGML_QUANT_SIZES

    block, nbytes = GGML_QUANT_SIZES[tensor_type]
    return 8 * nbytes / block


def gguf_int8_tensors(reader: Any, cfg: ModelConfig, path: Path) -> dict[str, tuple[str, ...]]:
    """The layer matrices an int4 store of this GGUF keeps int8: file name -> keys.

    A matrix whose GGUF type spends more than :data:`GGUF_INT4_MAX_BITS` bits per weight
    (Q5_0, Q5_K, Q6_K, Q8_0, a float matrix among quantised ones) was given those bits by
    whoever quantised the file (llama.cpp's Q4_K_M keeps half the layers' ffn_down and
    attn_v at Q6_K/Q8_0, Gemma 3 270M its q/k/v/gate/up at Q5_0 too); int4 would drop them
    (Gemma 3 270M: +43 % Russian perplexity all-int4, about none with these int8). A 4-bit
    type (Q4_0, Q4_1, Q4_K, IQ4_*) or fewer is reproduced by int4 at group 32 almost
    exactly and stays int4. A file whose matrices are all float (F32/F16/BF16) shows no
    choice to keep: everything stays int4, as asked. Logs the counts per GGUF type.
    """
    from gguf import GGMLQuantizationType

    floats = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
    by_module, _ = _gguf_by_module(reader, path)  # the conversion warns about the ignored ones
    matrices = [
        (file_name(kind, index), key, by_module.get((kind, index), {}).get(key))
        for kind, index, shapes in module_plan(cfg)
        for key, shape in shapes.items()
        if is_quantized_key(kind, key, shape)
    ]
    types = [t.tensor_type for _, _, t in matrices if t is not None]
    keep = not all(t in floats for t in types)
    int8: dict[str, tuple[str, ...]] = {}
    chosen: dict[str, Counter[str]] = {"int4": Counter(), "int8": Counter()}
    for name, key, tensor in matrices:
        if tensor is None:
            continue  # missing: the conversion names it
        wide = keep and gguf_bits_per_weight(tensor.tensor_type) > GGUF_INT4_MAX_BITS
        if wide:
            int8[name] = (*int8.get(name, ()), key)
        chosen["int8" if wide else "int4"][tensor.tensor_type.name] += 1
    for dtype, counts in chosen.items():
        if counts:
            log.info(
                "%s: %d layer matrices %s (%s)",
                path.name,
                sum(counts.values()),
                dtype,
                ", ".join(f"{n} {t}" for t, n in counts.most_common()),
            )
    if chosen["int8"]:
        log.info(
            "%s: int8 where the file keeps more than %g bits per weight, which int4 would lose",
            path.name,
            GGUF_INT4_MAX_BITS,
        )
    elif not keep:
        log.info("%s: every layer matrix is float, no quantiser's choice to keep: all int4", path.name)
    return int8


def iter_gguf_modules(reader: Any, cfg: ModelConfig, path: Path) -> Iterator[tuple[ModuleKind, int, Params]]:
    """Dequantised float32 tensors grouped per store module, in forward order, one module at a time."""
    from gguf import dequantize

    arch = _field(reader, "general.architecture")
    family = gguf_config_class(arch)
    permuted = arch in family.gguf_permuted
    by_module, ignored = _gguf_by_module(reader, path)
    for name in ignored:
        log.warning("%s: ignoring tensor %s", path, name)

    def load(key: str, tensor: Any) -> np.ndarray:
        w = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        if not w.flags.writeable:  # an F32 tensor is a view of the read-only memory map
            w = w.copy()
        if family.gguf_norm_offset and key.endswith("norm.weight"):
            w = w - family.gguf_norm_offset
        if permuted and key == "self_attn.q_proj.weight":
            w = _unpermute(w, cfg.num_attention_heads)
        if permuted and key == "self_attn.k_proj.weight":
            w = _unpermute(w, cfg.num_key_value_heads)
        return w

    for kind, index, shapes in module_plan(cfg):
        found = by_module.get((kind, index), {})
        params: Params = {}
        for key, shape in shapes.items():
            if key not in found:
                raise ModelImportError(f"{path}: missing tensor for {kind} {index} {key!r}")
            w = torch.from_numpy(np.ascontiguousarray(load(key, found[key])))
            if tuple(w.shape) != shape:
                raise ModelImportError(f"{path}: {found[key].name} has shape {list(w.shape)}, expected {list(shape)}")
            params[key] = w
        yield kind, index, params


def _merges_from_vocab(tokens: list[str]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary listed best-first (transformers' ``generate_merges`` for Gemma files).

    Every token that splits into two tokens of the vocabulary yields those pairs; merges
    are ordered by the token's position in the file, then by the lengths of the halves.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[str, str, int]] = []
    for position, token in enumerate(tokens):
        local = [
            (token[:i], token[i:], -position) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def gguf_tokenizer(reader: Any, path: Path) -> tuple[Any, dict[str, Any]]:
    """``(tokenizers.Tokenizer, tokenizer_config dict)`` rebuilt from a Gemma GGUF's metadata.

    Mirrors transformers' GGUF integration (``gemma_tokenizer`` + ``GemmaTokenizer``): a
    byte-fallback BPE whose merges come from the vocabulary order, spaces normalised to
    ``▁``, control tokens (type 3) added as special tokens, user-defined ones (type 4) whole.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    model = _field(reader, "tokenizer.ggml.model")
    if model != "llama" or _field(reader, "general.architecture") != "gemma3":
        raise ModelImportError(
            f"{path}: rebuilding a {model!r} tokenizer from GGUF metadata is only done for Gemma 3; "
            "pass the model's tokenizer.json with --tokenizer"
        )
    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens")]
    types = list(_field(reader, "tokenizer.ggml.token_type", []))
    # A token of two or more spaces is stored with real spaces; the tokenizer looks it up as "▁▁".
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]

    def special(key: str) -> str | None:
        token_id = _field(reader, f"tokenizer.ggml.{key}")
        return None if token_id is None else tokens[int(token_id)]

    bos, eos, unk, pad = (
        special("bos_token_id"),
        special("eos_token_id"),
        special("unknown_token_id"),
        special("padding_token_id"),
    )
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(
        BPE(vocab=vocab, merges=_merges_from_vocab(tokens), fuse_unk=True, unk_token=unk or "<unk>", byte_fallback=True)
    )
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    named = [t for t in (unk, bos, eos, pad, "<mask>") if t is not None and t in vocab]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in named])
    control = [t for t, kind in zip(tokens, types, strict=False) if kind == 3]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, kind in zip(tokens, types, strict=False) if kind == 4]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    config = {
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": pad,
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", True)),
    }
    return tok, config


# --------------------------------------------------------------------------- Hugging Face folders


def hf_config(folder: Path) -> ModelConfig:
    """The family config of a Hugging Face model folder (``config.json``'s ``model_type``)."""
    path = folder / "config.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    model_type = data.get("model_type")
    family = hf_config_class(model_type)
    if family is None:
        known = ", ".join(t for cls in config_classes() for t in cls.hf_model_types)
        raise ModelImportError(f"{path}: model_type {model_type!r} is not supported ({known})")
    try:
        config: ModelConfig = family.from_hf(data)
        return config
    except (KeyError, ValueError) as exc:
        raise ModelImportError(f"{path}: {exc}") from exc


def hf_module_key(name: str) -> tuple[ModuleKind, int, str] | None:
    """Store module and key of a Hugging Face tensor name (None for tensors the text model does not use)."""
    for prefix in ("model.language_model.", "language_model.model.", "model."):
        if name.startswith(prefix):
            rest = name[len(prefix) :]
            if rest.startswith("layers."):
                _, index, key = rest.split(".", 2)
                return "layer", int(index), key
            if rest == "embed_tokens.weight":
                return "embedding", 0, rest
            if rest == "norm.weight":
                return "output", 0, rest
            return None
    if name in ("lm_head.weight", "language_model.lm_head.weight"):
        return "output", 0, "lm_head.weight"
    return None


def iter_hf_modules(folder: Path, cfg: ModelConfig) -> Iterator[tuple[ModuleKind, int, Params]]:
    """Tensors of the safetensors shards grouped per store module, read one tensor at a time."""
    from safetensors import safe_open

    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ModelImportError(f"{folder}: no *.safetensors files")
    where: dict[tuple[str, int, str], tuple[Path, str]] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                target = hf_module_key(name)
                if target is not None:
                    where[target] = (shard, name)
    for kind, index, shapes in module_plan(cfg):
        params: Params = {}
        for key, shape in shapes.items():
            if (kind, index, key) not in where:
                raise ModelImportError(f"{folder}: no tensor for {kind} {index} {key!r}")
            shard, name = where[(kind, index, key)]
            with safe_open(str(shard), framework="pt") as f:
                tensor = f.get_tensor(name)
            if tuple(tensor.shape) != shape:
                raise ModelImportError(f"{shard}: {name} has shape {list(tensor.shape)}, expected {list(shape)}")
            params[key] = tensor
        yield kind, index, params


# --------------------------------------------------------------------------- entry point


def import_model(
    source: str | Path,
    store_dir: str | Path,
    *,
    dtype: str = "fp16",
    group_size: int | None = None,
    tokenizer: str | Path | None = None,
    on_file: Callable[[StoreFile, int, int], None] | None = None,
    all_int4: bool = False,
) -> Manifest:
    """Convert a ``.gguf`` file or a Hugging Face folder into a store at ``store_dir`` (tokenizer beside it).

    ``tokenizer`` names a ``tokenizer.json`` to use instead of the source's own. ``group_size``
    (int4 only) defaults to :data:`~robot_llm.llm.store.quant.GGUF_INT4_GROUP` for a GGUF file and to
    :data:`~robot_llm.llm.store.quant.DEFAULT_INT4_GROUP` for a Hugging Face folder. An int4 store of
    a GGUF file keeps int8 the matrices the file holds at more than 4-bit types
    (:func:`gguf_int8_tensors`) unless ``all_int4`` (the smallest store, at a cost in quality).
    """
    if all_int4 and dtype != "int4":
        raise ModelImportError(f"all_int4 (--all-int4) applies to an int4 store, not {dtype}")
    source, store = Path(source), Path(store_dir)
    store.mkdir(parents=True, exist_ok=True)
    int8_tensors: dict[str, tuple[str, ...]] = {}
    if source.is_file() and source.suffix == ".gguf":
        from gguf import GGUFReader

        try:
            reader = GGUFReader(str(source))
        except (ValueError, OSError) as exc:
            raise ModelImportError(f"{source}: not a readable GGUF file ({exc})") from exc
        cfg = gguf_config(reader, source)
        if tokenizer is None:
            tok, tok_config = gguf_tokenizer(reader, source)
            tok.save(str(store / "tokenizer.json"))
            (store / TOKENIZER_CONFIG).write_text(json.dumps(tok_config, ensure_ascii=False, indent=1))
        modules = iter_gguf_modules(reader, cfg, source)
        default_group = GGUF_INT4_GROUP
        if dtype == "int4" and not all_int4:
            int8_tensors = gguf_int8_tensors(reader, cfg, source)
    elif source.is_dir() and (source / "config.json").is_file():
        cfg = hf_config(source)
        if tokenizer is None:
            if not (source / "tokenizer.json").is_file():
                raise ModelImportError(f"{source}: no tokenizer.json (pass one with --tokenizer)")
            tokenizer = source / "tokenizer.json"
        modules = iter_hf_modules(source, cfg)
        default_group = DEFAULT_INT4_GROUP
    else:
        raise ModelImportError(f"{source}: neither a .gguf file nor a Hugging Face folder with config.json")
    if tokenizer is not None:
        tokenizer = Path(tokenizer)
        shutil.copyfile(tokenizer, store / "tokenizer.json")
        if (tokenizer.parent / TOKENIZER_CONFIG).is_file():
            shutil.copyfile(tokenizer.parent / TOKENIZER_CONFIG, store / TOKENIZER_CONFIG)
    log.info("importing %s (%s, %d layers) into %s as %s", source, cfg.family, cfg.num_layers, store, dtype)
    group = group_size or default_group
    return convert_modules(
        cfg, modules, store, dtype=dtype, group_size=group, on_file=on_file, int8_tensors=int8_tensors
    )
