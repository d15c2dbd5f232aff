"""The engine process's side of the protocol (backend.process.protocol): one engine, served to every
front end.

Three threads, as vLLM's engine core has them:

    input   (the caller's)  reads commands from every front end and applies them to the engine,
                            answers compiles and status queries, notices a front end's death
    engine  (EngineWorker)  steps the model; each step's events go to the output thread in one call
    output                  encodes a step's events, one message per front end, and sends them while
                            the next step runs; sends the engine's figures every STATS_INTERVAL_S

The step loop never waits for a socket, and the sockets are each owned by one thread (ZMQ's rule):
the ROUTER by the input thread, the front ends' PUSH sockets by the output thread.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import pathlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from backend.common.cache_events import CacheEventBatch
from backend.common.stats import EngineStats
from backend.constraints import CompiledConstraint, ConstraintError, TooManyCompiles
from backend.events import Event, EventSink
from backend.local_engine import WorkerEngine
from backend.process import protocol as wire
from backend.types import GenerationRequest

log = logging.getLogger(__name__)


@dataclass
class _FrontEnd:
    index: int
    pid: int
    address: str
    pidfd: int
    requests: dict[str, str] = field(default_factory=dict)
    """Its request ids -> the engine's (the same, unless another front end's request has that id)."""
    watches: dict[int, Callable[[CacheEventBatch], None]] = field(default_factory=dict)
    """Its KV-cache event watches, by its name for them: each a listener of the engine's hub."""


class _Sink:
    """A request's EventSink in the engine process: its events go to the output thread, a step's at once
    (through `batcher`, see backend.worker.deliver_all)."""

    __slots__ = ("front_end", "request_id", "batcher")

    def __init__(self, front_end: int, request_id: str, batcher: EngineHost) -> None:
        self.front_end = front_end
        self.request_id = request_id
        self.batcher = batcher

    def __call__(self, event: Event) -> None:
        self.batcher.deliver([(self, event)])


_Outbound = tuple[str, Any]
"""What the output thread is asked to do: ("events", outputs), ("send", (front end, frame)), ("cache", (front
end, watch, batch)), ("connect", front end), ("forget", front end index), ("stop", None)."""


