"""Per-request event streams between the engine thread and the gRPC handlers.

The engine delivers events from its own thread; `EventRelay` moves them onto
the event loop, waking it once per burst rather than once per event. Each
request's `RequestStream` is a bounded buffer: when a caller reads slowly and
its buffer fills, its sequence is paused in the engine (cache kept, other
streams unaffected) and resumed once the caller has read half of it.
"""

from __future__ import annotations

import asyncio
import threading

from backend.engine import Engine, EventSink
from backend.types import ErrorEvent, Event, TokenEvent


class RequestStream:
    def __init__(self, engine: Engine, request_id: str, buffer_events: int) -> None:
        self.request_id = request_id
        self._engine = engine
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._high_water = buffer_events
        self._low_water = buffer_events // 2
        self._paused = False
        self.max_buffered = 0

    def put(self, event: Event) -> None:
        """Called on the event loop by the relay."""
        self._events.put_nowait(event)
        self.max_buffered = max(self.max_buffered, self._events.qsize())
        if not self._paused and self._events.qsize() >= self._high_water:
            self._paused = True
            self._engine.pause(self.request_id)

    async def next_batch(self, max_tokens: int, heartbeat_s: float | None) -> list[TokenEvent] | ErrorEvent | None:
        """Waits for an event, then takes what else is queued, up to `max_tokens` tokens.

        Returns None when `heartbeat_s` passes with nothing to send.
        """
        try:
            first = await asyncio.wait_for(self._events.get(), heartbeat_s) if heartbeat_s else await self._events.get()
        except TimeoutError:
            return None
        batch = [first]
        tokens = len(first.tokens) if isinstance(first, TokenEvent) else 0
        while isinstance(batch[-1], TokenEvent) and batch[-1].finish is None and not self._events.empty():
            if max_tokens and tokens >= max_tokens:
                break
            event = self._events.get_nowait()
            batch.append(event)
            tokens += len(event.tokens) if isinstance(event, TokenEvent) else 0
        if self._paused and self._events.qsize() <= self._low_water:
            self._paused = False
            self._engine.resume(self.request_id)
        error = next((event for event in batch if isinstance(event, ErrorEvent)), None)
        return error if error is not None else batch


class EventRelay:
    """Carries events from the engine thread to request streams on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[RequestStream, Event]] = []

    def sink(self, stream: RequestStream) -> EventSink:
        return lambda event: self._post(stream, event)

    def _post(self, stream: RequestStream, event: Event) -> None:
        with self._lock:
            self._pending.append((stream, event))
            wake = len(self._pending) == 1  # otherwise a flush is already scheduled
        if wake:
            self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for stream, event in pending:
            stream.put(event)
