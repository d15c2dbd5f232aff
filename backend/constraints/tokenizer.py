"""An llguidance tokenizer built from an engine's own vocabulary.

Any engine can describe its vocabulary as token bytes plus which ids are
special, which end generation, and how to encode bytes; that is all
llguidance needs, so llama.cpp and exllamav2 share this code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import llguidance
from llguidance import TokenizerWrapper


class _Vocabulary:
    """The duck-typed tokenizer object llguidance's TokenizerWrapper reads."""

    def __init__(
        self,
        tokens: list[bytes],
        eos_token_id: int,
        bos_token_id: int | None,
        special_token_ids: list[int],
        encode: Callable[[bytes], list[int]],
    ) -> None:
        self.tokens = tokens
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.special_token_ids = special_token_ids
        self._encode = encode

    def __call__(self, data: bytes) -> list[int]:
        return self._encode(data)


def build_tokenizer(
    token_bytes: Sequence[bytes],
    special_token_ids: Sequence[int],
    eos_token_ids: Sequence[int],
    bos_token_id: int | None,
    encode: Callable[[bytes], list[int]],
) -> llguidance.LLTokenizer:
    """Builds the tokenizer (about a second for a 50k vocabulary: build it once per model).

    `token_bytes[i]` is what token i decodes to; special tokens are marked with
    a 0xFF prefix, llguidance's convention, so a grammar never produces them as text.
    """
    special = set(special_token_ids)
    tokens = [b"\xff" + piece if i in special else piece for i, piece in enumerate(token_bytes)]
    vocabulary = _Vocabulary(tokens, eos_token_ids[0], bos_token_id, sorted(special), encode)
    return llguidance.LLTokenizer(TokenizerWrapper(vocabulary), eos_token=list(eos_token_ids))
