"""SentencePiece tokenizer with YaLM's conventions (docs/yalm-model.md §6)."""

from __future__ import annotations

from pathlib import Path

import sentencepiece as spm

NEWLINE_PIECE = "[NL]"
MASK_PIECE = "[MASK]"


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
