"""Weight store: one safetensors file per module, laid out for large sequential reads.

A store folder holds ``embedding.safetensors``, ``projector.safetensors``,
``layer_000.safetensors`` .. and ``output.safetensors`` (release key names, see
:mod:`robot_llm.llm.yalm`) plus ``manifest.json``: the model config, the stored
dtype, the quantization scheme and every file's size and sha256. This module
reads that folder (:class:`Store`) and checks it (:func:`verify`); one file's
byte layout and its reads are :mod:`robot_llm.llm.store_layout`'s, writing a
store (convert, resume, repair) is :mod:`robot_llm.llm.store_writer`'s.

``int8`` and ``int4`` are weight-only: the 2-D matrices of the transformer
layers are stored exactly as torch's fused CPU kernels read them
(:mod:`robot_llm.llm.quant`): int8 symmetric per output channel with a bf16
scale per row; int4 group-wise asymmetric, the codes packed in the kernel's
row-block layout with a bf16 scale and zero per group (``group_size`` input
columns of a row). Their logical shapes are in the file's safetensors metadata.
The embedding (also the tied LM head), the output layer, norms and biases stay fp16.

Format 2 (this one) changed the quantized layouts; a format-1 float store is
the same bytes and still reads, a format-1 int8/int4 store is refused with a
message that says to convert again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from robot_llm.llm.config import ModelConfig, ModuleKind, config_from_dict, module_plan
from robot_llm.llm.family import Params
from robot_llm.llm.quant import int4_padded_shape, int8_padded_width
from robot_llm.llm.store_layout import SCALE_SUFFIX, FileLayout, StoreError, read_into

FORMAT = "robot-llm-store/2"
#: The format before the quantized matrices took the fused kernels' layouts (its float stores still read).
OLD_FORMAT = "robot-llm-store/1"
MANIFEST = "manifest.json"
PROGRESS = "progress.json"
#: Store dtypes whose layer matrices are quantized.
QUANTIZED = ("int8", "int4")


def file_name(kind: ModuleKind, index: int) -> str:
    """Store file of a module: ``layer_007.safetensors`` for layer 7, ``<kind>.safetensors`` otherwise."""
    return f"layer_{index:03d}.safetensors" if kind == "layer" else f"{kind}.safetensors"


def is_quantized_key(kind: ModuleKind, key: str, shape: tuple[int, ...]) -> bool:
    """True for the tensors int8/int4 stores quantize: the matrices of transformer layers."""
    return kind == "layer" and len(shape) == 2 and key.endswith(".weight")


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class StoreFile:
    """One file of a store as recorded in the manifest."""

    name: str
    kind: ModuleKind
    index: int
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """Contents of ``manifest.json``."""

    config: ModelConfig
    dtype: str
    group_size: int
    files: list[StoreFile] = field(default_factory=list)

    @property
    def quantization(self) -> dict[str, Any] | None:
        """The quantization scheme, or None for a plain float store."""
        if self.dtype == "int4":
            return {
                "scheme": "int4 weight-only, asymmetric: w = (q - 8) * scale + zero, bf16 scale and zero per group",
                "group_size": self.group_size,
                "groups": "group_size consecutive input columns of a row (columns padded to the group)",
                "layout": "torch._weight_int4pack_mm_for_cpu: codes uint8 [Np/64, Kp, 32] (byte j: row j low "
                "nibble, row j+32 high), scales_and_zeros bf16 [Kp/group, Np, 2]; rows padded to 64",
                "applies_to": "2-D weights of transformer layers",
                "scale_suffix": SCALE_SUFFIX,
            }
        if self.dtype != "int8":
            return None
        return {
            "scheme": "int8 weight-only, symmetric, one bf16 scale per output channel",
            "layout": "torch._weight_int8pack_mm: int8 [N, Kp] (columns zero-padded to 32), scales bf16 [N]",
            "applies_to": "2-D weights of transformer layers",
            "scale_suffix": SCALE_SUFFIX,
        }

    @property
    def total_bytes(self) -> int:
        """Sum of all file sizes."""
        return sum(f.size for f in self.files)

    def to_json(self) -> dict[str, Any]:
        """The JSON document written to ``manifest.json``."""
        return {
            "format": FORMAT,
            "family": self.config.family,
            "config": self.config.to_dict(),
            "dtype": self.dtype,
            "group_size": self.group_size,
            "quantization": self.quantization,
            "total_bytes": self.total_bytes,
            "files": [vars(f) for f in self.files],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        """Parse a ``manifest.json`` document."""
        if data.get("format") == OLD_FORMAT and data.get("dtype") in QUANTIZED:
            raise StoreError(
                f"this {data['dtype']} store was written by an older robot-llm (format {OLD_FORMAT}) whose "
                f"{data['dtype']} layout the fused kernels cannot read: re-run `robot-llm model convert` with "
                f"--dtype {data['dtype']} into an empty folder"
            )
        if data.get("format") not in (FORMAT, OLD_FORMAT):
            raise StoreError(f"not a {FORMAT} manifest (format={data.get('format')!r})")
        return cls(
            config=config_from_dict(data["config"], data.get("family", "yalm")),
            dtype=data["dtype"],
            group_size=int(data["group_size"]),
            files=[StoreFile(**f) for f in data["files"]],
        )


def read_manifest(store_dir: str | Path) -> Manifest:
    """Load ``STORE_DIR/manifest.json`` (raises :class:`StoreError` when absent or invalid)."""
    path = Path(store_dir) / MANIFEST
    if not path.is_file():
        extra = " (conversion unfinished: run convert again to resume)" if (path.parent / PROGRESS).exists() else ""
        raise StoreError(f"{path} does not exist{extra}")
    try:
        return Manifest.from_json(json.loads(path.read_text(encoding="utf-8")))
    except StoreError as exc:
        raise StoreError(f"{path.parent}: {exc}") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreError(f"{path}: invalid manifest ({exc})") from exc


def sha256_file(path: str | Path, chunk: int = 16 << 20) -> str:
    """Hex sha256 of a file, read in large chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------- verify


