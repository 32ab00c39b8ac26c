"""Weight store: one safetensors file per module, laid out for large sequential reads.

A store folder holds ``embedding.safetensors``, ``projector.safetensors``,
``layer_000.safetensors`` .. and ``output.safetensors`` (release key names, see
:mod:`robot_llm.llm.yalm`) plus ``manifest.json``: the model config, the stored
dtype, the quantization scheme and every file's size and sha256.

:func:`convert` builds a store from a release checkpoint one module at a time
(the model is never held in RAM), refuses to start when the disk is too small,
and resumes after an interruption: each finished file is renamed into place
and recorded in ``progress.json`` before the next one starts.

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
import logging
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import Tensor

from robot_llm.errors import RobotLLMError
from robot_llm.llm.checkpoint import iter_release_modules
from robot_llm.llm.config import ModelConfig, ModuleKind, YalmConfig, config_from_dict, module_plan
from robot_llm.llm.diskio import DEFAULT_DEPTH, MAX_CHUNK, io_pool, read_span
from robot_llm.llm.family import Params
from robot_llm.llm.quant import (
    ALIGN,
    DEFAULT_INT4_GROUP,
    check_group_size,
    int4_bytes,
    int4_padded_shape,
    int8_bytes,
    int8_padded_width,
    quantize_int4,
    quantize_int8,
)

log = logging.getLogger(__name__)

FORMAT = "robot-llm-store/2"
#: The format before the quantized matrices took the fused kernels' layouts (its float stores still read).
OLD_FORMAT = "robot-llm-store/1"
MANIFEST = "manifest.json"
PROGRESS = "progress.json"
#: Suffix of the scale tensor that accompanies a quantized matrix (int8: bf16 ``[N]``; int4: the
#: kernel's bf16 ``scales_and_zeros [Kp / group, Np, 2]``).
SCALE_SUFFIX = ".qscale"
#: Safetensors metadata key of a quantized file: JSON ``{key: logical shape}`` of its packed matrices.
LOGICAL_SHAPES = "logical_shapes"
#: Stored element type per ``--dtype``; int8 and int4 keep their non-matrix tensors in fp16.
STORE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.float16,
    "int4": torch.float16,
}
#: Store dtypes whose layer matrices are quantized.
QUANTIZED = ("int8", "int4")
#: int4's group size when none is given (int8 is per channel and other dtypes have none: they record 0).
DEFAULT_GROUP_SIZE = DEFAULT_INT4_GROUP

_SAFETENSORS_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int8: "I8",
    torch.uint8: "U8",
}
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I8": torch.int8,
    "U8": torch.uint8,
}


class StoreError(RobotLLMError):
    """A store cannot be written or used as it is; the message says why."""


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


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def sha256_file(path: str | Path, chunk: int = 16 << 20) -> str:
    """Hex sha256 of a file, read in large chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------- convert


def expected_file_bytes(cfg: ModelConfig, dtype: str, group_size: int = DEFAULT_GROUP_SIZE) -> dict[str, int]:
    """Payload bytes of each store file for ``cfg`` (headers add a few KiB)."""
    elem = STORE_DTYPES[dtype].itemsize
    sizes = {}
    for kind, index, shapes in module_plan(cfg):
        total = 0
        for key, shape in shapes.items():
            numel = 1
            for d in shape:
                numel *= d
            if dtype == "int8" and is_quantized_key(kind, key, shape):
                total += int8_bytes((shape[0], shape[1]))
            elif dtype == "int4" and is_quantized_key(kind, key, shape):
                total += int4_bytes((shape[0], shape[1]), group_size)
            else:
                total += numel * elem
        sizes[file_name(kind, index)] = total
    return sizes


def _store_tensors(kind: ModuleKind, params: Params, dtype: str, group_size: int) -> Params:
    out: Params = {}
    for key, tensor in params.items():
        if dtype == "int8" and is_quantized_key(kind, key, tuple(tensor.shape)):
            out[key], out[key + SCALE_SUFFIX] = quantize_int8(tensor)
        elif dtype == "int4" and is_quantized_key(kind, key, tuple(tensor.shape)):
            out[key], out[key + SCALE_SUFFIX] = quantize_int4(tensor, group_size)
        else:
            out[key] = tensor.to(STORE_DTYPES[dtype]).contiguous()
    return out


def _check_dtype(dtype: str, group_size: int) -> int:
    """The group size this store records: int4's (checked), 0 for every other dtype."""
    if dtype not in STORE_DTYPES:
        raise StoreError(f"unknown store dtype {dtype!r}; use one of {', '.join(STORE_DTYPES)}")
    if dtype != "int4":
        return 0
    try:
        check_group_size(group_size)
    except ValueError as exc:
        raise StoreError(str(exc)) from exc
    return group_size


