"""Prompt logprobs: the logprob of every prompt token given the ones before it.

A sequence that asks for them computes its whole prompt (no cached prefix: cached
rows have no logits, see Slots) with logits on every row; the row at position p
scores the token at p + 1. The first token has nothing before it, so no logprob.
The scored tokens go out with the sequence's first event.
"""

from __future__ import annotations

from collections.abc import Sequence as Rows

import llama_cpp

from backend.common.logprobs import with_logprobs
from backend.events import GeneratedToken
from backend.llamacpp.model import GgufModel
from backend.llamacpp.sequence import Sequence


def wants_prompt_logprobs(seq: Sequence) -> bool:
    return seq.request.prompt_logprobs >= 0


def score_rows(ctx: llama_cpp.llama_context_p, model: GgufModel, seq: Sequence, start: int, rows: Rows[int]) -> None:
    """Scores the prompt tokens after the rows fed from position `start` (`rows`: their logits' indices).
    Rows fed again (back from preemption) are not scored twice."""
    scored = seq.prompt_scores
    if not scored:
        scored.append(GeneratedToken(seq.tokens[0], model.pieces[seq.tokens[0]]))
    for offset, row in enumerate(rows):
        position = start + offset + 1  # the token this row's logits predict
        if position >= seq.prompt_length:
            break
        if position != len(scored):
            continue
        scored.append(with_logprobs(seq.tokens[position], model.logits_row(ctx, row), model.pieces.__getitem__,
                                    seq.request.prompt_logprobs))
    if len(scored) == seq.prompt_length:
        seq.output.prompt_tokens = tuple(scored)
