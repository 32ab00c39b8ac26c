"""Writing a store: converting a checkpoint module by module, resuming and repairing it.

:func:`convert` builds a store from a release checkpoint one module at a time
(the model is never held in RAM), refuses to start when the disk is too small,
and resumes after an interruption: each finished file is renamed into place
and recorded in ``progress.json`` before the next one starts. A complete store
with missing or truncated files is turned back into an unfinished conversion.
Every importer ends in :func:`convert_modules`; :func:`write_store` writes one
in a single pass (random weights for benchmarks).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from robot_llm.llm.families.config import ModelConfig, ModuleKind, module_plan
from robot_llm.llm.families.family import Params
from robot_llm.llm.families.yalm import YalmConfig
from robot_llm.llm.store.checkpoint import iter_release_modules
from robot_llm.llm.store.checksum import ChecksumSpec, aux_digests, file_digests
from robot_llm.llm.store.layout import LOGICAL_SHAPES, SCALE_SUFFIX, StoreError, save_aligned, write_json_atomic
from robot_llm.llm.store.quant import DEFAULT_INT4_GROUP, check_group_size, quantize_int4, quantize_int8
from robot_llm.llm.store.reader import (
    FORMAT,
    MANIFEST,
    PROGRESS,
    STORE_DTYPES,
    Manifest,
    StoreFile,
    check_int8_tensors,
    expected_file_bytes,
    file_name,
    matrix_dtype,
    read_manifest,
)

log = logging.getLogger(__name__)


def _store_tensors(
    kind: ModuleKind, params: Params, dtype: str, group_size: int, int8_keys: Collection[str] = ()
) -> Params:
    out: Params = {}
    for key, tensor in params.items():
        quantized = matrix_dtype(dtype, kind, key, tuple(tensor.shape), int8_keys)
        if quantized == "int8":
            out[key], out[key + SCALE_SUFFIX] = quantize_int8(tensor)
        elif quantized == "int4":
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


def _normalized_int8(
    cfg: ModelConfig, dtype: str, int8_tensors: Mapping[str, Collection[str]] | None
) -> dict[str, tuple[str, ...]]:
    """``int8_tensors`` checked, without empty entries, files in name order (the manifest's form)."""
    int8 = {name: tuple(keys) for name, keys in sorted((int8_tensors or {}).items()) if keys}
    check_int8_tensors(cfg, dtype, int8)
    return int8


def _describe(manifest: Manifest) -> str:
    int8 = manifest.matrix_counts().get("int8", 0) if manifest.dtype == "int4" else 0
    return manifest.dtype + (f", {int8} matrices int8" if int8 else "")


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
    group_size: int = DEFAULT_INT4_GROUP,
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
    group_size: int = DEFAULT_INT4_GROUP,
    reserve_bytes: int = 1 << 30,
    on_file: Callable[[StoreFile, int, int], None] | None = None,
    int8_tensors: Mapping[str, Collection[str]] | None = None,
) -> Manifest:
    """Write ``modules`` (``(kind, index, params)`` in forward order, read lazily) into a store.

    Every importer (release checkpoint, GGUF, Hugging Face folder) ends here. The
    conversion is refused before any file is written when the free space of
    ``store_dir`` minus ``reserve_bytes`` cannot hold the files still to write; it
    resumes an interrupted conversion (modules already written are skipped; the
    earlier run must have had the same settings, ``int8_tensors`` included).
    ``on_file(file, done, total)`` is called after each file is in place (and for
    files an earlier run already finished). ``int8_tensors`` (int4 only: file
    name -> keys) are layer matrices stored int8 instead of int4.
    """
    group_size = _check_dtype(dtype, group_size)
    int8 = _normalized_int8(cfg, dtype, int8_tensors)
    store = Path(store_dir)
    store.mkdir(parents=True, exist_ok=True)
    header: dict[str, Any] = {
        "format": FORMAT,
        "family": cfg.family,
        "config": cfg.to_dict(),
        "dtype": dtype,
        "group_size": group_size,
    }
    if int8:  # absent when empty, so an all-int4 conversion resumes one an older robot-llm began
        header["int8_tensors"] = {name: list(keys) for name, keys in int8.items()}
    if (store / MANIFEST).exists():
        manifest = read_manifest(store)
        recorded = manifest.group_size if manifest.dtype == "int4" else 0  # format 1 recorded one for every dtype
        if (manifest.config, manifest.dtype, recorded, manifest.int8_tensors) != (cfg, dtype, group_size, int8):
            raise StoreError(f"{store} already holds a different store ({_describe(manifest)}); use an empty folder")
        if not _reopen_damaged(store, manifest, header):
            log.info("store %s is already complete", store)
            return manifest

    done = _resume_state(store, header)
    sizes = expected_file_bytes(cfg, dtype, group_size, int8)
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
            entry = _write_module(store / name, kind, index, params, dtype, group_size, int8.get(name, ()))
            del params
            done[name] = entry
            write_json_atomic(store / PROGRESS, {**header, "files": [vars(f) for f in done.values()]})
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
    manifest = Manifest(
        config=cfg,
        dtype=dtype,
        group_size=group_size,
        files=[done[n] for n in order],
        int8_tensors=int8,
        checksums=ChecksumSpec(),
        aux_files=aux_digests(store),  # the importers write the tokenizer beside the weights first
    )
    write_json_atomic(store / MANIFEST, manifest.to_json())
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
    write_json_atomic(store / PROGRESS, {**header, "files": intact})
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
    keys = {*header, "int8_tensors"}  # an all-int4 header has none: a list the earlier run kept differs too
    if {k: state.get(k) for k in keys} != {k: header.get(k) for k in keys}:
        raise StoreError(f"{store} holds an unfinished conversion with other settings; use an empty folder")
    done = {}
    for f in state["files"]:
        entry = StoreFile(**{**f, "blocks": tuple(f.get("blocks", ()))})
        target = store / entry.name
        if target.is_file() and target.stat().st_size == entry.size:
            if not entry.blocks:  # finished by a robot-llm that recorded no block checksums
                entry = replace(entry, blocks=tuple(file_digests(target)[1]))
            done[entry.name] = entry
    log.info("resuming conversion in %s: %d files already done", store, len(done))
    return done


