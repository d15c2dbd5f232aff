"""The llama.cpp engine's KV-cache events: the cells another request could start from, in 64-token blocks.

Two kinds of cells are reusable by other requests (see backend.llamacpp.slots):
an idle slot's cached prefix, as far as its entry offers it (the prompt part, and
with prefix_cache_decoded the decoded answer; an owner's own output is otherwise
for its owner alone), and a live sequence's prompt
cells once computed (`min(cached, exact_rows)`), which a new request copies
from the running sequence. Both count, each as one holder in the ledger, so
the events follow exactly what `Slots._best_prefix` would offer. Blocks are
TILE_ROWS tokens: a cached prompt is reused in whole tiles (see layout.py).

A salt (default "") is mixed into a chain's first block, so prefixes kept apart
by salt never share a block name.
"""

from __future__ import annotations

from collections.abc import Iterable

from backend.common.cache_events import BlockLedger, CacheEventHub
from backend.llamacpp.layout import TILE_ROWS
from backend.llamacpp.prefix_cache import PrefixIndex
from backend.llamacpp.sequence import Sequence

BLOCK_SIZE = TILE_ROWS


def live_cells(seq: Sequence) -> int:
    """The prompt cells of a running sequence that another request may copy (as Slots._best_prefix has it)."""
    if not seq.placed or seq.needs_prefix:
        return 0
    return min(seq.cached, seq.exact_rows)


class LlamaCppCacheEvents:
    """Feeds the ledger from the prefix index's changes and the running sequences; engine thread only."""

    def __init__(self, index: PrefixIndex, medium: str, replay_batches: int) -> None:
        self._index = index
        index.changed = set()  # the index notes which slots it put, dropped or moved
        self.hub = CacheEventHub(BlockLedger(BLOCK_SIZE, medium), replay_batches)
        self._ledger = self.hub.ledger
        self._live: set[str] = set()

    def step_done(self, running: Iterable[Sequence]) -> None:
        """Called after every step and batch of commands: what changed goes out as one batch."""
        ledger, changed = self._ledger, self._index.changed
        assert changed is not None
        for slot in changed:
            entry = self._index.get(slot)
            if entry is None:
                ledger.let_go(("slot", slot))
            else:
                ledger.hold(("slot", slot), entry.offered, entry.cache_salt)
        changed.clear()
        live: set[str] = set()
        for seq in running:
            cells = live_cells(seq)
            if cells // BLOCK_SIZE != ledger.blocks(("seq", seq.id)):
                ledger.hold(("seq", seq.id), seq.tokens[:cells], seq.cache_salt)
            if cells >= BLOCK_SIZE:
                live.add(seq.id)
        for gone in self._live - live:
            ledger.let_go(("seq", gone))
        self._live = live
        self.hub.publish()

