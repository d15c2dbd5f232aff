"""Where each token of a tokenized text lies in that text, in bytes and in code points.

llama.cpp's tokenizer returns ids only; a token's piece is the bytes it stands for,
so walking the pieces over the text's UTF-8 gives the byte ranges. SentencePiece
tokenizers write a space before the first word that the text does not have: a
piece that does not match the text there is matched without its leading space.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

_CONTINUATION_BYTES = bytes(range(0x80, 0xC0))


@dataclass
class Offsets:
    byte_starts: list[int] = field(default_factory=list)
    byte_ends: list[int] = field(default_factory=list)
    char_starts: list[int] = field(default_factory=list)
    char_ends: list[int] = field(default_factory=list)


def _code_points(data: bytes) -> int:
    """Code points that begin in `data` (UTF-8 lead bytes and ASCII)."""
    return len(data.translate(None, _CONTINUATION_BYTES))


def _starts_inside_character(data: bytes, at: int) -> bool:
    return 0 < at < len(data) and 0x80 <= data[at] < 0xC0


def token_offsets(data: bytes, pieces: Sequence[bytes]) -> Offsets:
    """Byte and code-point ranges of each piece within `data` (the UTF-8 text that was tokenized).

    A token holding part of a character counts the whole character; a piece that is not
    in the text (a control token such as BOS) has an empty range where it stands.
    """
    offsets = Offsets()
    at = 0
    chars_before = 0  # code points that begin before `at`
    for piece in pieces:
        if piece and not data.startswith(piece, at) and piece[:1] == b" " and data.startswith(piece[1:], at):
            piece = piece[1:]  # SentencePiece's added leading space
        end = at + len(piece) if data.startswith(piece, at) else at
        began = _code_points(data[at:end])
        char_start = chars_before - 1 if _starts_inside_character(data, at) else chars_before
        offsets.byte_starts.append(at)
        offsets.byte_ends.append(end)
        offsets.char_starts.append(char_start if end > at else chars_before)
        offsets.char_ends.append(chars_before + began)
        at, chars_before = end, chars_before + began
    return offsets
