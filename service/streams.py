"""Per-request event streams between the engine thread and the gRPC handlers.

The engine delivers events from its own thread; `EventRelay` moves them onto
the event loop, waking it once per burst rather than once per event. Each
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
import threading

from backend import Engine, ErrorEvent, Event, EventSink, TokenEvent


class _Interrupt:
    """Wakes a handler waiting for events: the server has ended its call (see Lifecycle.end_running)."""


_INTERRUPT = _Interrupt()


class RequestStream:
    def __init__(self, engine: Engine, request_id: str, buffer_events: int) -> None:
        self.request_id = request_id
        self._engine = engine
        self._events: asyncio.Queue[Event | _Interrupt] = asyncio.Queue()
        self._high_water = buffer_events
        self._low_water = buffer_events // 2
        self._paused = False

    def interrupt(self) -> None:
        """Makes the pending (or next) `next_batch` return an empty batch at once."""
        self._events.put_nowait(_INTERRUPT)

    def put(self, event: Event) -> None:
        """Called on the event loop by the relay."""
        self._events.put_nowait(event)
        if not self._paused and self._events.qsize() >= self._high_water:
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
        try:
            first = await asyncio.wait_for(self._events.get(), heartbeat_s or None)
        except TimeoutError:
            return None
        loop = asyncio.get_running_loop()
        flush_at = loop.time() + flush_s if flush_s else None
        batch = [first]
        tokens = _token_count(first)
        while not _ends_stream(batch[-1]) and not (max_tokens and tokens >= max_tokens):
            if self._events.empty():
                wait = None if flush_at is None else flush_at - loop.time()
                if tokens >= min_tokens or (wait is not None and wait <= 0):
                    break
                try:
                    event = await asyncio.wait_for(self._events.get(), wait)
                except TimeoutError:
                    break
            else:
                event = self._events.get_nowait()
            batch.append(event)
            tokens += _token_count(event)
        if _INTERRUPT in batch:
            return []
        if self._paused and self._events.qsize() <= self._low_water:
            self._paused = False
            self._engine.resume(self.request_id)
        error = next((event for event in batch if isinstance(event, ErrorEvent)), None)
        if error is not None:
            return error
        return [event for event in batch if isinstance(event, TokenEvent)]  # all of them, by now


def _token_count(event: Event | _Interrupt) -> int:
    return len(event.tokens) if isinstance(event, TokenEvent) else 0


def _ends_stream(event: Event | _Interrupt) -> bool:
    return isinstance(event, (_Interrupt, ErrorEvent)) or event.finish is not None


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
