"""A finished sequence's generated tail, computed again as prompt rows so later prompts may share it.

llama.cpp computes a token decoded alone with other kernels than the same token
inside a prompt group (see backend.llamacpp.layout), so the cells a sequence
decoded are not what a cold prompt resending that answer computes: reusing them
as they are (as llama-server does) can change greedy output. So when a sequence
ends, its entry keeps every token it ended with, and what a chat's template
writes after an answer (GenerationRequest.turn_end); a later engine step
(one with nothing else to do), before admitting anything, computes the rows not yet
computed as a prompt the way the next turn's layout computes its history: in tiled groups, or, for a
conversation still shorter than a tile, in small ones; each group in a
llama_decode of its own. The whole entry is then shared, and a chat's next turn
computes only its new message, with the greedy output a cold run gives.

Only a chat's sequences are kept so (those whose request carries turn_end): its
next turn lays out this history predictably, tiled from the start of its new
message back. A plain prompt's next request could lay the same tokens out
either way, and computing them again tiled would lose the small groups its
prompt's last rows were computed in, which a repeat of that prompt reuses.

The price is one prompt pass over the answer, wasted when no next turn comes.
On a CPU a prompt row costs nearly what a token decoded in a batch of 8 does:
computing every answer again as soon as it ended cut the decode tokens/s of 8
concurrent chats to 0.59x, and within a tenth of a busy engine's time still to
0.91x, for next turns that rarely found their answer done (docs/benchmarks.md).
So it is done while the engine has nothing else to do, one answer a step, so
that a request arriving meanwhile waits for one pass at most: a chat's next
turn, sent after its caller read the answer, then finds it complete. While the
engine is busy, only an answer that a waiting request continues is computed,
before that request is admitted: its next turn would compute those rows anyway
(until then the prefix index shares only an entry's prompt rows).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import llama_cpp

from backend.common.tokens import common_prefix
from backend.llamacpp.batch import Batch
from backend.llamacpp.layout import TILE_ROWS, PromptLayout
from backend.llamacpp.sequence import Sequence
from backend.llamacpp.slots import Slots

log = logging.getLogger(__name__)

def to_retile(slots: Slots, idle: bool, waiting: Iterable[Sequence]) -> list[int]:
    """The slots whose tails to compute now: one while the engine is idle; else those a waiting request
    continues past their prompt rows (its next turn would compute those rows anyway, in the same layout)."""
    ended = slots.prefixes.ended()
    if idle or not ended:
        return ended[:1]
    wanted = []
    for slot in ended:
        entry = slots.prefixes.get(slot)
        assert entry is not None
        if any(seq.cache_salt == entry.cache_salt and common_prefix(entry.ended_with, seq.tokens) > entry.shared
               for seq in waiting):
            wanted.append(slot)
    return wanted


def retile_ended(slots: Slots, batch: Batch, ctx: llama_cpp.llama_context_p, batch_tokens: int,
                 which: list[int]) -> int:
    """Computes the generated tails at `which` as prompt rows; returns the rows computed."""
    computed = 0
    for slot in which:
        entry = slots.prefixes.get(slot)
        assert entry is not None
        length = len(entry.ended_with)
        # The layout the next turn gives this history (PromptLayout.of, its last message starting here).
        tiled = length >= TILE_ROWS  # (Slots keeps tails only where batch_tokens allows tiles)
        layout = PromptLayout(length, tiled_until=length if tiled else 0)
        start, tokens = slots.start_retile(slot, tiled)
        position = start
        while position < length:
            count = layout.next_group(position, batch_tokens)
            batch.clear()
            batch.add(slot, position, tokens[position : position + count], [False] * count)
            status = batch.decode(ctx)
            if status != 0:
                log.warning("computing a finished sequence's tail as a prompt failed (status %d): its cells go",
                            status)
                slots.forget(slot)
                break
            position += count
        else:
            slots.retiled(slot, tokens, layout.tiled_until)
        computed += position - start
    return computed