def _release_config(release_dir: Path) -> YalmConfig:
    # The release folder, or its weights/ subfolder (config.json one level up), like the runtime reads it.
    for path in (release_dir / "config.json", release_dir.parent / "config.json"):
        if path.is_file():
            return YalmConfig.from_json(path)
    raise StoreError(
        f"{release_dir} has no config.json (nor has its parent folder); name the model with a preset "
        "(--preset yalm-100b)"
    )


def convert(
    release_dir: str | Path,
    store_dir: str | Path,
    *,
    dtype: str = "fp16",
    config: YalmConfig | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
    reserve_bytes: int = 1 << 30,
    trust_pickle: bool = False,
    on_file: Callable[[StoreFile, int, int], None] | None = None,
) -> Manifest:
    """Convert a YaLM release checkpoint into a store, one module at a time; resumes unfinished work.

    ``config`` defaults to ``RELEASE_DIR/config.json``. See :func:`convert_modules`.
    """
    release = Path(release_dir)
    cfg = config or _release_config(release)
    modules = iter_release_modules(release, cfg, trust_pickle=trust_pickle)
    return convert_modules(
        cfg, modules, store_dir, dtype=dtype, group_size=group_size, reserve_bytes=reserve_bytes, on_file=on_file
    )


def convert_modules(
    cfg: ModelConfig,
    modules: Iterable[tuple[ModuleKind, int, Params]],
    store_dir: str | Path,
    *,
    dtype: str = "fp16",
    group_size: int = DEFAULT_GROUP_SIZE,
    reserve_bytes: int = 1 << 30,
    on_file: Callable[[StoreFile, int, int], None] | None = None,
) -> Manifest:
    """Write ``modules`` (``(kind, index, params)`` in forward order, read lazily) into a store.

    Every importer (release checkpoint, GGUF, Hugging Face folder) ends here. The
    conversion is refused before any file is written when the free space of
    ``store_dir`` minus ``reserve_bytes`` cannot hold the files still to write; it
    resumes an interrupted conversion (modules already written are skipped).
    ``on_file(file, done, total)`` is called after each file is in place (and for
    files an earlier run already finished).
    """
    group_size = _check_dtype(dtype, group_size)
    store = Path(store_dir)
    store.mkdir(parents=True, exist_ok=True)
    header = {
        "format": FORMAT,
        "family": cfg.family,
        "config": cfg.to_dict(),
        "dtype": dtype,
        "group_size": group_size,
    }
    if (store / MANIFEST).exists():
        manifest = read_manifest(store)
        recorded = manifest.group_size if manifest.dtype == "int4" else 0  # format 1 recorded one for every dtype
        if manifest.config != cfg or manifest.dtype != dtype or recorded != group_size:
            raise StoreError(f"{store} already holds a different store ({manifest.dtype}); use an empty folder")
        if not _reopen_damaged(store, manifest, header):
            log.info("store %s is already complete", store)
            return manifest

    done = _resume_state(store, header)
    sizes = expected_file_bytes(cfg, dtype, group_size)
    needed = sum(size for name, size in sizes.items() if name not in done)
    free = shutil.disk_usage(store).free
    if needed + reserve_bytes > free:
        raise StoreError(
            f"not enough disk space in {store}: the store needs {needed / 2**30:.2f} GiB more "
            f"(+{reserve_bytes / 2**30:.2f} GiB reserve), {free / 2**30:.2f} GiB is free"
        )

    total = len(sizes)
    started, written = time.monotonic(), 0
    for kind, index, _ in module_plan(cfg):
        name = file_name(kind, index)
        if name in done and on_file is not None:
            on_file(done[name], len(done), total)
    for kind, index, params in modules:
        name = file_name(kind, index)
        if name in done:
            continue
        try:
            entry = _write_module(store / name, kind, index, params, dtype, group_size)
            del params
            done[name] = entry
            _write_json_atomic(store / PROGRESS, {**header, "files": [vars(f) for f in done.values()]})
        except (OSError, SafetensorError) as exc:  # the disk filled up (or failed) under us
            (store / f"{name}.partial").unlink(missing_ok=True)
            reason = (exc.strerror if isinstance(exc, OSError) else None) or str(exc).splitlines()[0]
            raise StoreError(
                f"{store / name}: cannot write it ({reason}); nothing half-written is kept: free space in {store} "
                f"and run convert again, it resumes after the {len(done)} finished file(s)"
            ) from exc
        written += entry.size
        rate = written / max(time.monotonic() - started, 1e-9)
        log.info(
            "wrote %s (%d/%d files, %.1f MiB, %.1f MiB/s)", name, len(done), total, entry.size / 2**20, rate / 2**20
        )
        if on_file is not None:
            on_file(entry, len(done), total)

    order = [file_name(kind, index) for kind, index, _ in module_plan(cfg)]
    manifest = Manifest(config=cfg, dtype=dtype, group_size=group_size, files=[done[n] for n in order])
    _write_json_atomic(store / MANIFEST, manifest.to_json())
    (store / PROGRESS).unlink()
    return manifest


