"""The YaLM family in one file: its config (:class:`YalmConfig`, the presets) and its forward pass
(docs/yalm-model.md §3-§4) as pure functions: the ``yalm`` :class:`Family`.

Weights are plain ``dict[str, Tensor]`` per module, keyed by the *release* key
names with the module prefix stripped (exactly the keys of one
``layer_NN-model_00-model_states.pt`` file, see :mod:`robot_llm.llm.store.checkpoint`
and :meth:`YalmConfig.layer_shapes`):

* embedding (file 00): ``word_embeddings.weight`` ``[V, E]``;
* projector (file 01): ``input_layernorm.weight/bias`` ``[E]``;
* transformer layer (files 03..L+2): ``attention.query_key_value.weight/bias``,
  ``attention.dense.weight/bias``, ``post_attention_layernorm.weight/bias``,
  ``mlp.dense_ffn_hidden.weight/bias``, ``mlp.dense_ffn_gate.weight/bias``,
  ``mlp.dense_ffn_output.weight/bias`` and, for every layer but the first,
  ``input_layernorm.weight/bias``;
* output layer (file L+4): ``input_layer_norm.weight/bias``, ``dense.weight/bias``,
  ``output_layer_norm.weight/bias``, ``output_bias``.

Every function computes in the dtype and on the device of the tensors it is
given. The step machinery (KV cache, masks, rotary factors, left padding) is
shared by all families: :mod:`robot_llm.llm.families.family`. :class:`Yalm` is the
in-memory model loaded from a release checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from robot_llm.llm.engine.kv_cache import LayerKV, attend_with
from robot_llm.llm.families.config import ModuleKind, Shapes
from robot_llm.llm.families.family import (
    Family,
    Params,
    Resident,
    StepInfo,
    apply_rotary,
    embedding,
    linear,
)

#: Score written over masked attention logits (masked_fill, as the original does).
MASK_VALUE = -10000.0


def rope(cfg: YalmConfig) -> dict[str, Tensor]:
    """Inverse frequencies exactly as the original computes them (§3.4.3): ``float32(1e-4) ** (2i / hn)``."""
    hn = cfg.head_dim
    return {"rope": torch.tensor(1e-4, dtype=torch.float32) ** (torch.arange(0, hn, 2, dtype=torch.float32) / hn)}


# --------------------------------------------------------------------------- the pieces


def _layer_norm(x: Tensor, params: Params, prefix: str, eps: float) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), params[f"{prefix}.weight"], params[f"{prefix}.bias"], eps)


def embed(ids: Tensor, resident: Resident, cfg: YalmConfig) -> Tensor:
    """Word embedding (§3.1) and projector (§3.2): ``ids [B, T]`` -> ``x [B, T, H]``.

    Computes in the dtype of ``word_embeddings.weight``; ``ids`` must be on its device.
    """
    e = embedding(ids, resident["embedding"]["word_embeddings.weight"])
    p = _layer_norm(e, resident["projector"], "input_layernorm", cfg.layernorm_epsilon)
    if cfg.embedding_size == cfg.hidden_size:
        return p
    return F.pad(p, (0, cfg.hidden_size - cfg.embedding_size))


def attention(a_in: Tensor, params: Params, cfg: YalmConfig, step: StepInfo, kv: LayerKV | None) -> Tensor:
    """Self-attention (§3.4) without the output bias: returns ``A`` of ``h = x + (A + b_o)``."""
    B, T, H = a_in.shape
    n, hn = cfg.num_attention_heads, cfg.head_dim
    c = linear(a_in, params["attention.query_key_value.weight"], params["attention.query_key_value.bias"])
    # Fused layout is per-head interleaved [n, 3, hn] (§3.4.2).
    q, k, v = c.view(B, T, n, 3, hn).unbind(dim=3)
    q = apply_rotary(step.kept(q), *step.query_rotary("rope"))
    k = apply_rotary(k, *step.rotary["rope"])
    mask = step.mask_for(None)
    if kv is not None:
        k, v = kv.update(k, v)
        q, mask = attend_with(q, mask, k)
    S, T = k.shape[1], q.shape[1]
    q = q.transpose(1, 2).reshape(B * n, T, hn)
    k = k.permute(0, 2, 3, 1).reshape(B * n, hn, S)
    v = v.transpose(1, 2).reshape(B * n, S, hn)
    # Scale applied as the GEMM's alpha, like the original (matters for fp16 rounding).
    scores = torch.baddbmm(
        torch.empty(B * n, T, S, dtype=q.dtype, device=q.device), q, k, beta=0.0, alpha=1.0 / math.sqrt(hn)
    ).view(B, n, T, S)
    scores = scores.masked_fill(mask, MASK_VALUE)
    probs = torch.softmax(scores, dim=-1)
    o = torch.bmm(probs.view(B * n, T, S), v).view(B, n, T, hn).transpose(1, 2).reshape(B, T, H)
    o = o.to(a_in.device, a_in.dtype)
    return linear(o, params["attention.dense.weight"])


def geglu_mlp(m_in: Tensor, params: Params) -> Tensor:
    """GeGLU MLP (§3.5) without the output bias: returns ``M`` of ``x' = h + (M + b_out)``."""
    u = linear(m_in, params["mlp.dense_ffn_hidden.weight"])
    r = F.gelu(u + params["mlp.dense_ffn_hidden.bias"])
    g = linear(m_in, params["mlp.dense_ffn_gate.weight"], params["mlp.dense_ffn_gate.bias"])
    return linear(r * g, params["mlp.dense_ffn_output.weight"])


