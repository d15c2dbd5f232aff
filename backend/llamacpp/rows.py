"""A sequence's rows in one step: its feed put into the batch, then its rows with logits sampled.

A feed is the sequence's next known tokens (a prompt group, or its last sampled
and forced tokens), then any proposed ones. Once every known token is in, the
rows after the last known token and after each proposal carry logits. Row by row
the sequence's own sampling picks a token (the whole chain, the constraint's mask
included); a proposal is accepted while it equals that pick, so the output is
what plain decoding gives. The pick at the first row that disagrees (or after the
last proposal) is output too, and the cells of the proposals not accepted are
dropped (see Slots.keep_cells).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from backend.llamacpp.batch import Batch
from backend.llamacpp.sampling import TokenPicker
from backend.llamacpp.scheduler import Feed
from backend.llamacpp.sequence import Sequence
from backend.llamacpp.slots import Slots
from backend.types import Event


@dataclass(frozen=True)
class RowsToSample:
    sequence: Sequence
    rows: list[int]
    """The batch rows with logits: after its last known token, then after each proposed one."""
    proposed: tuple[int, ...]
    source: str = ""
    """Where the proposed tokens came from."""


def add_feed(batch: Batch, feed: Feed, every_row: bool = False) -> tuple[RowsToSample | None, list[int]]:
    """Adds `feed` to the batch: (its rows to sample, None while its prompt is still going in; the rows of
    every token fed, with logits on each, when `every_row`, else none)."""
    seq = feed.sequence
    tokens = [*seq.tokens[seq.cached : seq.cached + feed.count], *feed.proposed]
    complete = seq.cached + feed.count == len(seq.tokens)  # sample only once every known token is in
    logit_rows = 1 + len(feed.proposed) if complete else 0
    rows = batch.add(seq.slot, seq.cached, tokens, logit_rows=len(tokens) if every_row else logit_rows)
    seq.cached += feed.count  # the proposed tokens' cells count once accepted
    to_sample = rows[len(rows) - logit_rows :] if logit_rows else []
    return (RowsToSample(seq, to_sample, feed.proposed, feed.source) if to_sample else None), (rows if every_row else [])


def sample_rows(
    entry: RowsToSample, ctx, picker: TokenPicker, slots: Slots, eos: frozenset[int],
    take: Callable[[Sequence, int, Event], None],
) -> int:
    """Outputs the tokens sampling picks on `entry`'s rows (through `take`); returns how many proposals it accepted."""
    seq, output, proposed = entry.sequence, entry.sequence.output, entry.proposed
    output.draft_tokens += len(proposed)
    accepted = 0
    try:
        for i, row in enumerate(entry.rows):
            if i and output.constraint is not None:  # its matcher has taken the row before's token
                picker.fill_masks([(output.constraint, seq.slot)])
            token = picker.pick(ctx, row, seq.slot, seq.sampler, output)
            is_proposal = i < len(proposed) and token.token_id == proposed[i]
            take(seq, token.token_id, output.on_token(token, token.token_id in eos, is_proposal))
            if output.finished or not is_proposal:
                break
            accepted += 1
    finally:
        if proposed:
            slots.keep_cells(seq, seq.cached + accepted)
    return accepted
