"""Reader (and writer) of the YaLM release checkpoint layout (docs/yalm-model.md §5).

A release folder holds ``layer_NN-model_00-model_states.pt`` files, each a flat
``{key: tensor}`` dict: ``00`` word embedding, ``01`` projector, ``03 .. L+2``
transformer layers 0 .. L-1, ``L+4`` output layer. Other files are ignored.

Every file is opened with ``torch.load(weights_only=True, mmap=True)`` so that
reading one module touches only that module's bytes. Missing files, unreadable
files, missing keys and shapes that disagree with the config raise
:class:`CheckpointError` naming the file and key; keys the model does not use
only raise a :class:`CheckpointWarning` (the original loader skipped them, and
the real release may contain some, §5.4).
"""

from __future__ import annotations

import pickle
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from robot_llm.errors import RobotLLMError
from robot_llm.llm.families.config import ModuleKind
from robot_llm.llm.families.config import module_plan as config_plan
from robot_llm.llm.families.family import Params, Weights
from robot_llm.llm.families.yalm import YalmConfig

FILE_PATTERN = re.compile(r"^layer_(\d\d)-model_00-model_states\.pt$")


class CheckpointError(RobotLLMError):
    """A release checkpoint cannot be used as it is; the message names the file and key."""


class CheckpointWarning(UserWarning):
    """Something in a checkpoint was ignored (an extra key)."""


def release_file_name(number: int) -> str:
    """File name of release module ``number`` (``layer_NN-model_00-model_states.pt``)."""
    return f"layer_{number:02d}-model_00-model_states.pt"


def module_plan(cfg: YalmConfig) -> list[tuple[ModuleKind, int, str, dict[str, tuple[int, ...]]]]:
    """Every module of the model in forward order: ``(kind, index, file name, {key: shape})``.

    ``index`` is the 0-based layer index for ``"layer"`` and 0 otherwise.
    """
    numbers = {"embedding": 0, "projector": 1, "output": cfg.num_layers + 4}
    return [
        (kind, index, release_file_name(index + 3 if kind == "layer" else numbers[kind]), shapes)
        for kind, index, shapes in config_plan(cfg)
    ]


def resolve_weights_dir(directory: str | Path) -> Path:
    """Accept either the folder of ``.pt`` files or a folder with a ``weights/`` subfolder."""
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    if not any(FILE_PATTERN.match(p.name) for p in path.iterdir()) and (path / "weights").is_dir():
        return path / "weights"
    return path


def _torch_load(path: Path, trust_pickle: bool) -> object:
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust_pickle, mmap=True)
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" in str(exc):
            raise CheckpointError(
                f"{path}: torch.load(weights_only=True) refused this file because it holds "
                f"objects other than tensors ({str(exc).splitlines()[0]}). Only if you trust "
                "the file, load it again with trust_pickle=True (CLI: --trust-pickle), "
                "which runs its pickled code."
            ) from exc
        raise CheckpointError(f"{path}: corrupt checkpoint file ({exc})") from exc
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read checkpoint file, truncated or corrupt ({exc})") from exc


def read_module(path: str | Path, shapes: dict[str, tuple[int, ...]], *, trust_pickle: bool = False) -> Params:
    """Read one release file and check it holds exactly the tensors in ``shapes``.

    Returns the tensors as stored (memory-mapped, release dtype). Raises
    :class:`CheckpointError` for a missing/unreadable file, a missing key or a
    wrong shape; warns (:class:`CheckpointWarning`) about extra keys.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint file is missing")
    state = _torch_load(path, trust_pickle)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a dict of tensors, found {type(state).__name__}")
    params: Params = {}
    for key, shape in shapes.items():
        if key not in state:
            raise CheckpointError(f"{path}: missing key {key!r}")
        tensor = state[key]
        if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
            raise CheckpointError(f"{path}: key {key!r} is not a floating-point tensor")
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{path}: key {key!r} has shape {list(tensor.shape)}, the config expects {list(shape)}"
            )
        params[key] = tensor
    for key in state:
        if key not in shapes:
            warnings.warn(f"{path}: ignoring extra key {key!r}", CheckpointWarning, stacklevel=2)
    return params


def iter_release_modules(
    directory: str | Path, cfg: YalmConfig, *, trust_pickle: bool = False
) -> Iterator[tuple[ModuleKind, int, Params]]:
    """Yield ``(kind, index, params)`` for each module in forward order, one file at a time.

    All expected files are checked for existence before the first one is read,
    so a missing file is reported before any work is done.
    """
    folder = resolve_weights_dir(directory)
    plan = module_plan(cfg)
    for _, _, name, _ in plan:
        if not (folder / name).is_file():
            raise CheckpointError(f"{folder / name}: checkpoint file is missing")
    for kind, index, name, shapes in plan:
        yield kind, index, read_module(folder / name, shapes, trust_pickle=trust_pickle)


def load_release(directory: str | Path, cfg: YalmConfig, *, trust_pickle: bool = False) -> Weights:
    """Read a whole (small) release checkpoint; tensors stay in the stored dtype."""
    weights = Weights(resident={}, layers=[])
    for kind, _, params in iter_release_modules(directory, cfg, trust_pickle=trust_pickle):
        if kind == "layer":
            weights.layers.append(params)
        else:
            weights.resident[kind] = params
    return weights


def save_release(
    directory: str | Path, cfg: YalmConfig, weights: Weights, *, dtype: torch.dtype = torch.float16
) -> list[Path]:
    """Write ``weights`` in the release layout (one ``torch.save``d dict per module).

    Returns the written paths. Used to build demo and test checkpoints.
    """
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    modules: dict[tuple[str, int], Params] = {(kind, 0): p for kind, p in weights.resident.items()}
    modules.update({("layer", i): p for i, p in enumerate(weights.layers)})
    written = []
    for kind, index, name, shapes in module_plan(cfg):
        params = modules[(kind, index)]
        if set(params) != set(shapes):
            raise CheckpointError(f"{name}: weights for {kind} {index} have keys {sorted(params)}")
        path = folder / name
        torch.save({k: params[k].detach().to("cpu", dtype).contiguous() for k in shapes}, path)
        written.append(path)
    return written
