"""WatchCacheEvents: the KV-cache events as a gRPC server stream, for routers that speak gRPC.

Each watcher is a listener on the engine's CacheEventHub (or, with the engine in
a process of its own, on its stand-in here: backend.process.remote): the engine
thread appends batches to the watcher's deque and wakes its coroutine (never
waiting). A watcher that falls more than `max_behind` batches behind is not
cut off: the batches it missed are replaced by a fresh snapshot (snapshot =
true), so it always ends up with the server's exact state. When the engine's
process dies, its batches' numbering starts again with the next one: every
watch ends with UNAVAILABLE (ENGINE_DOWN), to be started again. Watchers are
not calls in flight for the drain; the server ends them cleanly when it closes.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncGenerator

from backend import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, CacheEventBatch, CacheWatching
from service.errors import FieldViolation, engine_down, out_of_range, unimplemented
from tokenspout.v1 import generation_pb2 as pb

MAX_BEHIND = 4096
"""Batches a watcher may have unsent before it is given a snapshot instead."""


def event_pb(event: CacheEvent) -> pb.CacheEvent:
    if isinstance(event, BlockStored):
        return pb.CacheEvent(block_stored=pb.BlockStored(
            block_hashes=event.block_hashes, parent_block_hash=event.parent_block_hash, token_ids=event.token_ids,
            block_size=event.block_size, medium=event.medium,
        ))
    if isinstance(event, BlockRemoved):
        return pb.CacheEvent(block_removed=pb.BlockRemoved(block_hashes=event.block_hashes, medium=event.medium))
    assert isinstance(event, AllBlocksCleared)
    return pb.CacheEvent(all_blocks_cleared=pb.AllBlocksCleared())


def batch_pb(batch: CacheEventBatch) -> pb.WatchCacheEventsResponse:
    return pb.WatchCacheEventsResponse(sequence=batch.sequence, timestamp=batch.ts, events=[event_pb(e) for e in batch.events],
                              snapshot=batch.snapshot)


class _Watcher:
    def __init__(self, loop: asyncio.AbstractEventLoop, max_behind: int) -> None:
        self.batches: collections.deque[CacheEventBatch] = collections.deque()
        self.wake = asyncio.Event()
        self.behind = False
        self.engine_gone = False
        self._loop = loop
        self._max_behind = max_behind

    def fresh(self) -> _Watcher:
        return _Watcher(self._loop, self._max_behind)

    def offer(self, batch: CacheEventBatch | None) -> None:
        """The hub's listener (engine thread, or the subscribing thread for a replay): never waits. None: the
        engine's process died."""
        if batch is None:
            self.engine_gone = True
        elif self.behind:
            return
        elif len(self.batches) >= self._max_behind:
            self.behind = True
        else:
            self.batches.append(batch)
        self._loop.call_soon_threadsafe(self.wake.set)


class CacheWatches:
    def __init__(self, hub: CacheWatching | None, engine: str, max_behind: int = MAX_BEHIND) -> None:
        self._hub = hub
        self._engine = engine
        self._max_behind = max_behind
        self._closing = asyncio.Event()
        self.watching = 0

    def end_all(self) -> None:
        """The server is closing: every watch ends (status OK) after sending what it has."""
        self._closing.set()

    async def watch(self, request: pb.WatchCacheEventsRequest) -> AsyncGenerator[pb.WatchCacheEventsResponse, None]:
        hub = self._hub
        if hub is None:
            why = ("the exllamav2 engine publishes no cache events" if self._engine == "exllamav2"
                   else "cache events are off on this server (the cache_events setting)")
            raise unimplemented([FieldViolation("WatchCacheEvents", why)])
        watcher = _Watcher(asyncio.get_running_loop(), max(self._max_behind, 1))
        start = request.start_sequence if request.HasField("start_sequence") else None
        if not await hub.watch(watcher.offer, start=start, snapshot=request.snapshot):
            raise out_of_range("start_sequence", f"batch {start} is no longer kept (the oldest kept is "
                                                 f"{hub.oldest_kept}); ask for a snapshot")
        self.watching += 1
        try:
            while not self._closing.is_set():
                while watcher.batches:
                    yield batch_pb(watcher.batches.popleft())
                if watcher.engine_gone:
                    raise engine_down("the engine's process exited: its cache events start again; watch again")
                if watcher.behind:
                    hub.unsubscribe(watcher.offer)
                    watcher = watcher.fresh()
                    await hub.watch(watcher.offer, snapshot=True)
                    continue
                watcher.wake.clear()
                if watcher.batches or watcher.behind or watcher.engine_gone:
                    continue
                closing = asyncio.ensure_future(self._closing.wait())
                woken = asyncio.ensure_future(watcher.wake.wait())
                try:
                    await asyncio.wait((closing, woken), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    closing.cancel()
                    woken.cancel()
        finally:
            self.watching -= 1
            hub.unsubscribe(watcher.offer)
