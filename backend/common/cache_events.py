"""KV-cache events: what a router needs to know about which prompt prefixes a replica holds.

The engine names each reusable run of cached tokens by a holder key (a cache
slot's idle prefix, a live sequence's computed prompt) and `BlockLedger` cuts
it into full blocks of `block_size` tokens, each named by a chained hash. A
block is stored while any holder has it and removed when the last one lets
go, so a subscriber that applies the events in order holds exactly the set of
blocks the engine would reuse for another request. The event kinds and fields
are vLLM's (BlockStored, BlockRemoved, AllBlocksCleared), which llm-d's
precise prefix scorer and SGLang's gateway read.

`CacheEventHub` numbers the batches, keeps the latest for replay, hands each
to its listeners (the ZMQ publisher, gRPC watchers) without blocking the engine
thread, and takes a snapshot consistent with a sequence number for a late
subscriber.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec

ROOT_SEED = b"tokenspout-kv-v1"
"""What the first block of every chain hashes in place of a parent."""


def block_hash(parent: int | None, tokens: Sequence[int], salt: str = "") -> int:
    """A block's 64-bit name: blake2b over the parent's hash (ROOT_SEED and the salt for a first block) and
    the token ids as little-endian uint32. A salt changes every hash of its chain, as vLLM's extra_keys do."""
    head = ROOT_SEED + salt.encode() if parent is None else parent.to_bytes(8, "big")
    digest = hashlib.blake2b(head + struct.pack(f"<{len(tokens)}I", *tokens), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def chain_hashes(tokens: Sequence[int], block_size: int, salt: str = "") -> list[int]:
    """The hashes of the full blocks of `tokens` (a trailing part block has none)."""
    return chain_hashes_from((), tokens, block_size, salt)


class BlockStored(msgspec.Struct, frozen=True, tag=True, array_like=True):
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    """The block before the first of these (None: they start a chain)."""
    token_ids: tuple[int, ...]
    """block_size tokens per hash, in order."""
    block_size: int
    medium: str
    salt: str = ""
    """The chain's salt when these start a salted chain (vLLM's extra_keys cache_salt)."""


class BlockRemoved(msgspec.Struct, frozen=True, tag=True, array_like=True):
    block_hashes: tuple[int, ...]
    medium: str


class AllBlocksCleared(msgspec.Struct, frozen=True, tag=True, array_like=True):
    pass


CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class CacheEventBatch(msgspec.Struct, frozen=True, array_like=True):
    sequence: int
    """Gapless from 0 in one server's life; a snapshot carries the last batch it includes."""
    ts: float
    events: tuple[CacheEvent, ...]
    snapshot: bool = False
    """The full state (AllBlocksCleared, then every block) as of `sequence`."""


@dataclass(frozen=True)
class _Chain:
    tokens: tuple[int, ...]
    hashes: tuple[int, ...]
    salt: str


class BlockLedger:
    """Which blocks the holders hold; engine thread only, but for `snapshot` (read under the hub's lock).

    `hold` and `let_go` only note what changed; `flush` applies it and returns the net events, so a
    holder handing its blocks to another (a sequence ending, its cells kept as an idle prefix) between
    two flushes publishes nothing."""

    def __init__(self, block_size: int, medium: str) -> None:
        self.block_size = block_size
        self.medium = medium
        self._chains: dict[Hashable, _Chain] = {}
        self._counts: Counter[int] = Counter()
        self._pending: dict[Hashable, _Chain | None] = {}

    def blocks(self, key: Hashable) -> int:
        """Full blocks `key` holds, counting what is pending."""
        chain = self._pending[key] if key in self._pending else self._chains.get(key)
        return len(chain.hashes) if chain else 0

    def hold(self, key: Hashable, tokens: Sequence[int], salt: str = "") -> None:
        """`key` now holds the full blocks of `tokens` (and nothing else)."""
        size = self.block_size
        usable = tuple(tokens[: len(tokens) - len(tokens) % size])
        old = self._pending[key] if key in self._pending else self._chains.get(key)
        if old is not None and old.tokens == usable and old.salt == salt:
            return
        if not usable:
            self.let_go(key)
            return
        if old is not None and old.salt == salt and usable[: len(old.tokens)] == old.tokens:
            hashes = old.hashes + tuple(chain_hashes_from(old.hashes, usable[len(old.tokens):], size, salt))
        else:
            hashes = tuple(chain_hashes(usable, size, salt))
        self._pending[key] = _Chain(usable, hashes, salt)

    def let_go(self, key: Hashable) -> None:
        if key in self._chains or self._pending.get(key) is not None:
            self._pending[key] = None

    def flush(self) -> list[CacheEvent]:
        """Applies what changed since the last flush: the blocks no holder has any more (removed), then
        those that no holder had (stored, as runs along their chains)."""
        if not self._pending:
            return []
        pending, self._pending = self._pending, {}
        touched: dict[int, int] = {}  # hash -> holders before
        for key, chain in pending.items():
            for held in (self._chains.get(key), chain):
                touched.update((h, self._counts[h]) for h in (held.hashes if held else ()) if h not in touched)
        for key, chain in pending.items():
            old = self._chains.pop(key, None)
            if old is not None:
                self._counts.subtract(old.hashes)
            if chain is not None:
                self._chains[key] = chain
                self._counts.update(chain.hashes)
        gone = [h for h, before in touched.items() if before > 0 and self._counts[h] <= 0]
        for h in gone:
            del self._counts[h]
        events: list[CacheEvent] = []
        if gone:
            events.append(BlockRemoved(tuple(gone), self.medium))
        fresh = {h for h, before in touched.items() if before <= 0 and self._counts[h] > 0}
        for chain in (c for c in pending.values() if c is not None):
            events += self._stored_runs(chain, fresh)
        return events

    def snapshot(self) -> list[CacheEvent]:
        """Every block held, as BlockStored runs (after an AllBlocksCleared)."""
        unsent = set(self._counts)
        events: list[CacheEvent] = [AllBlocksCleared()]
        for chain in self._chains.values():
            events += self._stored_runs(chain, unsent)
        return events

    def held(self) -> dict[int, tuple[int | None, tuple[int, ...]]]:
        """Every block held: hash -> (parent hash, its tokens); what a subscriber should have rebuilt."""
        view: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        size = self.block_size
        for chain in self._chains.values():
            for i, h in enumerate(chain.hashes):
                view[h] = (chain.hashes[i - 1] if i else None, chain.tokens[i * size : (i + 1) * size])
        return view

    def _stored_runs(self, chain: _Chain, wanted: set[int]) -> list[CacheEvent]:
        """The wanted blocks of a chain as BlockStored events, one per contiguous run; each is taken out of
        `wanted` so a block two chains share goes out once."""
        events: list[CacheEvent] = []
        size, run = self.block_size, []
        for i, h in enumerate((*chain.hashes, None)):
            if h is not None and h in wanted:
                wanted.discard(h)
                run.append(i)
                continue
            if run:
                first, last = run[0], run[-1]
                events.append(BlockStored(
                    chain.hashes[first : last + 1], chain.hashes[first - 1] if first else None,
                    chain.tokens[first * size : (last + 1) * size], size, self.medium, chain.salt if not first else "",
                ))
                run = []
        return events


def chain_hashes_from(previous: Sequence[int], tokens: Sequence[int], block_size: int, salt: str) -> list[int]:
    """The hashes of more full blocks continuing a chain whose hashes so far are `previous`."""
    hashes: list[int] = []
    parent = previous[-1] if previous else None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size], salt)
        hashes.append(parent)
    return hashes


