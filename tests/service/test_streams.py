"""service.streams on its own: a request's buffer of events (batches, pacing, pause and resume, interrupts)
and the relay that carries a step's events from the engine thread to the event loop in one hand-over."""

from __future__ import annotations

import asyncio
import threading

from backend import ErrorEvent, ErrorKind, Finish, FinishReason, GeneratedToken, Timings, TokenEvent, Usage
from backend.worker import deliver_all
from service.streams import EventRelay, RequestStream


class RecordingEngine:
    """What a RequestStream asks of the engine: pause and resume one sequence."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def pause(self, request_id: str) -> None:
        self.calls.append(("pause", request_id))

    def resume(self, request_id: str) -> None:
        self.calls.append(("resume", request_id))


def token(n: int, finish: bool = False) -> TokenEvent:
    ending = Finish(FinishReason.MAX_TOKENS, Usage(1, n), Timings(0.0, 0.0, 0.0, 0.0, 0.0), seed=0) if finish else None
    return TokenEvent((GeneratedToken(4 + n, b"x"),), "x", n, finish=ending)


def stream(buffer_events: int = 64) -> tuple[RequestStream, RecordingEngine]:
    engine = RecordingEngine()
    return RequestStream(engine, "r", buffer_events), engine  # type: ignore[arg-type]


async def test_a_batch_takes_every_ready_event_up_to_the_cap_and_stops_at_the_last() -> None:
    s, _ = stream()
    for n in range(1, 6):
        s.put(token(n))
    s.put(token(6, finish=True))
    s.put(token(7))  # never read: the stream ended before it
    first = await s.next_batch(max_tokens=4)
    assert [e.generated_tokens for e in first] == [1, 2, 3, 4]
    rest = await s.next_batch()
    assert [e.generated_tokens for e in rest] == [5, 6] and rest[-1].finish is not None


async def test_a_waiting_batch_wakes_on_the_next_event_and_min_tokens_waits_for_company() -> None:
    s, _ = stream()
    waiting = asyncio.ensure_future(s.next_batch(min_tokens=3, flush_s=5.0))
    await asyncio.sleep(0)
    for n in (1, 2, 3):
        assert not waiting.done()
        s.put(token(n))
        await asyncio.sleep(0)
    assert [e.generated_tokens for e in await waiting] == [1, 2, 3]


async def test_flush_interval_sends_what_is_ready_and_heartbeat_returns_none() -> None:
    s, _ = stream()
    s.put(token(1))
    assert [e.generated_tokens for e in await s.next_batch(min_tokens=5, flush_s=0.02)] == [1]
    assert await s.next_batch(heartbeat_s=0.02) is None


async def test_an_error_or_an_interrupt_ends_the_batch() -> None:
    s, _ = stream()
    s.put(token(1))
    s.put(ErrorEvent("broken", ErrorKind.ENGINE_FAILURE))
    error = await s.next_batch()
    assert isinstance(error, ErrorEvent) and error.message == "broken"
    waiting = asyncio.ensure_future(s.next_batch())
    await asyncio.sleep(0)
    s.interrupt()
    assert await waiting == []


async def test_a_full_buffer_pauses_the_sequence_and_reading_half_resumes_it() -> None:
    s, engine = stream(buffer_events=4)
    for n in range(1, 5):
        s.put(token(n))
    assert engine.calls == [("pause", "r")]
    s.put(token(5))  # paused once, not again
    await s.next_batch(max_tokens=3)
    assert engine.calls == [("pause", "r"), ("resume", "r")]


async def test_the_relay_hands_a_step_to_the_loop_in_one_wake_up_and_each_stream_gets_its_own() -> None:
    loop = asyncio.get_running_loop()
    relay = EventRelay(loop)
    streams = [stream()[0] for _ in range(3)]
    sinks = [relay.sink(s) for s in streams]
    wakes = []
    call_soon_threadsafe = loop.call_soon_threadsafe

    def counting(callback, *args):  # type: ignore[no-untyped-def]
        wakes.append(callback)
        return call_soon_threadsafe(callback, *args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        step = [(sink, token(n)) for n in (1, 2) for sink in sinks]
        engine_thread = threading.Thread(target=deliver_all, args=(step,))
        engine_thread.start()
        engine_thread.join()
        batches = [await s.next_batch() for s in streams]
    finally:
        loop.call_soon_threadsafe = call_soon_threadsafe  # type: ignore[method-assign]
    assert len(wakes) == 1
    assert [[e.generated_tokens for e in b] for b in batches] == [[1, 2]] * 3


async def test_a_sink_called_alone_still_relays_its_event() -> None:
    relay = EventRelay(asyncio.get_running_loop())
    s, _ = stream()
    sink = relay.sink(s)
    threading.Thread(target=sink, args=(token(1, finish=True),)).start()
    assert [e.generated_tokens for e in await s.next_batch()] == [1]


async def test_events_delivered_on_the_loop_itself_reach_their_streams_without_a_wake_up() -> None:
    """An engine in another process is read on the event loop: its step goes straight to the streams, in order
    after anything the relay still holds."""
    loop = asyncio.get_running_loop()
    relay = EventRelay(loop)
    s, _ = stream()
    sink = relay.sink(s)
    wakes = []
    call_soon_threadsafe = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda callback, *args: (wakes.append(callback), call_soon_threadsafe(callback, *args))  # type: ignore[method-assign]
    try:
        deliver_all([(sink, token(1)), (sink, token(2))])
    finally:
        loop.call_soon_threadsafe = call_soon_threadsafe  # type: ignore[method-assign]
    assert wakes == [] and [e.generated_tokens for e in await s.next_batch()] == [1, 2]
