"""Weight store: one safetensors file per module, laid out for large sequential reads.

A store folder holds ``embedding.safetensors``, ``projector.safetensors``,
``layer_000.safetensors`` .. and ``output.safetensors`` (release key names, see
:mod:`robot_llm.llm.families.yalm`) plus ``manifest.json``: the model config, the stored
dtype, the quantization scheme and every file's size and sha256. This module
reads that folder (:class:`Store`) and checks it (:func:`verify`); one file's
byte layout and its reads are :mod:`robot_llm.llm.store.layout`'s, writing a
store (convert, resume, repair) is :mod:`robot_llm.llm.store.writer`'s.

``int8`` and ``int4`` are weight-only: the 2-D matrices of the transformer
layers are stored exactly as torch's fused CPU kernels read them
(:mod:`robot_llm.llm.store.quant`): int8 symmetric per output channel with a bf16
scale per row; int4 group-wise asymmetric, the codes packed in the kernel's
row-block layout with a bf16 scale and zero per group (``group_size`` input
columns of a row). Their logical shapes are in the file's safetensors metadata.
The embedding (also the tied LM head), the output layer, norms and biases stay fp16.
An int4 store may keep some matrices int8 (a GGUF source's matrices that the file holds at
more than int4's bits, :mod:`robot_llm.llm.store.importers`): the manifest lists them under
``int8_tensors`` (file name -> keys); a manifest without that field is all-int4, as before.

Format 2 (this one) changed the quantized layouts; a format-1 float store is
the same bytes and still reads, a format-1 int8/int4 store is refused with a
message that says to convert again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from robot_llm.llm.families.config import ModelConfig, ModuleKind, module_plan
from robot_llm.llm.families.family import Params
from robot_llm.llm.families.registry import config_from_dict
from robot_llm.llm.store.checksum import BLOCK_BYTES, ChecksumSpec, check_pieces, file_digests, manifest_digest
from robot_llm.llm.store.layout import SCALE_SUFFIX, FileLayout, StoreError, read_into, read_pieces
from robot_llm.llm.store.quant import DEFAULT_INT4_GROUP, int4_bytes, int4_padded_shape, int8_bytes, int8_padded_width

log = logging.getLogger(__name__)

FORMAT = "robot-llm-store/2"
#: The format before the quantized matrices took the fused kernels' layouts (its float stores still read).
OLD_FORMAT = "robot-llm-store/1"
MANIFEST = "manifest.json"
PROGRESS = "progress.json"
#: Store dtypes whose layer matrices are quantized.
QUANTIZED = ("int8", "int4")
#: Stored element type per store dtype of the tensors it keeps float (int8 and int4: fp16).
STORE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.float16,
    "int4": torch.float16,
}


def file_name(kind: ModuleKind, index: int) -> str:
    """Store file of a module: ``layer_007.safetensors`` for layer 7, ``<kind>.safetensors`` otherwise."""
    return f"layer_{index:03d}.safetensors" if kind == "layer" else f"{kind}.safetensors"


def is_quantized_key(kind: ModuleKind, key: str, shape: tuple[int, ...]) -> bool:
    """True for the tensors int8/int4 stores quantize: the matrices of transformer layers."""
    return kind == "layer" and len(shape) == 2 and key.endswith(".weight")


def matrix_dtype(
    dtype: str, kind: ModuleKind, key: str, shape: tuple[int, ...], int8_keys: Collection[str] = ()
) -> str | None:
    """How a store of ``dtype`` keeps tensor ``key``: ``"int8"``/``"int4"`` when quantized, None when float.

    ``int8_keys`` are the keys of this tensor's file that an int4 store keeps int8
    (:attr:`Manifest.int8_tensors`).
    """
    if dtype not in QUANTIZED or not is_quantized_key(kind, key, shape):
        return None
    return "int8" if key in int8_keys else dtype


def expected_file_bytes(
    cfg: ModelConfig,
    dtype: str,
    group_size: int = DEFAULT_INT4_GROUP,
    int8_tensors: Mapping[str, Collection[str]] | None = None,
) -> dict[str, int]:
    """Payload bytes of each store file for ``cfg`` (headers add a few KiB); ``int8_tensors`` as the manifest's."""
    elem = STORE_DTYPES[dtype].itemsize
    int8_tensors = int8_tensors or {}
    sizes = {}
    for kind, index, shapes in module_plan(cfg):
        name = file_name(kind, index)
        total = 0
        for key, shape in shapes.items():
            quantized = matrix_dtype(dtype, kind, key, shape, int8_tensors.get(name, ()))
            if quantized == "int8":
                total += int8_bytes((shape[0], shape[1]))
            elif quantized == "int4":
                total += int4_bytes((shape[0], shape[1]), group_size)
            else:
                total += math.prod(shape) * elem
        sizes[name] = total
    return sizes