def _reopen_damaged(store: Path, manifest: Manifest, header: dict[str, Any]) -> bool:
    """Turn a complete store with missing or truncated files back into an unfinished conversion.

    The intact files are kept (recorded as done); the manifest goes away *after* that record
    is in place, so a crash during the repair never leaves a manifest vouching for a damaged
    file. Returns False when every file has its manifest size (``model verify`` checks hashes).
    """
    damaged = [
        f.name for f in manifest.files if not (store / f.name).is_file() or (store / f.name).stat().st_size != f.size
    ]
    if not damaged:
        return False
    shown = ", ".join(damaged[:3]) + (f" and {len(damaged) - 3} more" if len(damaged) > 3 else "")
    log.warning("store %s: %s missing or truncated; converting them again", store, shown)
    intact = [vars(f) for f in manifest.files if f.name not in damaged]
    _write_json_atomic(store / PROGRESS, {**header, "files": intact})
    (store / MANIFEST).unlink()
    return True


def _resume_state(store: Path, header: dict[str, Any]) -> dict[str, StoreFile]:
    """Files a previous, interrupted conversion finished (checked by size; verify checks hashes)."""
    path = store / PROGRESS
    for stale in store.glob("*.partial"):
        stale.unlink()
    if not path.exists():
        return {}
    state = json.loads(path.read_text(encoding="utf-8"))
    if {k: state.get(k) for k in header} != header:
        raise StoreError(f"{store} holds an unfinished conversion with other settings; use an empty folder")
    done = {}
    for f in state["files"]:
        entry = StoreFile(**f)
        target = store / entry.name
        if target.is_file() and target.stat().st_size == entry.size:
            done[entry.name] = entry
    log.info("resuming conversion in %s: %d files already done", store, len(done))
    return done


def _write_module(path: Path, kind: ModuleKind, index: int, params: Params, dtype: str, group_size: int) -> StoreFile:
    tensors = _store_tensors(kind, params, dtype, group_size)
    tmp = path.with_name(path.name + ".partial")
    # At most one metadata key: the order of several is not deterministic, and identical weights must hash equal.
    shapes = {k: list(t.shape) for k, t in params.items() if k + SCALE_SUFFIX in tensors}
    save_aligned(tensors, tmp, {LOGICAL_SHAPES: json.dumps(shapes, sort_keys=True)} if shapes else None)
    digest = sha256_file(tmp)
    os.replace(tmp, path)
    return StoreFile(name=path.name, kind=kind, index=index, size=path.stat().st_size, sha256=digest)


def save_aligned(tensors: Params, path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file (fsynced) whose data section and quantized matrices start at multiples of ALIGN.

    The fused kernels are handed views of the bytes as read (the int8 kernel crashes on weights
    not 16-byte aligned); slots and RAM homes are allocated aligned, so aligned file offsets
    suffice. The quantized matrices (sizes multiples of ALIGN) come first, then the
    rest by element size, then by name; the header is padded with spaces, as the format allows.
    """
    order = sorted(tensors, key=lambda k: (k + SCALE_SUFFIX not in tensors, -tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key in order:
        t = tensors[key]
        header[key] = {
            "dtype": _SAFETENSORS_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for key in order:
            f.write(memoryview(tensors[key].contiguous().reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


def write_store(
    store_dir: str | Path,
    cfg: ModelConfig,
    modules: Iterable[tuple[ModuleKind, int, Params]],
    *,
    dtype: str = "fp16",
    group_size: int = DEFAULT_GROUP_SIZE,
) -> Manifest:
    """Write a store from ``(kind, index, params)`` in forward order (e.g. random weights for benchmarks)."""
    group_size = _check_dtype(dtype, group_size)
    store = Path(store_dir)
    store.mkdir(parents=True, exist_ok=True)
    files = []
    for kind, index, params in modules:
        files.append(_write_module(store / file_name(kind, index), kind, index, params, dtype, group_size))
        log.info("wrote %s (%.1f MiB)", files[-1].name, files[-1].size / 2**20)
    manifest = Manifest(config=cfg, dtype=dtype, group_size=group_size, files=files)
    _write_json_atomic(store / MANIFEST, manifest.to_json())
    return manifest


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


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor sits inside a file's data section."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class FileLayout:
    """Parsed safetensors header: data section offset/size, tensor slots, quantized matrices' logical shapes."""

    path: Path
    data_offset: int
    data_size: int
    tensors: dict[str, TensorSlot]
    packed_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def read(cls, path: str | Path) -> FileLayout:
        """Parse the header of a safetensors file without reading its data."""
        path = Path(path)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        metadata = header.pop("__metadata__", None) or {}
        packed = {k: tuple(v) for k, v in json.loads(metadata.get(LOGICAL_SHAPES, "{}")).items()}
        tensors = {}
        for key, info in header.items():
            if info["dtype"] not in _SAFETENSORS_DTYPES:
                raise StoreError(f"{path}: unsupported tensor dtype {info['dtype']} for {key!r}")
            start, end = info["data_offsets"]
            tensors[key] = TensorSlot(_SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]), start, end)
        data_size = max((t.end for t in tensors.values()), default=0)
        return cls(path=path, data_offset=8 + n, data_size=data_size, tensors=tensors, packed_shapes=packed)

    def shape(self, key: str) -> tuple[int, ...]:
        """The model's shape of tensor ``key`` (a quantized matrix is stored packed in another shape)."""
        return self.packed_shapes.get(key) or self.tensors[key].shape

    def views(self, buffer: Tensor) -> Params:
        """Tensors viewing a uint8 ``buffer`` that holds this file's data section (no copies)."""
        return {key: buffer[s.start : s.end].view(s.dtype).view(s.shape) for key, s in self.tensors.items()}


