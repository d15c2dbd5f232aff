"""The rows of one llama_decode: which tokens of which sequences, at which positions, with logits where.

Each sequence adds a run of consecutive tokens to its own cache stream; the
batch asks for logits on the last `logit_rows` rows of the run and returns
their row indices, which is where the sampler reads them after the decode.
One row with logits is a plain decoding step; several let a step check tokens
fed ahead of sampling, with logits after each one.
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
        return self._batch.n_tokens

    def clear(self) -> None:
        self._batch.n_tokens = 0
        self.logit_rows = 0

    def add(self, slot: int, position: int, tokens: Sequence[int], logit_rows: int) -> list[int]:
        """Adds `tokens` to `slot`'s stream from `position`; returns the indices of the rows with logits."""
        batch, first = self._batch, self._batch.n_tokens
        assert first + len(tokens) <= self.capacity and 0 <= logit_rows <= len(tokens)
        with_logits_from = first + len(tokens) - logit_rows
        for i, token in enumerate(tokens):
            row = first + i
            batch.token[row] = token
            batch.pos[row] = position + i
            batch.n_seq_id[row] = 1
            batch.seq_id[row][0] = slot
            batch.logits[row] = row >= with_logits_from
        batch.n_tokens = first + len(tokens)
        self.logit_rows += logit_rows
        return list(range(with_logits_from, batch.n_tokens))

    def decode(self, ctx: llama_cpp.llama_context_p) -> int:
        """Runs the model over every row; 0 on success, llama.cpp's status otherwise."""
        return llama_cpp.llama_decode(ctx, self._batch)

    def free(self) -> None:
        llama_cpp.llama_batch_free(self._batch)