def check_int8_tensors(cfg: ModelConfig, dtype: str, int8_tensors: Mapping[str, Collection[str]]) -> None:
    """Raise :class:`StoreError` unless every listed tensor is a layer matrix an int4 store of ``cfg`` quantizes."""
    if not int8_tensors:
        return
    if dtype != "int4":
        raise StoreError(f"only an int4 store keeps some matrices int8, not a {dtype} store")
    plan = {file_name(kind, index): (kind, shapes) for kind, index, shapes in module_plan(cfg)}
    for name, keys in int8_tensors.items():
        if name not in plan:
            raise StoreError(f"int8_tensors names {name}, not a file of this model")
        kind, shapes = plan[name]
        bad = [k for k in keys if k not in shapes or not is_quantized_key(kind, k, shapes[k])]
        if bad:
            raise StoreError(f"int8_tensors names {name} {bad}: not quantized layer matrices of this model")


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class StoreFile:
    """One file of a store as recorded in the manifest."""

    name: str
    kind: ModuleKind
    index: int
    size: int
    sha256: str
    #: Block digests (:mod:`robot_llm.llm.store.checksum`); empty in a store converted before they were recorded.
    blocks: tuple[str, ...] = ()


@dataclass(frozen=True)
class Manifest:
    """Contents of ``manifest.json``."""

    config: ModelConfig
    dtype: str
    group_size: int
    files: list[StoreFile] = field(default_factory=list)
    #: int4 store only: the matrices kept int8 instead, file name -> keys (empty: every matrix int4).
    int8_tensors: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: How the files' block digests were made; None for a store converted before they were recorded.
    checksums: ChecksumSpec | None = None
    #: XXH3-64 of the tokenizer files written beside the weights (:data:`~robot_llm.llm.store.checksum.AUX_FILES`).
    aux_files: dict[str, str] = field(default_factory=dict)

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
                "applies_to": "2-D weights of transformer layers"
                + (", but those in int8_tensors: int8 as in an int8 store" if self.int8_tensors else ""),
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

    def _quantized_matrices(self) -> Iterator[tuple[str, int]]:
        """(stored dtype, parameters) of each quantized layer matrix."""
        for kind, index, shapes in module_plan(self.config):
            int8_keys = self.int8_tensors.get(file_name(kind, index), ())
            for key, shape in shapes.items():
                quantized = matrix_dtype(self.dtype, kind, key, shape, int8_keys)
                if quantized is not None:
                    yield quantized, math.prod(shape)

    def matrix_counts(self) -> dict[str, int]:
        """Quantized layer matrices per dtype, e.g. ``{"int4": 27, "int8": 99}`` (empty for a float store)."""
        counts: dict[str, int] = {}
        for quantized, _ in self._quantized_matrices():
            counts[quantized] = counts.get(quantized, 0) + 1
        return counts

    def int8_share(self) -> float:
        """Share of the layer matrices' parameters an int4 store keeps int8 (0.0 for any other store): the
        planner times them on int8's path (:func:`robot_llm.llm.plan.planner.plan`)."""
        if not self.int8_tensors:
            return 0.0
        params: dict[str, int] = {}
        for quantized, n in self._quantized_matrices():
            params[quantized] = params.get(quantized, 0) + n
        return params.get("int8", 0) / sum(params.values())

    def layer_bytes(self) -> list[int]:
        """Payload bytes of each transformer layer's file, in order (what the planner plans a store with)."""
        sizes = expected_file_bytes(self.config, self.dtype, self.group_size, self.int8_tensors)
        return [sizes[file_name("layer", i)] for i in range(self.config.num_layers)]

    def to_json(self) -> dict[str, Any]:
        """The JSON document written to ``manifest.json`` (``int8_tensors`` only when there are any)."""
        data = {
            "format": FORMAT,
            "family": self.config.family,
            "config": self.config.to_dict(),
            "dtype": self.dtype,
            "group_size": self.group_size,
            "quantization": self.quantization,
            "total_bytes": self.total_bytes,
            "files": [{**vars(f), "blocks": list(f.blocks)} if f.blocks else _legacy_entry(f) for f in self.files],
        }
        if self.int8_tensors:
            data["int8_tensors"] = {name: list(keys) for name, keys in self.int8_tensors.items()}
        if self.checksums is not None:
            data["checksums"] = self.checksums.to_json()
        if self.aux_files:
            data["aux_files"] = dict(self.aux_files)
        # Last: the manifest's digest of itself, so a damaged byte anywhere in it is caught when it is read.
        data["manifest_xxh3"] = manifest_digest(data)
        return data

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
        recorded = data.get("manifest_xxh3")
        if recorded is not None and recorded != manifest_digest(data):
            raise StoreError(
                "manifest.json does not match its own checksum (it is damaged): restore it, or convert the store again"
            )
        config = config_from_dict(data["config"], data.get("family", "yalm"))
        int8_tensors = {name: tuple(keys) for name, keys in data.get("int8_tensors", {}).items()}
        check_int8_tensors(config, data["dtype"], int8_tensors)
        return cls(
            config=config,
            dtype=data["dtype"],
            group_size=int(data["group_size"]),
            files=[StoreFile(**{**f, "blocks": tuple(f.get("blocks", ()))}) for f in data["files"]],
            int8_tensors=int8_tensors,
            checksums=ChecksumSpec.from_json(data["checksums"]) if "checksums" in data else None,
            aux_files={str(k): str(v) for k, v in data.get("aux_files", {}).items()},
        )


