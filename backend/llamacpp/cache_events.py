"""The llama.cpp engine's KV-cache events: the cells another request could start from, in chained blocks.

Two kinds of cells are reusable by other requests (see backend.llamacpp.slots):
an idle slot's cached prefix, as far as its entry offers it, and a live
sequence's shared cells once computed (Slots.offered), which a new request
copies from the running sequence. Both count, each as one holder in the ledger,
so the events follow exactly what `Slots._best_prefix` would offer.

Blocks are BLOCK_SIZE tokens, vLLM's default block: reuse is to the token, and a
router scores a prompt by the blocks it finds, so a trailing part block is
reusable but not reported (as vLLM reports only full blocks). With
prefix_cache_exact a cached prompt is reused in whole tiles (see layout.py), so
blocks are EXACT_BLOCK_SIZE (TILE_ROWS) tokens.

A salt (default "") is mixed into a chain's first block, so prefixes kept apart
by salt never share a block name.
"""

from __future__ import annotations

from collections.abc import Iterable

from backend.common.cache_events import BlockLedger, CacheEventHub
from backend.llamacpp.layout import TILE_ROWS
from backend.llamacpp.sequence import Sequence
from backend.llamacpp.slots import Slots

BLOCK_SIZE = 16
EXACT_BLOCK_SIZE = TILE_ROWS


def block_size(exact: bool) -> int:
    """Tokens per block: vLLM's default block to the token, an attention tile with prefix_cache_exact."""
    return EXACT_BLOCK_SIZE if exact else BLOCK_SIZE


class LlamaCppCacheEvents:
    """Feeds the ledger from the prefix index's changes and the running sequences; engine thread only."""

    def __init__(self, slots: Slots, medium: str, replay_batches: int) -> None:
        self._slots = slots
        self._index = slots.prefixes
        self._index.changed = set()  # the index notes which slots it put, dropped or moved
        self.hub = CacheEventHub(BlockLedger(block_size(slots.exact), medium), replay_batches)
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
        size = ledger.block_size
        for seq in running:
            cells = self._slots.offered(seq)
            if cells // size != ledger.blocks(("seq", seq.id)):
                ledger.hold(("seq", seq.id), seq.tokens[:cells], seq.cache_salt)
            if cells >= size:
                live.add(seq.id)
        for gone in self._live - live:
            ledger.let_go(("seq", gone))
        self._live = live
        self.hub.publish()