class EngineHost:
    def __init__(
        self, engine: WorkerEngine, run_dir: pathlib.Path, restarts: int = 0,
        cache_events: tuple[str, str, str] = ("", "", ""),
    ) -> None:
        """Binds the engine's socket in `run_dir`; `serve()` then answers front ends until `stop_serving()`.
        `cache_events`: where the engine's KV-cache events are published (endpoint, replay endpoint, topic)."""
        self.engine = engine
        self.restarts = restarts
        self._cache_events = cache_events
        self._context = zmq.Context()
        self._inbox = self._context.socket(zmq.ROUTER)
        self._inbox.setsockopt(zmq.RCVHWM, 0)  # commands are never dropped
        self._inbox.bind(f"ipc://{run_dir / wire.ENGINE_SOCKET}")
        self._poller = zmq.Poller()
        self._poller.register(self._inbox, zmq.POLLIN)
        self._front_ends: dict[int, _FrontEnd] = {}
        self._by_pidfd: dict[int, _FrontEnd] = {}
        self._engine_ids: set[str] = set()
        self._outbox: queue.SimpleQueue[_Outbound] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._output_failure: BaseException | None = None
        self._output = threading.Thread(target=self._send_loop, name="engine-output", daemon=True)
        self._output.start()

    # -- the output thread's side: EventBatcher ---------------------------------------------------

    def deliver(self, outputs: list[tuple[EventSink, Event]]) -> None:
        """A step's events (on the engine thread): handed to the output thread in one call."""
        self._outbox.put(("events", outputs))

    # -- the input thread -------------------------------------------------------------------------

    def serve(self) -> None:
        """Applies front ends' commands until `stop_serving()`. Raises RuntimeError when the output thread has failed
        (the process should then end, for a restart: nothing would reach the front ends any more)."""
        handlers: dict[type, Callable[[_FrontEnd, Any], None]] = {
            wire.Submit: self._submit, wire.Cancel: self._cancel, wire.Release: self._release,
            wire.Pause: self._pause, wire.Resume: self._resume, wire.Compile: self._compile, wire.Status: self._status,
            wire.WatchCache: self._watch, wire.UnwatchCache: self._unwatch,
        }
        while not self._stopping.is_set():
            if self._output_failure is not None:
                raise RuntimeError("the engine's output thread failed") from self._output_failure
            for socket, _ in self._poller.poll(100):
                if socket is self._inbox:
                    self._read(handlers)
                else:
                    self._forget(self._by_pidfd[socket])

    def _read(self, handlers: dict[type, Callable[[_FrontEnd, Any], None]]) -> None:
        while True:
            try:
                identity, *frames = self._inbox.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                (frame,) = frames
                message = wire.decode_to_engine(frame)
            except (ValueError, msgspec.DecodeError) as exc:  # a peer speaking something else: dropped, nothing else
                log.error("an unreadable message from %r dropped: %s", identity, exc)
                continue
            try:
                if isinstance(message, wire.Hello):
                    self._hello(message)
                elif (front_end := self._front_ends.get(_index(identity))) is None:
                    log.warning("a %s from a front end that has not said hello: dropped", type(message).__name__)
                else:
                    handlers[type(message)](front_end, message)
            except Exception:  # a bug serving one command: it alone is lost, the engine goes on
                log.exception("serving a %s failed", type(message).__name__)

    def _hello(self, hello: wire.Hello) -> None:
        if hello.version != wire.VERSION:
            log.error("front end %d speaks protocol %d, this engine %d: ignored", hello.front_end, hello.version,
                      wire.VERSION)
            return
        known = self._front_ends.get(hello.front_end)
        if known is not None and known.pid != hello.pid:  # it was started again: the old one's requests end
            self._forget(known)
            known = None
        if known is None:
            try:
                pidfd = os.pidfd_open(hello.pid)
            except ProcessLookupError:
                return  # gone already
            known = self._front_ends[hello.front_end] = _FrontEnd(hello.front_end, hello.pid, hello.address, pidfd)
            self._by_pidfd[pidfd] = known
            self._poller.register(pidfd, zmq.POLLIN)
            self._outbox.put(("connect", known))
            log.info("front end %d (pid %d) connected", hello.front_end, hello.pid)
        welcome = wire.Welcome(self.engine.info, os.getpid(), self.restarts, self._cache_events)
        self._outbox.put(("send", (hello.front_end, wire.encode(welcome))))

    def _forget(self, front_end: _FrontEnd) -> None:
        """A front end left (or died): its requests end at the next step and free their places."""
        for engine_id in front_end.requests.values():
            self.engine.cancel(engine_id)
            self.engine.release(engine_id)
            self._engine_ids.discard(engine_id)
        for watch in list(front_end.watches):
            self._unwatch(front_end, wire.UnwatchCache(watch))
        self._poller.unregister(front_end.pidfd)
        del self._by_pidfd[front_end.pidfd], self._front_ends[front_end.index]
        os.close(front_end.pidfd)
        self._outbox.put(("forget", front_end.index))
        log.info("front end %d (pid %d) gone: %d requests cancelled", front_end.index, front_end.pid,
                 len(front_end.requests))

    def _submit(self, front_end: _FrontEnd, message: wire.Submit) -> None:
        request = message.request
        engine_id = request.request_id
        if engine_id in self._engine_ids:  # another front end's request has its id
            engine_id = f"{engine_id}@{front_end.index}"
            request = _renamed(request, engine_id)
        self._engine_ids.add(engine_id)
        front_end.requests[message.request.request_id] = engine_id
        self.engine.submit(request, _Sink(front_end.index, message.request.request_id, self))

    def _cancel(self, front_end: _FrontEnd, message: wire.Cancel) -> None:
        engine_id = front_end.requests.get(message.request_id)
        if engine_id is not None:
            self.engine.cancel(engine_id)

    def _release(self, front_end: _FrontEnd, message: wire.Release) -> None:
        engine_id = front_end.requests.pop(message.request_id, None)
        if engine_id is not None:
            self.engine.release(engine_id)
            self._engine_ids.discard(engine_id)

    def _pause(self, front_end: _FrontEnd, message: wire.Pause) -> None:
        engine_id = front_end.requests.get(message.request_id)
        if engine_id is not None:
            self.engine.pause(engine_id)

    def _resume(self, front_end: _FrontEnd, message: wire.Resume) -> None:
        engine_id = front_end.requests.get(message.request_id)
        if engine_id is not None:
            self.engine.resume(engine_id)

    def _compile(self, front_end: _FrontEnd, message: wire.Compile) -> None:
        index, ticket = front_end.index, message.ticket
        try:
            future = self.engine.compiles.submit(message.spec)
        except TooManyCompiles as busy:
            self._answer(index, wire.Compiled(ticket, busy=busy.running))
            return

        def compiled(done: concurrent.futures.Future[CompiledConstraint]) -> None:  # on a compile thread
            try:
                answer = wire.Compiled(ticket, report=done.result().report())
            except ConstraintError as exc:
                answer = wire.Compiled(ticket, error=str(exc), kind=exc.kind)
            except Exception as exc:  # a bug in the compiler: the caller learns it failed, the log says why
                log.exception("compiling a constraint failed")
                answer = wire.Compiled(ticket, error=f"the compile failed: {exc}", kind=message.spec.kind)
            self._answer(index, answer)

        future.add_done_callback(compiled)

    def _status(self, front_end: _FrontEnd, message: wire.Status) -> None:
        self._answer(front_end.index, wire.StatusReport(message.ticket, self._stats()))

    def _stats(self) -> EngineStats:
        return dataclasses.replace(self.engine.stats, engine_restarts=self.restarts)

    def _watch(self, front_end: _FrontEnd, message: wire.WatchCache) -> None:
        hub, index, watch = self.engine.cache_events, front_end.index, message.watch
        if hub is None:  # the front end knows from the model's description; a peer that did not ask first
            self._answer(index, wire.WatchAnswer(message.ticket, False, 0))
            return

        def listener(batch: CacheEventBatch) -> None:  # on the engine thread, under the hub's lock: never blocks
            self._outbox.put(("cache", (index, watch, batch)))

        started = hub.subscribe(listener, message.start, message.snapshot)  # replayed batches go out first
        if started:
            front_end.watches[watch] = listener
        self._answer(index, wire.WatchAnswer(message.ticket, started, hub.oldest_kept))

    def _unwatch(self, front_end: _FrontEnd, message: wire.UnwatchCache) -> None:
        listener = front_end.watches.pop(message.watch, None)
        if listener is not None and self.engine.cache_events is not None:
            self.engine.cache_events.unsubscribe(listener)

    def _answer(self, front_end: int, message: wire.Compiled | wire.StatusReport | wire.WatchAnswer) -> None:
        self._outbox.put(("send", (front_end, wire.encode(message))))

    def stop_serving(self) -> None:
        """Ends `serve()` (signal-safe: only a flag)."""
        self._stopping.set()

    def close(self) -> None:
        """Stops the output thread once what it holds is sent, and closes the sockets (the engine itself is the
        caller's to close, first: its last events go out here)."""
        self._outbox.put(("stop", None))
        self._output.join(5)
        for front_end in list(self._front_ends.values()):
            os.close(front_end.pidfd)
        self._inbox.close(linger=0)
        self._context.term()

    # -- the output thread ------------------------------------------------------------------------

    def _send_loop(self) -> None:
        try:
            self._send_all()
        except BaseException as exc:  # a bug: serve() raises it on the input thread, for the process to end
            log.exception("the engine's output thread failed")
            self._output_failure = exc

    def _send_all(self) -> None:
        pushes: dict[int, zmq.Socket[bytes]] = {}
        sent_stats, stats_due = None, time.monotonic()
        while True:
            try:
                kind, what = self._outbox.get(timeout=wire.STATS_INTERVAL_S)
            except queue.Empty:
                kind, what = "", None
            if kind == "events":
                self._send_events(pushes, what)
            elif kind == "send":
                index, frame = what
                if (push := pushes.get(index)) is not None:
                    push.send(frame)
            elif kind == "cache":
                index, watch, batch = what
                if (push := pushes.get(index)) is not None:
                    push.send(wire.encode(wire.CacheBatch(watch, batch)))
            elif kind == "connect":
                pushes[what.index] = push = self._context.socket(zmq.PUSH)
                push.setsockopt(zmq.SNDHWM, 0)  # a step's events are never dropped (backpressure is the streams')
                push.setsockopt(zmq.LINGER, 0)
                push.connect(what.address)
                stats_due = 0.0  # a new front end gets the figures at once: after its Welcome, queued next
                continue
            elif kind == "forget":
                if (push := pushes.pop(what, None)) is not None:
                    push.close()
            elif kind == "stop":
                for push in pushes.values():
                    push.close(linger=1000)  # what is queued still goes out
                return
            if time.monotonic() >= stats_due and self.engine.core.stats is not sent_stats:  # the core publishes anew
                sent_stats, stats_due = self.engine.core.stats, time.monotonic() + wire.STATS_INTERVAL_S
                frame = wire.encode(wire.StatusReport(0, self._stats()))
                for push in pushes.values():
                    push.send(frame)

    def _send_events(self, pushes: dict[int, zmq.Socket[bytes]], outputs: list[tuple[_Sink, Event]]) -> None:
        by_front_end: dict[int, list[tuple[str, Event]]] = {}
        for sink, event in outputs:  # nothing but appends per event: this runs for every token of every stream
            if (events := by_front_end.get(sink.front_end)) is not None:
                events.append((sink.request_id, event))
            else:
                by_front_end[sink.front_end] = [(sink.request_id, event)]
        for index, events in by_front_end.items():
            if (push := pushes.get(index)) is not None:
                push.send(wire.encode(wire.Events(events)))


def _index(identity: bytes) -> int:
    """The front end's index from its socket identity (front_end_identity); -1 for any other."""
    return int(identity[2:]) if identity.startswith(b"fe") and identity[2:].isdigit() else -1


def _renamed(request: GenerationRequest, request_id: str) -> GenerationRequest:
    return dataclasses.replace(request, request_id=request_id)
