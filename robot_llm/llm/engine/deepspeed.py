"""The ``deepspeed`` backend: YaLM under DeepSpeed ZeRO stage 3 with parameter offload (ZeRO-Inference).

The model is an ``nn.Module`` whose submodules (embedding+projector, one per
transformer layer, output layer) own their release tensors *directly*, so
ZeRO-3's per-module hooks gather exactly one layer before it runs and release
it after; the math is :mod:`robot_llm.llm.families.yalm`'s. Parameters are offloaded to
CPU RAM or to NVMe swap files (``offload = "cpu" | "nvme"``).

Single process: if no process group exists, one is created with world size 1
(RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT are filled in when unset),
over gloo on a CPU-only machine. Under the ``deepspeed`` launcher or torchrun
(world size > 1) the same code partitions the parameters across ranks; every
rank must then make the same forward calls.

DeepSpeed 0.19.8 on CPU (docs: shared/docs/deepspeed-on-cpu.md): the model is
built under ``deepspeed.zero.Init`` so its dtype comes from the config (passing
an fp32 model straight to ``initialize`` gives bf16 swap buffers); fp16 is not
available on CPU (use fp32 or bf16); ``memory_efficient_linear`` is off so
ZeRO does not replace ``F.linear`` for the rest of the process; only tensors of
1 MiB or more are swapped to NVMe.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch import Tensor, nn

from robot_llm.errors import BackendError
from robot_llm.llm.engine.finite import FiniteWatch
from robot_llm.llm.engine.kv_cache import KVCache, LayerKV
from robot_llm.llm.families.family import Params, StepInfo, forward_pass, prepare_step, resolve_dtype
from robot_llm.llm.families.yalm import YalmConfig, embed, output_head, rope, transformer_layer
from robot_llm.llm.store.checkpoint import ModuleKind, iter_release_modules, module_plan
from robot_llm.llm.store.reader import MANIFEST, QUANTIZED, Store

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- DeepSpeed's C++ ops
# Compiled on first use when the install did not prebuild them (``scripts/install.sh --deepspeed-ops``
# does): :func:`prepare_ops` loads them up front, so a night that starts with a compile says so and how
# long it took; torch caches the result, once per machine.


def _cached(name: str) -> bool:
    """Whether torch's extension cache already holds a JIT build of op ``name``."""
    from torch.utils.cpp_extension import _get_build_directory

    return (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").is_file()


def needed_builders(offload: Literal["cpu", "nvme"]) -> list[Any]:
    """The op builders a run with ``offload`` loads: shared-memory comm, and async I/O for NVMe."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    names = ["ShareMemCommBuilder"] + (["AsyncIOBuilder"] if offload == "nvme" else [])
    return [b for b in (accel.create_op_builder(n) for n in names) if b is not None]


#: One entry of TORCH_CUDA_ARCH_LIST with an architecture-specific suffix: ``9.0a``, ``10.0f+PTX``.
_SUFFIXED_ARCH = re.compile(r"(\d+\.\d+)[a-z]+(\+PTX)?")


def deepspeed_arch_list(arch_list: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed 0.19.8's JIT builder can read it: each entry's suffix dropped
    (``9.0a;10.0f+PTX`` -> ``9.0;10.0+PTX``), other entries kept, ``;``-separated. That builder parses every
    part of every entry as an integer and fails on ``9.0a``, which CUDA images for Hopper set (seen on an H200,
    CUDA 13). The ops it builds here (async I/O, shared-memory comm) run no arch-specific GPU code."""
    entries = arch_list.replace(" ", ";").split(";")
    return ";".join(_SUFFIXED_ARCH.sub(r"\1\2", e.strip()) for e in entries if e.strip())


def prepare_ops(offload: Literal["cpu", "nvme"]) -> None:
    """Load (compiling if need be) the ops this run needs, logging a compile and its duration."""
    import deepspeed.ops
    from deepspeed.git_version_info import installed_ops

    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch_list and deepspeed_arch_list(arch_list) != arch_list:
        # For the whole process: DeepSpeed loads the same ops again, reading this list each time.
        os.environ["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(arch_list)
        log.info(
            "TORCH_CUDA_ARCH_LIST %r read as %r for DeepSpeed's ops", arch_list, os.environ["TORCH_CUDA_ARCH_LIST"]
        )
    for builder in needed_builders(offload):
        name = builder.NAME
        if installed_ops.get(name) or not deepspeed.ops.__compatible_ops__.get(name, False):
            continue  # prebuilt, or not buildable here (DeepSpeed then goes without it and says why)
        if _cached(name):
            builder.load(verbose=False)
            continue
        log.warning(
            "DeepSpeed's %s op was not compiled at install time: compiling it now, once "
            "(several minutes on 2 cores; `scripts/install.sh --deepspeed-ops` does it at install)",
            name,
        )
        started = time.monotonic()
        builder.load(verbose=False)
        log.warning("compiled DeepSpeed's %s op in %.0f s (cached for the next runs)", name, time.monotonic() - started)


Offload = Literal["cpu", "nvme"]


class _Module(nn.Module):
    """Holds one release module's tensors as its own parameters (ZeRO-3 gathers a module's direct params)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> None:
        super().__init__()
        self.keys = list(shapes)
        for key, shape in shapes.items():
            self.register_parameter(_attr(key), nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))

    def params(self) -> Params:
        """The tensors keyed by release names."""
        return {key: getattr(self, _attr(key)) for key in self.keys}


def _attr(key: str) -> str:
    return key.replace(".", "__")


class _Embedding(_Module):
    def __init__(self, cfg: YalmConfig, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> None:
        super().__init__(
            {f"embedding.{k}": s for k, s in shapes["embedding"].items()}
            | {f"projector.{k}": s for k, s in shapes["projector"].items()},
            dtype,
        )
        self.cfg = cfg

    def forward(self, ids: Tensor) -> Tensor:
        p = self.params()
        emb = {"word_embeddings.weight": p["embedding.word_embeddings.weight"]}
        proj = {k.removeprefix("projector."): t for k, t in p.items() if k.startswith("projector.")}
        return embed(ids, {"embedding": emb, "projector": proj}, self.cfg)


class _Layer(_Module):
    def __init__(self, cfg: YalmConfig, index: int, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> None:
        super().__init__(shapes, dtype)
        self.cfg, self.index = cfg, index

    def forward(self, x: Tensor, step: StepInfo, kv: LayerKV | None) -> Tensor:
        return transformer_layer(x, self.params(), self.cfg, self.index, step, kv)


class _Head(_Module):
    def __init__(self, cfg: YalmConfig, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, tied: Tensor) -> None:
        super().__init__(shapes, dtype)
        self.cfg = cfg
        self.tied = [tied]  # a list keeps the shared weight out of this module's own parameters

    def forward(self, x: Tensor) -> Tensor:
        return output_head(
            x, {"output": self.params(), "embedding": {"word_embeddings.weight": self.tied[0]}}, self.cfg
        )


class YalmZero(nn.Module):
    """The whole model as modules for ZeRO-3; ``forward`` is one step (see ``ForwardModel.forward``).

    The step calls each module (ZeRO's hooks gather its parameters before it runs, release them after)
    from :func:`~robot_llm.llm.families.family.forward_pass`, the loop every engine runs.
    """

    def __init__(self, cfg: YalmConfig, dtype: torch.dtype) -> None:
        super().__init__()
        plan = module_plan(cfg)
        shapes = {kind: s for kind, _, _, s in plan if kind != "layer"}
        self.cfg = cfg
        self.embedding = _Embedding(cfg, shapes, dtype)
        self.layers = nn.ModuleList(_Layer(cfg, i, s, dtype) for kind, i, _, s in plan if kind == "layer")
        self.head = _Head(
            cfg, shapes["output"], dtype, self.embedding.get_parameter(_attr("embedding.word_embeddings.weight"))
        )

    def forward(
        self,
        ids: Tensor,
        step: StepInfo,
        cache: KVCache | None,
        last_only: bool,
        select: Tensor | None,
        watch: FiniteWatch,
    ) -> Tensor:
        layers = ((f"layer {i}", layer) for i, layer in enumerate(self.layers))
        return forward_pass(
            ids,
            step,
            cache,
            embed=self.embedding,
            layers=layers,
            head=self.head,
            watch=watch,
            last_only=last_only,
            select=select,
            num_layers=len(self.layers),
        )[0]

    def target(self, kind: ModuleKind, index: int) -> tuple[_Module, str]:
        """The module holding release module ``(kind, index)`` and the key prefix used there."""
        if kind == "layer":
            return self.layers[index], ""
        if kind == "output":
            return self.head, ""
        return self.embedding, f"{kind}."


def ds_config(
    cfg: YalmConfig, *, offload: Offload, dtype: torch.dtype, nvme_path: Path | None, pin_memory: bool
) -> dict[str, Any]:
    """ZeRO-Inference config sized from the model (DeepSpeedExamples zero_inference recipe)."""
    h = cfg.hidden_size
    layer_numel = 4 * h * h + 3 * h * cfg.intermediate_size
    largest = max(3 * h * h, cfg.intermediate_size * h, cfg.vocab_size * cfg.embedding_size)
    offload_param: dict[str, Any] = {"device": offload, "pin_memory": pin_memory}
    if offload == "nvme":
        # Every swapped tensor needs its own staging buffer while its module runs: the five
        # matrices of the running layer, five more for the prefetched one, and the embedding.
        offload_param |= {"nvme_path": str(nvme_path), "buffer_count": 11, "buffer_size": largest}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "zero_optimization": {
            "stage": 3,
            "memory_efficient_linear": False,
            "stage3_prefetch_bucket_size": layer_numel,
            "stage3_param_persistence_threshold": h,
            "stage3_max_live_parameters": 2 * layer_numel,
            "offload_param": offload_param,
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "single_submit": False, "overlap_events": True},
    }


def init_distributed() -> None:
    """Create the process group once; a lone process becomes rank 0 of world size 1."""
    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for key, value in {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }.items():
            os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    # A process that exits with the group alive aborts (SIGABRT, "terminate called without an
    # active exception") when gloo's worker threads free tensors after the interpreter is gone.
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _modules(checkpoint: Path, cfg: YalmConfig, trust_pickle: bool) -> Iterator[tuple[ModuleKind, int, Params]]:
    """Release modules in order, from a release folder or a float weight store."""
    if not (checkpoint / MANIFEST).is_file():
        yield from iter_release_modules(checkpoint, cfg, trust_pickle=trust_pickle)
        return
    store = Store(checkpoint)
    if store.manifest.dtype in QUANTIZED:
        raise BackendError(
            f"{checkpoint}: the deepspeed engine needs a float store, this one is {store.manifest.dtype}"
        )
    for kind, index, _, _ in module_plan(cfg):
        yield kind, index, store.load(kind, index)


class DeepSpeedModel:
    """YaLM under ZeRO-3 offload; implements :class:`robot_llm.llm.families.yalm.ForwardModel`."""

    def __init__(
        self,
        checkpoint: str | Path,
        cfg: YalmConfig,
        *,
        offload: Offload = "cpu",
        dtype: str | torch.dtype = "fp32",
        offload_dir: str | Path | None = None,
        trust_pickle: bool = False,
    ) -> None:
        if offload not in ("cpu", "nvme"):
            raise BackendError(f"offload must be 'cpu' or 'nvme', got {offload!r}")
        self.config = cfg
        self.dtype = resolve_dtype(dtype)
        accel = get_accelerator()
        if self.dtype == torch.float16 and not accel.is_fp16_supported():
            raise BackendError(f"fp16 is not supported by DeepSpeed on {accel.device_name()}; use fp32 or bf16")
        prepare_ops(offload)
        init_distributed()
        self.device = torch.device(accel.current_device_name())
        self._owned_dir = None
        nvme_path = None
        if offload == "nvme":
            if offload_dir is None:
                offload_dir = self._owned_dir = tempfile.mkdtemp(prefix="robot-llm-zero-")
            nvme_path = Path(offload_dir)
            nvme_path.mkdir(parents=True, exist_ok=True)
        self.nvme_path = nvme_path
        self.ds_config = ds_config(
            cfg, offload=offload, dtype=self.dtype, nvme_path=nvme_path, pin_memory=self.device.type == "cuda"
        )
        self.rope = rope(cfg)
        self.watch = FiniteWatch()
        with deepspeed.zero.Init(config_dict_or_path=self.ds_config):
            module = YalmZero(cfg, self.dtype)
        self._load(module, Path(checkpoint), trust_pickle)
        deepspeed.zero.register_external_parameter(module.head, module.head.tied[0])
        self.engine = deepspeed.initialize(model=module, config=self.ds_config)[0]
        self.engine.module.eval()
        if offload == "nvme":
            log.info("ZeRO-3 NVMe offload: %d swap files in %s", len(self.swap_files()), nvme_path)

    def _load(self, module: YalmZero, checkpoint: Path, trust_pickle: bool) -> None:
        """Copy the weights module by module; rank 0 reads, ZeRO re-partitions (and swaps out) each one."""
        rank0 = dist.get_rank() == 0
        for kind, index, params in _modules(checkpoint, self.config, trust_pickle):
            target, prefix = module.target(kind, index)
            own = [getattr(target, _attr(prefix + key)) for key in params]
            with deepspeed.zero.GatheredParameters(own, modifier_rank=0), torch.no_grad():
                if rank0:
                    for key, tensor in params.items():
                        getattr(target, _attr(prefix + key)).data.copy_(tensor)

    def swap_files(self) -> list[Path]:
        """NVMe swap files written by ZeRO (empty for CPU offload)."""
        if self.nvme_path is None:
            return []
        return sorted(self.nvme_path.glob("zero_stage_3/*/rank*/*.swp"))

    def new_cache(self, batch: int, max_len: int, pad: Tensor | None = None) -> KVCache:
        """An empty cache on the compute device."""
        return KVCache.allocate(self.config, batch, max_len, dtype=self.dtype, device=self.device, pad=pad)

    @torch.no_grad()
    def forward(
        self,
        ids: Tensor,
        cache: KVCache | None = None,
        pad: Tensor | None = None,
        *,
        last_only: bool = False,
        select: Tensor | None = None,
    ) -> Tensor:
        """See :meth:`robot_llm.llm.families.yalm.ForwardModel.forward`."""
        B, T = ids.shape
        step = prepare_step(self.config, self.rope, cache, T, pad, self.device, self.dtype, batch=B)
        return self.engine.module(ids.to(self.device), step, cache, last_only, select, self.watch)

    __call__ = forward

    def first_nonfinite(self) -> str:
        """Where the last pass first went non-finite (:func:`robot_llm.llm.engine.finite.check_logits` asks)."""
        return self.watch.first_bad() or "the output head"

    def close(self) -> None:
        """Release DeepSpeed's state and any swap folder this model created."""
        self.engine.destroy()
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)
