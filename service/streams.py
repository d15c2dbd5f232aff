"""Per-request event streams between the engine thread and the gRPC handlers.

The engine delivers events from its own thread, a step's events for every
stream in one call; `EventRelay` moves them onto the event loop, waking it
once per step rather than once per event or per stream. Each
request's `RequestStream` is a bounded buffer: when a caller reads slowly and
its buffer fills, its sequence is paused in the engine (cache kept, other
streams unaffected) and resumed once the caller has read half of it; while
paused it gives up its batch slot to any request waiting for one, and comes
back with the same stream when resumed (see backend.llamacpp.core). An
engine that cannot pause one sequence (exllamav2) runs it to the end, so the
buffer then holds at most max_new_tokens events.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
from typing import Any

from backend import Engine, ErrorEvent, Event, EventSink, TokenEvent


class _Interrupt:
    """Wakes a handler waiting for events: the server has ended its call (see Lifecycle.end_running)."""


_INTERRUPT = _Interrupt()


class RequestStream:
    """One request's events on the event loop. A deque and one waiting future rather than an asyncio.Queue:
    at hundreds of streams the queue's bookkeeping per event was a visible share of the loop's time."""

    def __init__(self, engine: Engine, request_id: str, buffer_events: int, samples: int = 1) -> None:
        self.request_id = request_id
        self._engine = engine
        self._unfinished = samples
        """Samples the engine has not ended yet: at 0 (or an error) it is done with the request."""
        self._on_engine_done: Callable[[], None] | None = None
        self._events: collections.deque[Event | _Interrupt] = collections.deque()
        self._waiter: asyncio.Future[bool] | None = None
        self._high_water = buffer_events
        self._low_water = buffer_events // 2
        self._paused = False

    def interrupt(self) -> None:
        """Makes the pending (or next) `next_batch` return an empty batch at once."""
        self.put(_INTERRUPT)

    def when_engine_done(self, callback: Callable[[], None]) -> None:
        """Calls `callback` once the engine has sent the request's last event (at once if it has): a call that
        ended early keeps its engine id until then, so no newer request under that id receives this one's events."""
        if self._unfinished <= 0:
            callback()
        else:
            self._on_engine_done = callback

    def put(self, event: Event | _Interrupt) -> None:
        """Called on the event loop by the relay."""
        if type(event) is ErrorEvent or type(event) is TokenEvent and event.finish is not None:
            self._unfinished = 0 if type(event) is ErrorEvent else self._unfinished - 1
            if self._unfinished <= 0 and self._on_engine_done is not None:
                self._on_engine_done()
                self._on_engine_done = None
        self._events.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)
        if not self._paused and len(self._events) >= self._high_water:
            self._paused = True
            self._engine.pause(self.request_id)

    async def next_batch(
        self, max_tokens: int = 0, min_tokens: int = 1, flush_s: float = 0.0, heartbeat_s: float = 0.0
    ) -> list[TokenEvent] | ErrorEvent | None:
        """The next message's events: at least `min_tokens` tokens (or whatever is ready when
        `flush_s` has passed since the first), at most `max_tokens` (0: no cap), and at once
        when the stream ends. Returns None when `heartbeat_s` passes with nothing to send, and
        an empty batch once interrupted.
        """
        events = self._events
        if not events:
            if heartbeat_s:
                if not await self._arrival(heartbeat_s):
                    return None
            else:  # the common wait, inline: no coroutine of its own, no timer
                self._waiter = waiter = asyncio.get_running_loop().create_future()
                try:
                    await waiter
                finally:
                    self._waiter = None
        first = events.popleft()
        if not events and type(first) is TokenEvent and first.finish is None and not flush_s and not self._paused:
            if len(first.tokens) >= min_tokens:  # a caller that keeps up: one event, nothing to wait for
                return [first]
        flush_at = asyncio.get_running_loop().time() + flush_s if flush_s else None
        batch: list[Any] = [first]
        last = first
        # Inlined checks (type() is, not helpers): this loop runs once per event at hundreds of streams.
        if type(first) is TokenEvent and first.finish is None:  # more may join it
            tokens = len(first.tokens)
            while not (max_tokens and tokens >= max_tokens):
                if not events:
                    wait = None if flush_at is None else flush_at - asyncio.get_running_loop().time()
                    if tokens >= min_tokens or (wait is not None and wait <= 0):
                        break
                    if not await self._arrival(wait):
                        break
                last = events.popleft()
                batch.append(last)
                if type(last) is not TokenEvent or last.finish is not None:  # the stream ends here
                    break
                tokens += len(last.tokens)
        if self._paused and len(events) <= self._low_water:
            self._paused = False
            self._engine.resume(self.request_id)
        # What ends a stream ends the batch: an interrupt or an error can only be its last event.
        if last is _INTERRUPT:
            return []
        if isinstance(last, ErrorEvent):
            return last
        return batch

    async def _arrival(self, timeout: float | None) -> bool:
        """Waits for the next event; False when `timeout` passes first."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self._waiter = waiter
        timer = None if timeout is None else loop.call_later(timeout, _time_up, waiter)
        try:
            return await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()


def _time_up(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


class _StreamSink:
    """A request stream's EventSink: alone it relays one event; the engine worker hands a step's events for
    every stream at once to its `batcher`, the relay (see backend.EventBatcher)."""

    __slots__ = ("stream", "batcher")

    def __init__(self, stream: RequestStream, relay: EventRelay) -> None:
        self.stream = stream
        self.batcher = relay

    def __call__(self, event: Event) -> None:
        self.batcher.deliver([(self, event)])


class EventRelay:
    """Carries events from the engine thread to request streams on the event loop: one wake-up of the loop
    per engine step, whatever the number of streams. No lock: deque.extend and popleft are atomic, and
    _flush clears `_scheduled` before it drains, so events added after the drain found the deque empty
    schedule the next flush. Events that arrive on the loop itself (an engine in another process, read
    there) go straight to their streams."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._pending: collections.deque[tuple[_StreamSink, Event]] = collections.deque()
        self._scheduled = False

    def sink(self, stream: RequestStream) -> EventSink:
        return _StreamSink(stream, self)

    def deliver(self, outputs: list[tuple[EventSink, Event]]) -> None:
        """Called on the engine thread with the events of one step (EventBatcher), or on the loop."""
        if threading.get_ident() == self._loop_thread and not self._scheduled:  # nothing is waiting to go first
            for sink, event in outputs:
                sink.stream.put(event)  # type: ignore[attr-defined]  # this relay's sinks are all _StreamSinks
            return
        self._pending.extend(outputs)  # type: ignore[arg-type]  # this relay's sinks are all _StreamSinks
        if not self._scheduled:  # else a flush that has not started draining yet will take them
            self._scheduled = True
            self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        pending = self._pending
        while pending:
            sink, event = pending.popleft()
            sink.stream.put(event)
