"""Configs of the Hugging Face model families: the Llama family and Gemma 3.

Field names follow the families' ``config.json`` where they can; weight keys
are the Hugging Face names with the ``model.`` / ``model.layers.N.`` prefix
stripped, so a safetensors checkpoint maps onto the store one tensor at a time.
Pure Python (no torch), like :mod:`robot_llm.llm.families.config`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from robot_llm.llm.families.config import ModuleKind, Shapes

SLIDING = "sliding_attention"
FULL = "full_attention"


def _from_dict(cls: Any, data: dict[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in data and f.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{cls.family} config lacks {', '.join(missing)}")
    return cls(**{k: v for k, v in data.items() if k in names})


def _rope(hf: dict[str, Any], layer_type: str | None = None) -> tuple[float | None, dict[str, Any] | None]:
    """``(rope_theta, scaling dict or None)`` from a ``config.json`` of either generation: transformers 4
    writes ``rope_theta`` and ``rope_scaling``, transformers 5 one ``rope_parameters`` dict (per layer type
    for Gemma 3)."""
    params = hf.get("rope_parameters")
    if params is not None:
        params = params.get(layer_type, {}) if layer_type else params
        scaling = None if params.get("rope_type", "default") == "default" else params
        return params.get("rope_theta"), scaling
    return hf.get("rope_theta"), hf.get("rope_scaling")


def _check_positive(cfg: Any, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(cfg, name) <= 0:
            raise ValueError(f"{type(cfg).__name__}.{name} must be positive, got {getattr(cfg, name)}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads {cfg.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {cfg.num_key_value_heads}"
        )
    if cfg.head_dim % 2:
        raise ValueError(f"rotary needs an even head dim, got {cfg.head_dim}")


def _decoder_shapes(cfg: Any) -> Shapes:
    """The weights every Hugging Face decoder layer here has: two norms, q/k/v/o, a gated MLP."""
    H, n, kv, d, inter = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    )
    return {
        "input_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (n * d, H),
        "self_attn.k_proj.weight": (kv * d, H),
        "self_attn.v_proj.weight": (kv * d, H),
        "self_attn.o_proj.weight": (H, n * d),
        "post_attention_layernorm.weight": (H,),
        "mlp.gate_proj.weight": (inter, H),
        "mlp.up_proj.weight": (inter, H),
        "mlp.down_proj.weight": (H, inter),
    }


_SIZES = (
    "num_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "vocab_size",
)


@dataclass(frozen=True)
class LlamaConfig:
    """Llama 2/3.x, Mistral and Qwen 2/2.5/3: pre-RMSNorm decoder, SwiGLU MLP, grouped-query attention.

    ``qkv_bias`` (Qwen 2) adds biases to the q/k/v projections; ``o_bias`` to the
    output projection (Llama's ``attention_bias`` sets both); ``qk_norm`` (Qwen 3)
    RMS-normalises each query and key head before the rotary; ``rope_scaling`` is
    the ``config.json`` dict (``llama3`` and ``linear`` are computed);
    ``sliding_window_size`` (Mistral) limits every layer's attention span.
    """

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_window_size: int | None = None

    family: ClassVar[str] = "llama"
    #: Llama was trained in bf16; fp16 where the GPU lacks it.
    gpu_dtypes: ClassVar[tuple[str, str]] = ("bf16", "fp16")
    gguf_architectures: ClassVar[tuple[str, ...]] = ("llama", "mistral", "qwen2", "qwen3")
    hf_model_types: ClassVar[tuple[str, ...]] = ("llama", "mistral", "qwen2", "qwen3")
    #: One norm before the MLP.
    gguf_norms: ClassVar[dict[str, str]] = {"ffn_norm.weight": "post_attention_layernorm.weight"}
    gguf_norm_offset: ClassVar[float] = 0.0
    #: llama.cpp's converter permutes these architectures' q/k rows for its interleaved rotary.
    gguf_permuted: ClassVar[tuple[str, ...]] = ("llama", "mistral")

    def __post_init__(self) -> None:
        _check_positive(self, _SIZES)
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if kind not in ("default", "llama3", "linear"):
            raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")

    def sliding_window(self, layer_index: int) -> int | None:
        """Mistral-style models attend to the last ``sliding_window_size`` positions in every layer."""
        del layer_index
        return self.sliding_window_size

    def layer_shapes(self, layer_index: int) -> Shapes:
        """Hugging Face keys of ``model.layers.N`` and their shapes."""
        del layer_index
        shapes = _decoder_shapes(self)
        n, kv, d = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        if self.qkv_bias:
            shapes |= {"self_attn.q_proj.bias": (n * d,), "self_attn.k_proj.bias": (kv * d,)}
            shapes["self_attn.v_proj.bias"] = (kv * d,)
        if self.qk_norm:
            shapes |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
        if self.o_bias:
            shapes["self_attn.o_proj.bias"] = (self.hidden_size,)
        return shapes

    def resident_shapes(self) -> dict[ModuleKind, Shapes]:
        """The token embedding; the final norm and, unless tied to the embedding, the LM head."""
        output: Shapes = {"norm.weight": (self.hidden_size,)}
        if not self.tie_word_embeddings:
            output["lm_head.weight"] = (self.vocab_size, self.hidden_size)
        return {"embedding": {"embed_tokens.weight": (self.vocab_size, self.hidden_size)}, "output": output}

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON serialisable)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LlamaConfig:
        """Build from :meth:`to_dict` output."""
        config: LlamaConfig = _from_dict(cls, data)
        return config

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        """From a Hugging Face ``config.json`` of a Llama, Mistral, Qwen2 or Qwen3 model."""
        model_type = hf.get("model_type", "llama")
        n = hf["num_attention_heads"]
        theta, scaling = _rope(hf)
        window = hf.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
            window = None
        return cls(
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_attention_heads=n,
            num_key_value_heads=hf.get("num_key_value_heads") or n,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n,
            max_position_embeddings=hf["max_position_embeddings"],
            vocab_size=hf["vocab_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=theta or 10000.0,
            rope_scaling=scaling,
            qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(hf.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window_size=window,
        )


@dataclass(frozen=True)
class Gemma3Config:
    """Gemma 3 (text): RMSNorm with ``(1 + weight)``, four norms per layer, QK-norm, GeGLU (tanh GELU),
    embeddings scaled by ``sqrt(hidden)``, local sliding-window and global layers with their own rotary bases.

    ``layer_types[i]`` is ``"sliding_attention"`` or ``"full_attention"``;
    ``rope_scaling_factor`` is the linear scaling of the global layers' rotary.
    """

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    vocab_size: int
    layer_types: tuple[str, ...]
    sliding_window_size: int = 512
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rope_scaling_factor: float = 1.0
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None

    family: ClassVar[str] = "gemma3"
    #: Gemma 3's activations exceed fp16's range (65504): bf16, else fp32, never fp16.
    gpu_dtypes: ClassVar[tuple[str, str]] = ("bf16", "fp32")
    gguf_architectures: ClassVar[tuple[str, ...]] = ("gemma3",)
    hf_model_types: ClassVar[tuple[str, ...]] = ("gemma3_text", "gemma3")
    #: A norm after attention, one before and one after the MLP.
    gguf_norms: ClassVar[dict[str, str]] = {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    }
    #: llama.cpp stores Gemma's RMSNorm gain as 1 + weight.
    gguf_norm_offset: ClassVar[float] = 1.0
    gguf_permuted: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        _check_positive(self, _SIZES)
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must name {self.num_layers} layers as {SLIDING!r} or {FULL!r}")

    def sliding_window(self, layer_index: int) -> int | None:
        """Local layers see the last ``sliding_window_size`` positions, global layers everything."""
        return self.sliding_window_size if self.layer_types[layer_index] == SLIDING else None

    def layer_shapes(self, layer_index: int) -> Shapes:
        """Hugging Face keys of ``model.layers.N`` and their shapes (Llama's plus QK-norm and two MLP norms)."""
        del layer_index
        d, H = self.head_dim, self.hidden_size
        return _decoder_shapes(self) | {
            "self_attn.q_norm.weight": (d,),
            "self_attn.k_norm.weight": (d,),
            "pre_feedforward_layernorm.weight": (H,),
            "post_feedforward_layernorm.weight": (H,),
        }

    def resident_shapes(self) -> dict[ModuleKind, Shapes]:
        """The token embedding (also the LM head) and the final norm."""
        return {
            "embedding": {"embed_tokens.weight": (self.vocab_size, self.hidden_size)},
            "output": {"norm.weight": (self.hidden_size,)},
        }

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON serialisable)."""
        data = dataclasses.asdict(self)
        data["layer_types"] = list(self.layer_types)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Gemma3Config:
        """Build from :meth:`to_dict` output."""
        config: Gemma3Config = _from_dict(cls, data)
        return config

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Gemma3Config:
        """From a Hugging Face ``config.json`` of a Gemma 3 text model (``text_config`` of a multimodal one)."""
        hf = hf.get("text_config", hf)
        layers = hf["num_hidden_layers"]
        pattern = hf.get("sliding_window_pattern", 6)
        types = hf.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
        theta, scaling = _rope(hf, FULL)
        local_theta, _ = _rope(hf, SLIDING)
        if (scaling or {}).get("rope_type", (scaling or {}).get("type", "linear")) != "linear":
            raise ValueError(f"Gemma 3 rope scaling {scaling} is not supported (only linear)")
        return cls(
            num_layers=layers,
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf["num_key_value_heads"],
            head_dim=hf["head_dim"],
            max_position_embeddings=hf["max_position_embeddings"],
            vocab_size=hf["vocab_size"],
            layer_types=tuple(types),
            sliding_window_size=hf.get("sliding_window", 512),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta or 1_000_000.0,
            rope_local_base_freq=local_theta or hf.get("rope_local_base_freq", 10_000.0),
            rope_scaling_factor=float((scaling or {}).get("factor", 1.0)),
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            attn_logit_softcapping=hf.get("attn_logit_softcapping"),
        )


#: Llama 3.1's rotary scaling (its config.json's rope_scaling).
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

#: Named Hugging Face family configs (for the planner; a converted store carries its own config).
HF_PRESETS: dict[str, LlamaConfig | Gemma3Config] = {
    "llama-3.1-70b": LlamaConfig(
        num_layers=80,
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        vocab_size=128256,
        rope_theta=500000.0,
        rope_scaling=LLAMA31_ROPE,
    ),
    "gemma-3-270m": Gemma3Config(
        num_layers=18,
        hidden_size=640,
        intermediate_size=2048,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        max_position_embeddings=32768,
        vocab_size=262144,
        layer_types=tuple(SLIDING if (i + 1) % 6 else FULL for i in range(18)),
    ),
}
