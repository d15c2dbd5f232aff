"""The rows of one llama_decode: which tokens of which sequences, at which positions, with logits where.

Each sequence adds a run of consecutive tokens to its own cache stream; the
batch asks for logits on the rows flagged for them and returns their row
indices, which is where the sampler reads them after the decode. One row with
logits (the last) is a plain decoding step; several let a step check tokens fed
ahead of sampling, with logits after each one a sample is drawn after.
"""

from __future__ import annotations

from collections.abc import Sequence

import llama_cpp


class Batch:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._batch = llama_cpp.llama_batch_init(capacity, 0, 1)
        self.logit_rows = 0

    @property
    def rows(self) -> int:
        rows: int = self._batch.n_tokens
        return rows

    def clear(self) -> None:
        self._batch.n_tokens = 0
        self.logit_rows = 0

    def add(self, slot: int, position: int, tokens: Sequence[int], logits: Sequence[bool]) -> list[int]:
        """Adds `tokens` to `slot`'s stream from `position`, with logits on the rows `logits` flags; returns
        the indices of those rows."""
        batch, first = self._batch, self._batch.n_tokens
        assert first + len(tokens) <= self.capacity and len(logits) == len(tokens)
        for i, (token, with_logits) in enumerate(zip(tokens, logits)):
            row = first + i
            batch.token[row] = token
            batch.pos[row] = position + i
            batch.n_seq_id[row] = 1
            batch.seq_id[row][0] = slot
            batch.logits[row] = with_logits
        batch.n_tokens = first + len(tokens)
        rows = [first + i for i, with_logits in enumerate(logits) if with_logits]
        self.logit_rows += len(rows)
        return rows

    def decode(self, ctx: llama_cpp.llama_context_p) -> int:
        """Runs the model over every row; 0 on success, llama.cpp's status otherwise."""
        status: int = llama_cpp.llama_decode(ctx, self._batch)
        return status

    def free(self) -> None:
        llama_cpp.llama_batch_free(self._batch)
