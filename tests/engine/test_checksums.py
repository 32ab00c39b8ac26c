"""Store block checksums: recorded by convert, checked as files are read, sampled by doctor, added to an old store."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from robot_llm.llm.engine.streaming import StreamingModel
from robot_llm.llm.store.checksum import (
    BLOCK_BYTES,
    BlockMismatch,
    DamagedStoreError,
    check_pieces,
    check_sampled,
    file_digests,
    sample_blocks,
)
from robot_llm.llm.store.layout import StoreError
from robot_llm.llm.store.reader import MANIFEST, Store, read_manifest, verify


@pytest.fixture
def store(stores: dict[str, Path], tmp_path: Path) -> Path:
    path = tmp_path / "store"
    shutil.copytree(stores["fp16"], path)
    return path


def _digests(data: bytes, block: int) -> list[str]:
    import xxhash

    return [xxhash.xxh3_64_hexdigest(data[i : i + block]) for i in range(0, len(data), block)]


@pytest.mark.parametrize("split", [0, 1, 4095, 4096, 4097, 10_000, 19_999])
def test_pieces_split_anywhere_check_the_same_blocks(split: int) -> None:
    data = os.urandom(20_000)
    block = 4096
    digests = _digests(data, block)
    pieces = [(0, memoryview(data[:split])), (split, memoryview(data[split:]))]
    check_pieces("f", digests, [p for p in pieces if len(p[1])], len(data), block)
    for offset in (0, split % len(data), len(data) - 1, 12_345):
        damaged = bytearray(data)
        damaged[offset] ^= 1
        view = memoryview(bytes(damaged))
        with pytest.raises(DamagedStoreError) as info:
            check_pieces("f", digests, [(0, view[:split]), (split, view[split:])], len(data), block)
        n = offset // block
        assert f"bytes {n * block}-{min(len(data), (n + 1) * block)}" in str(info.value)


def test_missing_bytes_are_not_taken_for_verified() -> None:
    data = os.urandom(10_000)
    with pytest.raises(DamagedStoreError):
        check_pieces("f", _digests(data, 4096), [(0, memoryview(data[:9000]))], len(data), 4096)


def test_convert_records_every_file_s_blocks_and_the_manifest_its_own_digest(store: Path) -> None:
    manifest = read_manifest(store)
    assert manifest.checksums is not None and manifest.checksums.block_bytes == BLOCK_BYTES
    for f in manifest.files:
        assert (f.sha256, list(f.blocks)) == file_digests(store / f.name)
    data = json.loads((store / MANIFEST).read_text())
    assert data["checksums"] == {"algorithm": "xxh3-64", "block_bytes": BLOCK_BYTES} and data["manifest_xxh3"]


def test_sampled_blocks_cover_first_last_and_a_rotating_one() -> None:
    assert sample_blocks(100, 16, 0) == [0, 1, 6]
    picks = {tuple(sample_blocks(10 * 16, 16, day)) for day in range(40)}
    assert all(p[0] == 0 and p[-1] == 9 and len(p) == 3 for p in picks)
    assert {p[1] for p in picks} == set(range(1, 9))  # over the nights, every middle block
    assert sample_blocks(5, 16, 3) == [0]


def test_check_sampled_reads_only_its_blocks(tmp_path: Path) -> None:
    path = tmp_path / "f"
    data = os.urandom(10 * 4096)
    path.write_bytes(data)
    digests = _digests(data, 4096)
    assert check_sampled(path, digests, len(data), 4096, nonce=3) == [0, 4, 9]
    damaged = bytearray(data)
    damaged[5 * 4096] ^= 1  # a block the sample skips today...
    path.write_bytes(bytes(damaged))
    assert check_sampled(path, digests, len(data), 4096, nonce=3) == [0, 4, 9]
    with pytest.raises(BlockMismatch):  # ...and reads another day
        check_sampled(path, digests, len(data), 4096, nonce=4)


@pytest.mark.parametrize("home", ["disk", "ram"])
def test_the_engine_verifies_each_file_once_as_it_streams(store: Path, home: str) -> None:
    ids = torch.tensor([[5, 6, 7]])
    model = StreamingModel(store, home=home, device="cpu", dtype="fp32")
    try:
        expected = model.forward(ids)
        assert model.store.verified == {f.name for f in model.store.manifest.files}
        assert model.store.verified_bytes == model.store.manifest.total_bytes
        assert torch.equal(model.forward(ids), expected)  # verified once; the stream is unchanged
    finally:
        model.close()
    victim = store / "layer_001.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    victim.write_bytes(bytes(data))
    if home == "ram":  # read when the model opens
        with pytest.raises(DamagedStoreError, match=r"layer_001\.safetensors"):
            StreamingModel(store, home=home, device="cpu", dtype="fp32")
        return
    model = StreamingModel(store, home=home, device="cpu", dtype="fp32")
    try:
        with pytest.raises(DamagedStoreError, match=r"layer_001\.safetensors"):
            model.forward(ids)
    finally:
        model.close()


def test_a_damaged_manifest_does_not_open(store: Path) -> None:
    path = store / MANIFEST
    text = path.read_text()
    path.write_text(text.replace('"sha256": "', '"sha256": "0', 1))  # still JSON, one value changed
    with pytest.raises(StoreError, match="its own checksum"):
        Store(store)


def test_a_store_without_checksums_opens_with_a_note_and_verify_records_them(
    store: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    from robot_llm.commands.main import main

    data = json.loads((store / MANIFEST).read_text())
    for key in ("checksums", "manifest_xxh3"):  # as a robot-llm before checksums wrote it
        del data[key]
    for f in data["files"]:
        del f["blocks"]
    (store / MANIFEST).write_text(json.dumps(data))
    with caplog.at_level("WARNING"):
        old = Store(store)
    assert not old.checksummed and "not verified" in caplog.text and "--record-checksums" in caplog.text

    assert main(["model", "verify", str(store), "--record-checksums"]) == 0
    assert "OK" in capsys.readouterr().out
    upgraded = Store(store)
    assert upgraded.checksummed
    assert verify(store) == []


def test_verify_reports_a_block_mismatch_even_when_sha256_was_recomputed(store: Path) -> None:
    # A manifest whose sha256 was refreshed by hand but not its blocks: verify names the file.
    from dataclasses import replace

    from robot_llm.llm.store.layout import write_json_atomic

    manifest = read_manifest(store)
    victim = store / "layer_000.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    sha, _ = file_digests(victim)
    files = [replace(f, sha256=sha) if f.name == victim.name else f for f in manifest.files]
    write_json_atomic(store / MANIFEST, replace(manifest, files=files).to_json())
    assert verify(store) == [
        "layer_000.safetensors: block checksums do not match the manifest (file or manifest damaged)"
    ]


def test_a_tokenizer_written_beside_the_store_is_checked_before_it_is_used(tiny_dir: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    from robot_llm.llm.store.checksum import check_beside_store
    from robot_llm.llm.store.writer import convert
    from robot_llm.llm.tokenizer import load_tokenizer

    store = tmp_path / "store"
    store.mkdir()
    tokenizer = store / "tokenizer.json"
    Tokenizer(models.WordLevel({"up": 0, "down": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(tokenizer))
    convert(tiny_dir, store, dtype="fp16")  # an importer writes the tokenizer first, then the weights
    assert set(read_manifest(store).aux_files) == {"tokenizer.json"}
    check_beside_store(tokenizer)
    check_beside_store(store)  # a folder holding it, as model.vocab may name

    text = tokenizer.read_text()
    tokenizer.write_text(text.replace('"up"', '"uq"'))  # still a tokenizer, silently another one
    with pytest.raises(DamagedStoreError, match=r"tokenizer\.json"):
        load_tokenizer(tokenizer)