def _legacy_entry(f: StoreFile) -> dict[str, Any]:
    """A file entry of a store without block digests, as it was written before they existed."""
    entry = vars(f).copy()
    del entry["blocks"]
    return entry


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


def verify(
    store_dir: str | Path,
    *,
    on_file: Callable[[StoreFile, int, int], None] | None = None,
    record_checksums: bool = False,
) -> list[str]:
    """Check every file against the manifest (presence, size, sha256, block checksums, tensor shapes).

    Returns the list of problems found (empty when the store is intact). With
    ``record_checksums``, an intact store whose manifest has no block checksums (converted
    by an older robot-llm) gets them, computed in the same read.
    """
    store = Path(store_dir)
    manifest = read_manifest(store)
    problems: list[str] = []
    plan = {file_name(k, i): (k, shapes) for k, i, shapes in module_plan(manifest.config)}
    block = manifest.checksums.block_bytes if manifest.checksums is not None else BLOCK_BYTES
    computed: list[StoreFile] = []
    for n, entry in enumerate(manifest.files, 1):
        path = store / entry.name
        if not path.is_file():
            problems.append(f"{entry.name}: missing")
        elif path.stat().st_size != entry.size:
            problems.append(f"{entry.name}: size {path.stat().st_size} != manifest {entry.size}")
        else:
            sha, blocks = file_digests(path, block)
            computed.append(replace(entry, blocks=tuple(blocks)))
            if sha != entry.sha256:
                problems.append(f"{entry.name}: sha256 mismatch (file corrupted)")
            elif entry.blocks and tuple(blocks) != entry.blocks:
                problems.append(f"{entry.name}: block checksums do not match the manifest (file or manifest damaged)")
            else:
                problems.extend(_check_layout(path, manifest, *plan[entry.name]))
        if on_file is not None:
            on_file(entry, n, len(manifest.files))
    if record_checksums and not problems and manifest.checksums is None:
        from robot_llm.llm.store.layout import write_json_atomic

        write_json_atomic(
            store / MANIFEST, replace(manifest, files=computed, checksums=ChecksumSpec(block_bytes=block)).to_json()
        )
        log.info("%s: block checksums recorded in the manifest", store)
    return problems