Listener = Callable[[CacheEventBatch], None]
"""Called with each batch on the engine thread, under the hub's lock: must not block."""


class CacheWatching(Protocol):
    """What a watcher of an engine's KV-cache events needs: the hub, or its stand-in in a front end."""

    @property
    def oldest_kept(self) -> int: ...

    async def watch(self, listener: Listener, start: int | None = None, snapshot: bool = False) -> bool:
        """Adds a listener: first a snapshot when asked, else the kept batches from `start` on, then every new
        batch, in order; False (not added) when `start` is no longer kept."""
        ...

    def unsubscribe(self, listener: Listener) -> None: ...


class CacheEventHub:
    """Numbers the ledger's batches, keeps the last `replay_batches` for late subscribers, and hands each to
    the listeners. Thread-safe: the engine thread publishes, any thread replays or snapshots."""

    def __init__(self, ledger: BlockLedger, replay_batches: int = 10_000) -> None:
        self.ledger = ledger
        self.block_size = ledger.block_size
        self._lock = threading.Lock()
        self._recent: deque[CacheEventBatch] = deque(maxlen=replay_batches)
        self._listeners: list[Listener] = []
        self._next = 0
        self._emit([AllBlocksCleared()])  # batch 0: whatever a subscriber knew of this replica is gone

    @property
    def last_sequence(self) -> int:
        return self._next - 1

    @property
    def oldest_kept(self) -> int:
        with self._lock:
            return self._recent[0].sequence if self._recent else self._next

    def publish(self) -> None:
        """Flushes the ledger and sends out the batch, if anything changed (engine thread)."""
        with self._lock:
            events = self.ledger.flush()
            if events:
                self._emit(events)

    def _emit(self, events: list[CacheEvent]) -> None:
        batch = CacheEventBatch(self._next, time.time(), tuple(events))
        self._next += 1
        self._recent.append(batch)
        for listener in self._listeners:
            listener(batch)

    def subscribe(self, listener: Listener, start: int | None = None, snapshot: bool = False) -> bool:
        """Adds a listener. It first gets, in order and before any new batch, a snapshot when asked, else the
        kept batches from `start` on; False (and not added) when `start` is no longer kept: ask for a snapshot."""
        with self._lock:
            if snapshot:
                listener(self._snapshot())
            elif start is not None:
                replay = self._replay(start)
                if replay is None:
                    return False
                for batch in replay:
                    listener(batch)
            self._listeners.append(listener)
            return True

    async def watch(self, listener: Listener, start: int | None = None, snapshot: bool = False) -> bool:
        """`subscribe`, awaited: as a watcher of an engine in another process subscribes (backend.process.remote)."""
        return self.subscribe(listener, start, snapshot)

    def unsubscribe(self, listener: Listener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def replay(self, start: int) -> list[CacheEventBatch] | None:
        with self._lock:
            return self._replay(start)

    def snapshot(self) -> CacheEventBatch:
        with self._lock:
            return self._snapshot()

    def _replay(self, start: int) -> list[CacheEventBatch] | None:
        if start > self._next or start < 0:
            return None
        if start < self._next and (not self._recent or self._recent[0].sequence > start):
            return None
        return [batch for batch in self._recent if batch.sequence >= start]

    def _snapshot(self) -> CacheEventBatch:
        return CacheEventBatch(self._next - 1, time.time(), tuple(self.ledger.snapshot()), snapshot=True)