def _write_module(
    path: Path,
    kind: ModuleKind,
    index: int,
    params: Params,
    dtype: str,
    group_size: int,
    int8_keys: Collection[str] = (),
) -> StoreFile:
    tensors = _store_tensors(kind, params, dtype, group_size, int8_keys)
    tmp = path.with_name(path.name + ".partial")
    # At most one metadata key: the order of several is not deterministic, and identical weights must hash equal.
    shapes = {k: list(t.shape) for k, t in params.items() if k + SCALE_SUFFIX in tensors}
    save_aligned(tensors, tmp, {LOGICAL_SHAPES: json.dumps(shapes, sort_keys=True)} if shapes else None)
    digest, blocks = file_digests(tmp)
    os.replace(tmp, path)
    return StoreFile(
        name=path.name, kind=kind, index=index, size=path.stat().st_size, sha256=digest, blocks=tuple(blocks)
    )


def write_store(
    store_dir: str | Path,
    cfg: ModelConfig,
    modules: Iterable[tuple[ModuleKind, int, Params]],
    *,
    dtype: str = "fp16",
    group_size: int = DEFAULT_INT4_GROUP,
) -> Manifest:
    """Write a store from ``(kind, index, params)`` in forward order (e.g. random weights for benchmarks)."""
    group_size = _check_dtype(dtype, group_size)
    store = Path(store_dir)
    store.mkdir(parents=True, exist_ok=True)
    files = []
    for kind, index, params in modules:
        files.append(_write_module(store / file_name(kind, index), kind, index, params, dtype, group_size))
        log.info("wrote %s (%.1f MiB)", files[-1].name, files[-1].size / 2**20)
    manifest = Manifest(config=cfg, dtype=dtype, group_size=group_size, files=files, checksums=ChecksumSpec())
    write_json_atomic(store / MANIFEST, manifest.to_json())
    return manifest