def transformer_layer(
    x: Tensor,
    params: Params,
    cfg: YalmConfig,
    layer_index: int,
    step: StepInfo,
    kv: LayerKV | None = None,
) -> Tensor:
    """One pre-LN transformer layer (§3.3); ``layer_index`` is 0-based (file ``layer_{index+3:02d}``).

    Layer 0 has no input LayerNorm. With ``kv`` the step's keys/values are
    written into the cache slots ``kv.start ..`` and all filled slots are attended.
    """
    eps = cfg.layernorm_epsilon
    a_in = x if layer_index == 0 else _layer_norm(x, params, "input_layernorm", eps)
    h = step.kept(x) + (attention(a_in, params, cfg, step, kv) + params["attention.dense.bias"])
    m_in = _layer_norm(h, params, "post_attention_layernorm", eps)
    return h + (geglu_mlp(m_in, params) + params["mlp.dense_ffn_output.bias"])


def output_head(x: Tensor, resident: Resident, cfg: YalmConfig) -> Tensor:
    """Output layer and tied LM head (§3.6): ``x [B, T, H]`` -> logits ``[B, T, V]`` in x's dtype."""
    eps = cfg.layernorm_epsilon
    out_params, word_embeddings = resident["output"], resident["embedding"]["word_embeddings.weight"]
    y = _layer_norm(x, out_params, "input_layer_norm", eps)
    z = F.linear(y, out_params["dense.weight"]) + out_params["dense.bias"]
    z = _layer_norm(F.gelu(z), out_params, "output_layer_norm", eps)
    return linear(z, word_embeddings, out_params["output_bias"])


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class YalmConfig:
    """Shape of a YaLM model.

    Only the quantities that vary between checkpoints are fields; everything
    the released launch scripts fix (GeGLU, rotary, pre-LN, no query-key layer
    scaling) is built into :mod:`robot_llm.llm.families.yalm`.
    """

    num_layers: int
    hidden_size: int
    embedding_size: int
    intermediate_size: int
    num_attention_heads: int
    max_position_embeddings: int
    vocab_size: int
    layernorm_epsilon: float = 1e-5

    family: ClassVar[str] = "yalm"
    #: YaLM-100B was released and computes in fp16 (the original inference is fp16 throughout).
    gpu_dtypes: ClassVar[tuple[str, str]] = ("fp16", "fp16")
    kv_read_as_stored: ClassVar[bool] = False
    #: A YaLM release is its own layout (:mod:`robot_llm.llm.store.checkpoint`), never a GGUF or HF folder.
    gguf_architectures: ClassVar[tuple[str, ...]] = ()
    hf_model_types: ClassVar[tuple[str, ...]] = ()
    gguf_norms: ClassVar[dict[str, str]] = {}
    gguf_norm_offset: ClassVar[float] = 0.0
    gguf_permuted: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "embedding_size",
            "intermediate_size",
            "num_attention_heads",
            "max_position_embeddings",
            "vocab_size",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"YalmConfig.{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"rotary needs an even head dim, got {self.head_dim}")
        if self.embedding_size > self.hidden_size:
            raise ValueError(
                f"embedding_size {self.embedding_size} exceeds hidden_size {self.hidden_size}: "
                "the projector only zero-pads E up to H"
            )

    @property
    def head_dim(self) -> int:
        """Per-head dimension ``hn = H / n``."""
        return self.hidden_size // self.num_attention_heads

    @property
    def num_key_value_heads(self) -> int:
        """YaLM has one key/value head per query head."""
        return self.num_attention_heads

    def sliding_window(self, layer_index: int) -> int | None:
        """Every YaLM layer attends to the whole sequence."""
        del layer_index
        return None

    def layer_shapes(self, layer_index: int) -> Shapes:
        """Release keys and shapes of transformer layer ``layer_index`` (docs/yalm-model.md §5.3)."""
        H, intermediate = self.hidden_size, self.intermediate_size
        shapes: Shapes = {}
        if layer_index > 0:  # the first layer has no input LayerNorm (§9.1)
            shapes["input_layernorm.weight"] = (H,)
            shapes["input_layernorm.bias"] = (H,)
        shapes.update(
            {
                "attention.query_key_value.weight": (3 * H, H),
                "attention.query_key_value.bias": (3 * H,),
                "attention.dense.weight": (H, H),
                "attention.dense.bias": (H,),
                "post_attention_layernorm.weight": (H,),
                "post_attention_layernorm.bias": (H,),
                "mlp.dense_ffn_hidden.weight": (intermediate, H),
                "mlp.dense_ffn_hidden.bias": (intermediate,),
                "mlp.dense_ffn_gate.weight": (intermediate, H),
                "mlp.dense_ffn_gate.bias": (intermediate,),
                "mlp.dense_ffn_output.weight": (H, intermediate),
                "mlp.dense_ffn_output.bias": (H,),
            }
        )
        return shapes

    def resident_shapes(self) -> dict[ModuleKind, Shapes]:
        """Release keys and shapes of the embedding, projector and output layer (§5.3)."""
        H, E, V = self.hidden_size, self.embedding_size, self.vocab_size
        return {
            "embedding": {"word_embeddings.weight": (V, E)},
            "projector": {"input_layernorm.weight": (E,), "input_layernorm.bias": (E,)},
            "output": {
                "input_layer_norm.weight": (H,),
                "input_layer_norm.bias": (H,),
                "dense.weight": (E, H),
                "dense.bias": (E,),
                "output_layer_norm.weight": (E,),
                "output_layer_norm.bias": (E,),
                "output_bias": (V,),
            },
        }

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON serialisable)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> YalmConfig:
        """Build from a dict; keys that are not fields (fixture extras) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in data and f.default is dataclasses.MISSING]
        if missing:
            raise ValueError(f"model config lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_json(cls, path: str | Path) -> YalmConfig:
        """Read a fixture-style ``config.json`` (extra keys such as ``weight_files`` are ignored).

        Refuses a config that asks for a variant this implementation does not
        compute (an activation other than geglu, a position encoding other
        than rotary, query-key layer scaling or post-LN residuals).
        """
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        expected = {
            "activation": "geglu",
            "pos_encoding": "rotary",
            "apply_residual_connection_post_layernorm": False,
        }
        for key, value in expected.items():
            if key in data and data[key] != value:
                raise ValueError(f"{path}: {key}={data[key]!r} is not supported (only {value!r})")
        return cls.from_dict(data)

    @classmethod
    def preset(cls, name: str) -> YalmConfig:
        """Return the named preset (see :data:`PRESETS`)."""
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None


PRESETS: dict[str, YalmConfig] = {
    # The released model (docs/yalm-model.md §1).
    "yalm-100b": YalmConfig(
        num_layers=80,
        hidden_size=10240,
        embedding_size=2048,
        intermediate_size=27308,
        num_attention_heads=128,
        max_position_embeddings=1024,
        vocab_size=128000,
    ),
    # The shared fixture (shared/fixtures/yalm-tiny/config.json).
    "yalm-tiny": YalmConfig(
        num_layers=2,
        hidden_size=64,
        embedding_size=32,
        intermediate_size=172,
        num_attention_heads=4,
        max_position_embeddings=64,
        vocab_size=600,
    ),
    # Small shapes for tests and CPU benchmarks; same E/H ratio and head dim as the release.
    "yalm-small": YalmConfig(
        num_layers=4,
        hidden_size=640,
        embedding_size=128,
        intermediate_size=1708,
        num_attention_heads=8,
        max_position_embeddings=256,
        vocab_size=600,
    ),
    # A mid-size model (~1.3 G parameters) for offload-engine benchmarks.
    "yalm-mid": YalmConfig(
        num_layers=8,
        hidden_size=3840,
        embedding_size=768,
        intermediate_size=10240,
        num_attention_heads=48,
        max_position_embeddings=1024,
        vocab_size=32000,
    ),
}


#: The registry's handle on this family's config (:mod:`robot_llm.llm.families.registry`).
CONFIG = YalmConfig
FAMILY = Family(name="yalm", rope=rope, embed=embed, layer=transformer_layer, head=output_head)