def _check_layout(path: Path, manifest: Manifest, kind: ModuleKind, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    layout = FileLayout.read(path)
    int8_keys = manifest.int8_tensors.get(path.name, ())
    want: dict[str, tuple[int, ...]] = {}
    for key, shape in shapes.items():
        want[key] = shape
        quantized = matrix_dtype(manifest.dtype, kind, key, shape, int8_keys)
        if quantized == "int8":
            want[key] = (shape[0], int8_padded_width(shape[1]))
            want[key + SCALE_SUFFIX] = (shape[0],)
        elif quantized == "int4":
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

    def __init__(self, store_dir: str | Path, manifest: Manifest | None = None) -> None:
        """Open ``store_dir``; ``manifest``: its manifest, when the caller has read it already (a night: once)."""
        self.path = Path(store_dir)
        self.manifest = manifest if manifest is not None else read_manifest(self.path)
        self.config = self.manifest.config
        self.layouts = {f.name: FileLayout.read(self.path / f.name) for f in self.manifest.files}
        self.entries = {f.name: f for f in self.manifest.files}
        #: Files whose bytes were checked against their block digests since the store was opened.
        self.verified: set[str] = set()
        #: Seconds spent hashing, and the bytes hashed (the benchmark reports the cost).
        self.verify_seconds = 0.0
        self.verified_bytes = 0
        self._verify_lock = threading.Lock()
        if not self.checksummed:
            log.warning(
                "%s: the manifest records no block checksums (converted by an older robot-llm): its files are not "
                "verified as they are read; `robot-llm model verify --record-checksums %s` checks their sha256 "
                "and records them",
                self.path,
                self.path,
            )

    @property
    def checksummed(self) -> bool:
        """Whether the manifest has block digests for every file (reads are then verified)."""
        return self.manifest.checksums is not None and all(f.blocks for f in self.manifest.files)

    def check_read(self, name: str, pieces: list[tuple[int, memoryview]]) -> None:
        """Verify a file's bytes just read (``(file offset, bytes)`` covering it) the first time it is read.

        Raises :class:`~robot_llm.llm.store.checksum.DamagedStoreError` naming the file and the bytes
        when they differ from the manifest's digests; later reads of a verified file are not
        hashed again (the night's first pass checks every byte).
        """
        spec = self.manifest.checksums
        if spec is None or name in self.verified:
            return
        entry = self.entries[name]
        if not entry.blocks:
            return
        started = time.perf_counter()
        check_pieces(name, entry.blocks, pieces, entry.size, spec.block_bytes)
        with self._verify_lock:
            self.verify_seconds += time.perf_counter() - started
            self.verified_bytes += entry.size
            self.verified.add(name)
            if len(self.verified) == len(self.entries):
                log.info(
                    "%s: every file verified against its checksums as it was read (%.2f GiB hashed in %.2f s)",
                    self.path,
                    self.verified_bytes / 2**30,
                    self.verify_seconds,
                )

    def file(self, kind: ModuleKind, index: int = 0) -> Path:
        """Path of a module's file."""
        return self.path / file_name(kind, index)

    def layout(self, kind: ModuleKind, index: int = 0) -> FileLayout:
        """Parsed header of a module's file."""
        return self.layouts[file_name(kind, index)]

    def layer_files(self) -> list[Path]:
        """Files of the transformer layers, in order."""
        return [self.file("layer", i) for i in range(self.config.num_layers)]

    def load(self, kind: ModuleKind, index: int = 0) -> Params:
        """Read one module into freshly allocated CPU tensors (used for the small resident modules)."""
        layout = self.layout(kind, index)
        buffer = torch.empty(layout.data_size, dtype=torch.uint8)
        offset = read_into(self.file(kind, index), layout, buffer)
        self.check_read(file_name(kind, index), read_pieces(layout, buffer, offset))
        return layout.views(buffer[offset : offset + layout.data_size])