#: Alignment O_DIRECT needs for buffer addresses, file offsets and lengths.
DIRECT_ALIGN = 4096


def _round_up(n: int, align: int = DIRECT_ALIGN) -> int:
    return -(-n // align) * align


def direct_span(layout: FileLayout) -> int:
    """Bytes a direct read of this file covers (header included, rounded up to the alignment)."""
    return _round_up(layout.data_offset + layout.data_size)


def aligned_buffer(nbytes: int, *, pin_memory: bool = False) -> Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose address is aligned for O_DIRECT."""
    raw = torch.empty(nbytes + DIRECT_ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
    skip = -raw.data_ptr() % DIRECT_ALIGN
    return raw[skip : skip + nbytes]


def read_into(
    path: str | Path,
    layout: FileLayout,
    buffer: Tensor,
    *,
    direct: bool = False,
    drop_cache: bool = False,
    pool: Executor | None = None,
    depth: int = 1,
) -> int:
    """Read a file's data section into the uint8 CPU ``buffer``; returns where the data starts in it.

    ``direct`` reads the whole file with O_DIRECT into a buffer from :func:`aligned_buffer`
    (at least :func:`direct_span` bytes): the disk DMAs straight into it, bypassing the page
    cache, and the waiting thread needs no CPU, so reading does not slow down compute on
    the same cores. The data then starts at ``layout.data_offset``. Where the file system
    refuses O_DIRECT (tmpfs) it falls back to a buffered read at offset 0. ``drop_cache``
    makes a buffered read forget the file's pages afterwards, so weights homed on disk
    do not silently occupy RAM as page cache. With a ``pool`` of reader threads the
    file is read as ``depth`` large requests in flight (:func:`robot_llm.llm.diskio.read_span`).
    """
    size = layout.data_size
    fd = -1
    if direct:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            fd = -1
    if fd >= 0:
        start, length, offset = 0, direct_span(layout), layout.data_offset
    else:
        fd = os.open(path, os.O_RDONLY)
        start, length, offset = layout.data_offset, size, 0
        os.posix_fadvise(fd, start, size, os.POSIX_FADV_SEQUENTIAL)
    view = memoryview(buffer.numpy()).cast("B")[:length]
    try:
        if read_span(fd, view, start, pool, depth) < offset + size:
            raise StoreError(f"{path}: file is shorter than its header says")
        if drop_cache:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return offset


def drop_page_cache(paths: list[Path]) -> None:
    """Ask the kernel to evict these files from the page cache (honest disk-read measurements)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure_read_bandwidth(path: str | Path, depth: int = DEFAULT_DEPTH) -> float:
    """Raw sequential read bandwidth of one file in bytes/s: O_DIRECT, ``depth`` large requests in
    flight like fio's ``--iodepth`` (page cache dropped first and after; buffered where O_DIRECT is refused)."""
    path = Path(path)
    drop_page_cache([path])
    window = min(depth * MAX_CHUNK, _round_up(path.stat().st_size))
    view = memoryview(aligned_buffer(window).numpy()).cast("B")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    total = 0
    pool = io_pool(depth)
    try:
        started = time.perf_counter()
        while n := read_span(fd, view, total, pool, depth):
            total += n
        elapsed = time.perf_counter() - started
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        pool.shutdown()
        os.close(fd)
    return total / max(elapsed, 1e-9)


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
