"""A sequence's rows in one step: its feed put into the batch, then its rows with logits sampled.

A feed is the sequence's next known tokens (a prompt group, or its last sampled
and forced tokens), then any proposed ones. Once every known token is in, the
row before each proposed token that plain decoding would sample, and the row
after the last, carry logits. Row by row the sequence's own sampling picks a
token (the whole chain, the constraint's mask included); a proposal is accepted
while it equals that pick, so the output is what plain decoding gives. A
proposed token the grammar forces is taken as plain decoding takes it, without
sampling. The pick at the first row that disagrees (or after the last proposal)
is output too, and the cells of the proposals not accepted are dropped (see
Slots.keep_cells).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import llama_cpp

from backend.events import Event
from backend.llamacpp.batch import Batch
from backend.llamacpp.prompt_logprobs import wants_prompt_logprobs
from backend.llamacpp.sampling import TokenPicker
from backend.llamacpp.scheduler import Feed
from backend.llamacpp.sequence import Sequence
from backend.llamacpp.slots import Slots


@dataclass(frozen=True)
class RowsToSample:
    sequence: Sequence
    rows: list[int]
    """The batch rows with logits: after its last known token, then after each proposed one that is
    followed by a sampled token (the last always is)."""
    proposed: tuple[int, ...]
    source: str = ""
    """Where the proposed tokens came from."""
    forced: tuple[bool, ...] = ()
    """Per proposed token: forced by the grammar, so taken without sampling (empty: none is)."""

    def sampled(self, accepted: int) -> tuple[int, int]:
        """(proposed, accepted) counting only the tokens sampling decided: what the check taught about
        the proposals' source (a forced token is accepted whenever the ones before it were)."""
        forced = sum(self.forced)
        return len(self.proposed) - forced, accepted - sum(self.forced[:accepted])


def fill_batch(
    batch: Batch, slots: Slots, feeds: list[Feed],
) -> tuple[list[RowsToSample], list[tuple[Sequence, int, list[int]]]]:
    """Puts this step's feeds into the (cleared) batch: (the rows to sample, and for each prompt that scores
    its tokens (prompt logprobs), its first position and its rows, every one with logits)."""
    batch.clear()
    to_sample, to_score = [], []
    for feed in feeds:
        scores = feed.prefill and wants_prompt_logprobs(feed.sequence)
        position = feed.sequence.cached
        entry, every_row = add_feed(batch, slots, feed, scores)
        if scores:
            to_score.append((feed.sequence, position, every_row))
        if entry is not None:
            to_sample.append(entry)
    return to_sample, to_score


def add_feed(batch: Batch, slots: Slots, feed: Feed, every_row: bool = False) -> tuple[RowsToSample | None, list[int]]:
    """Adds `feed` to the batch: (its rows to sample, None while its prompt is still going in; the rows of
    every token fed, with logits on each, when `every_row`, else none)."""
    seq = feed.sequence
    tokens = [*seq.tokens[seq.cached : seq.cached + feed.count], *feed.proposed]
    complete = seq.cached + feed.count == len(seq.tokens)  # sample only once every known token is in
    # From the last known token's row on: whether a token is sampled after the row (the first proposed one
    # and the one after the last always are; a forced one never is).
    forced = feed.forced or (False,) * len(feed.proposed)
    sampled_after = [True, *(not f for f in forced[1:]), True][: len(feed.proposed) + 1]
    sampled_after = sampled_after if complete else []
    logits = [every_row] * (len(tokens) - len(sampled_after)) + [every_row or s for s in sampled_after]
    first = batch.rows
    rows = batch.add(seq.slot, seq.cached, tokens, logits)
    slots.advance(seq, feed.count)  # the proposed tokens' cells count once accepted
    to_sample = [first + feed.count - 1 + i for i, sampled in enumerate(sampled_after) if sampled]
    entry = RowsToSample(seq, to_sample, feed.proposed, feed.source, feed.forced) if to_sample else None
    return entry, (rows if every_row else [])


def sample_rows(
    entry: RowsToSample, ctx: llama_cpp.llama_context_p, picker: TokenPicker, slots: Slots, eos: frozenset[int],
    take: Callable[[Sequence, int, Event], None],
) -> int:
    """Outputs the tokens sampling picks on `entry`'s rows (through `take`); returns how many proposals it accepted."""
    seq, output, proposed = entry.sequence, entry.sequence.output, entry.proposed
    output.draft_tokens += len(proposed)
    accepted = 0
    rows = iter(entry.rows)
    try:
        for i in range(len(proposed) + 1):
            if i < len(proposed) and entry.forced and entry.forced[i]:  # taken as plain decoding takes it
                take_forced(seq, proposed[i], picker, eos, take, proposed=True)
                if output.finished:
                    break
                accepted += 1
                continue
            if i and output.constraint is not None:  # its matcher has taken the token before
                picker.fill_masks([(output.constraint, seq.slot)])
            token = picker.pick(ctx, next(rows), seq.slot, seq.sampler, output)
            is_proposal = i < len(proposed) and token.token_id == proposed[i]
            take(seq, token.token_id, output.on_token(token, token.token_id in eos, is_proposal))
            if output.finished or not is_proposal:
                break
            accepted += 1
    finally:
        if proposed:
            slots.keep_cells(seq, seq.cached + accepted)
    return accepted


def take_forced_run(
    seq: Sequence, max_forced: int, picker: TokenPicker, eos: frozenset[int], take: Callable[[Sequence, int, Event], None],
) -> None:
    """Outputs the tokens the grammar now forces, up to `max_forced` (no choice left: sampling is skipped)."""
    output = seq.output
    if not output.finished and output.constraint is not None:
        for forced in output.constraint.forced_tokens(max_forced):
            take_forced(seq, forced, picker, eos, take)
            if output.finished:
                break


def take_forced(
    seq: Sequence, token: int, picker: TokenPicker, eos: frozenset[int], take: Callable[[Sequence, int, Event], None],
    proposed: bool = False,
) -> None:
    """Outputs a token the grammar forces, unsampled (penalties and DRY still see it); `proposed`: it was
    among a check's proposed tokens."""
    seq.sampler.accept(token)
    take(seq, token, seq.output.on_token(picker.forced(token), token in eos, proposed))