def verify(store_dir: str | Path, *, on_file: Callable[[StoreFile, int, int], None] | None = None) -> list[str]:
    """Check every file against the manifest (presence, size, sha256, tensor shapes).

    Returns the list of problems found (empty when the store is intact).
    """
    store = Path(store_dir)
    manifest = read_manifest(store)
    problems: list[str] = []
    plan = {file_name(k, i): (k, shapes) for k, i, shapes in module_plan(manifest.config)}
    for n, entry in enumerate(manifest.files, 1):
        path = store / entry.name
        if not path.is_file():
            problems.append(f"{entry.name}: missing")
        elif path.stat().st_size != entry.size:
            problems.append(f"{entry.name}: size {path.stat().st_size} != manifest {entry.size}")
        elif sha256_file(path) != entry.sha256:
            problems.append(f"{entry.name}: sha256 mismatch (file corrupted)")
        else:
            problems.extend(_check_layout(path, manifest, *plan[entry.name]))
        if on_file is not None:
            on_file(entry, n, len(manifest.files))
    return problems


def _check_layout(path: Path, manifest: Manifest, kind: ModuleKind, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    layout = FileLayout.read(path)
    want: dict[str, tuple[int, ...]] = {}
    for key, shape in shapes.items():
        want[key] = shape
        if manifest.dtype == "int8" and is_quantized_key(kind, key, shape):
            want[key] = (shape[0], int8_padded_width(shape[1]))
            want[key + SCALE_SUFFIX] = (shape[0],)
        elif manifest.dtype == "int4" and is_quantized_key(kind, key, shape):
            g = manifest.group_size
            rows, cols = int4_padded_shape((shape[0], shape[1]), g)
            want[key] = (rows, cols // 2)
            want[key + SCALE_SUFFIX] = (cols // g, rows, 2)
    have = {k: t.shape for k, t in layout.tensors.items()}
    if have != want or any(layout.shape(k) != want_shape for k, want_shape in shapes.items()):
        return [f"{path.name}: tensors {sorted(have)} do not match the model config"]
    return []


class Store:
    """A converted store opened for reading: manifest plus parsed file headers."""

    def __init__(self, store_dir: str | Path) -> None:
        self.path = Path(store_dir)
        self.manifest = read_manifest(self.path)
        self.config = self.manifest.config
        self.layouts = {f.name: FileLayout.read(self.path / f.name) for f in self.manifest.files}

    def file(self, kind: ModuleKind, index: int = 0) -> Path:
        """Path of a module's file."""
        return self.path / file_name(kind, index)

    def layout(self, kind: ModuleKind, index: int = 0) -> FileLayout:
        """Parsed header of a module's file."""
        return self.layouts[file_name(kind, index)]

    def layer_files(self) -> list[Path]:
        """Files of the transformer layers, in order."""
        return [self.file("layer", i) for i in range(self.config.num_layers)]

    def max_layer_bytes(self) -> int:
        """Largest data section among the transformer layers (the size of one streaming buffer)."""
        return max(self.layout("layer", i).data_size for i in range(self.config.num_layers))

    def load(self, kind: ModuleKind, index: int = 0) -> Params:
        """Read one module into freshly allocated CPU tensors (used for the small resident modules)."""
        layout = self.layout(kind, index)
        buffer = torch.empty(layout.data_size, dtype=torch.uint8)
        read_into(self.file(kind, index), layout, buffer)
        return layout.views(buffer)
