"""Tokenizers: SentencePiece with YaLM's conventions (docs/yalm-model.md §6), and Hugging Face ``tokenizers``.

Both satisfy :class:`Tokenizer`, which is all generation and prompt planning
use. :func:`load_tokenizer` picks the right one from the path: a
``tokenizer.json`` (or a folder holding one, such as a converted store) is a
Hugging Face tokenizer, anything else a YaLM SentencePiece model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import sentencepiece as spm

NEWLINE_PIECE = "[NL]"
MASK_PIECE = "[MASK]"


class Tokenizer(Protocol):
    """What generation needs from a tokenizer."""

    bos_id: int
    eos_id: int

    @property
    def vocab_size(self) -> int:
        """Number of tokens the tokenizer can produce."""
        ...

    def encode(self, text: str | bytes) -> list[int]:
        """Token ids of a prompt as the model expects it (BOS first where the model wants one)."""
        ...

    def encode_pieces_ids(self, text: str | bytes) -> list[int]:
        """Token ids of ``text`` without any special token."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; special tokens vanish."""
        ...


class YalmTokenizer:
    """Encode prompts as the original does (``[NL]`` for newlines, BOS prepended, no EOS).

    ``bos_id`` = 1, ``eos_id`` = 2 (also the padding id), ``unk_id`` = 0. The
    model file must contain the ``[MASK]`` piece (the original asserts it).
    """

    def __init__(self, model_file: str | Path) -> None:
        path = Path(model_file)
        if not path.is_file():
            raise FileNotFoundError(f"SentencePiece model {path} does not exist")
        self.path = path
        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        self.unk_id = self.sp.unk_id()
        self.bos_id = self.sp.bos_id()
        self.eos_id = self.sp.eos_id()
        if (self.unk_id, self.bos_id, self.eos_id) != (0, 1, 2):
            raise ValueError(
                f"{path}: expected <unk>/<s>/</s> ids 0/1/2, found {self.unk_id}/{self.bos_id}/{self.eos_id}"
            )
        self.mask_id = self._require_piece(MASK_PIECE)
        self.nl_id = self._require_piece(NEWLINE_PIECE)

    def _require_piece(self, piece: str) -> int:
        piece_id = self.sp.piece_to_id(piece)
        if piece_id == self.unk_id:
            raise ValueError(f"{self.path}: the SentencePiece model has no {piece} piece")
        return int(piece_id)

    @property
    def vocab_size(self) -> int:
        """Number of pieces (the model's vocabulary may be padded above it)."""
        return int(self.sp.get_piece_size())

    def encode(self, text: str | bytes) -> list[int]:
        """Token ids for the model: ``[BOS] + pieces(text with "\\n" -> "[NL]")``.

        Bytes are decoded as UTF-8 ignoring errors, like the original. The empty
        prompt encodes to ``[BOS]``.
        """
        return [self.bos_id, *self.encode_pieces_ids(text)]

    def encode_pieces_ids(self, text: str | bytes) -> list[int]:
        """Ids of ``text``'s pieces without the BOS (SentencePiece's own normalisation applies)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="ignore")
        return list(self.sp.encode(text.replace("\n", NEWLINE_PIECE), out_type=int))

    def pieces(self, ids: list[int]) -> list[str]:
        """Piece strings of ``ids`` (for diagnostics)."""
        return [self.sp.id_to_piece(i) for i in ids]

    def decode(self, ids: list[int]) -> str:
        """Detokenize: SentencePiece decode (control symbols vanish), then ``[NL]`` -> ``"\\n"``.

        Ids beyond the piece count (padding rows of a padded vocabulary) have no
        text and are dropped.
        """
        size = self.vocab_size
        return str(self.sp.decode([int(i) for i in ids if 0 <= int(i) < size])).replace(NEWLINE_PIECE, "\n")


#: Beside ``tokenizer.json``: which tokens are BOS/EOS and whether prompts start with BOS (Hugging Face's names).
TOKENIZER_CONFIG = "tokenizer_config.json"


def _token_text(value: Any) -> str | None:
    """A special token of ``tokenizer_config.json``: a string, or a dict with its ``content``."""
    if isinstance(value, dict):
        return str(value.get("content"))
    return None if value is None else str(value)


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer (``tokenizer.json``) with its ``tokenizer_config.json``.

    ``encode`` prepends BOS when ``add_bos_token`` says so (Llama, Gemma) and never
    appends EOS; the ``tokenizer.json`` post-processor is not used, so the
    config alone decides.
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _HF

        path = Path(path)
        folder = path if path.is_dir() else path.parent
        file = folder / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer file {file} does not exist")
        self.path = file
        self.tok = _HF.from_file(str(file))
        settings = folder / TOKENIZER_CONFIG
        config = json.loads(settings.read_text(encoding="utf-8")) if settings.is_file() else {}
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        self.bos_id = self._id(bos) if bos else -1
        if not eos:
            raise ValueError(f"{settings}: no eos_token (needed to stop and to pad)")
        self.eos_id = self._id(eos)
        self.add_bos = bool(config.get("add_bos_token", bos is not None)) and self.bos_id >= 0

    def _id(self, token: str) -> int:
        token_id = self.tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{self.path}: special token {token!r} is not in the vocabulary")
        return int(token_id)

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added tokens included."""
        return int(self.tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str | bytes) -> list[int]:
        """``[BOS] + ids(text)`` (BOS only when the model wants it)."""
        return ([self.bos_id] if self.add_bos else []) + self.encode_pieces_ids(text)

    def encode_pieces_ids(self, text: str | bytes) -> list[int]:
        """Ids of ``text`` without special tokens; bytes are decoded as UTF-8 ignoring errors."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="ignore")
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with special tokens skipped."""
        return str(self.tok.decode([int(i) for i in ids], skip_special_tokens=True))


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer at ``path``: ``tokenizer.json`` or a folder with one -> :class:`HFTokenizer`,
    otherwise a YaLM SentencePiece model (:class:`YalmTokenizer`).

    A tokenizer beside a store whose manifest recorded its digest is checked first
    (:func:`~robot_llm.llm.store.checksum.check_beside_store`).
    """
    path = Path(path)
    if (path.parent / "manifest.json").is_file() or (path / "manifest.json").is_file():
        # A tokenizer a store's manifest vouches for is checked before it is used (a store: the model stack).
        from robot_llm.llm.store.checksum import check_beside_store

        check_beside_store(path)
    if path.name == "tokenizer.json" or (path.is_dir() and (path / "tokenizer.json").is_file()):
        return HFTokenizer(path)
    return YalmTokenizer(path)
