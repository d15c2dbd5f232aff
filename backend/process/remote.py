"""A front end's side of the protocol (backend.process.protocol): the Engine contract over the engine
process's sockets, on the front end's event loop.

Commands are sent as they are asked for; the engine's messages are read on the event loop when its
socket has them (no thread of its own): a step's events reach their streams in one pass. The engine's
process is watched through a pidfd: the moment it exits, every request in flight ends with
ENGINE_DOWN, `on_death` callbacks run, and Hello goes out again until an engine answers (the
supervisor starts a new one); `on_ready` callbacks then run. Tokenizing and rendering chats are this
process's own work, on the model's vocabulary (`Vocabulary`, loaded once the first engine has said
what the model is).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pathlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq

from backend.common.cache_events import Listener
from backend.common.stats import EngineStats
from backend.constraints import CompileReport, ConstraintError, ConstraintSpec, TooManyCompiles
from backend.engine import EngineGone, Vocabulary
from backend.events import ErrorEvent, ErrorKind, EventSink
from backend.process import protocol as wire
from backend.types import ChatContext, ChatMessage, GenerationRequest, ModelInfo
from backend.worker import deliver_all

log = logging.getLogger(__name__)

HELLO_INTERVAL_S = 0.2
"""How often a front end says Hello while no engine has answered."""

VocabularyLoader = Callable[[ModelInfo], Vocabulary]
"""Loads the model's vocabulary in this process, once the engine has described the model."""


class RemoteCacheEvents:
    """The engine's KV-cache events for this front end's watchers (backend.common.cache_events.CacheWatching): each
    watch is one on the engine's own hub, whose batches the engine sends here."""

    def __init__(self, engine: RemoteEngine) -> None:
        self._engine = engine
        self._watches = itertools.count(1)
        self._listeners: dict[int, Listener] = {}
        self.oldest_kept = 0
        """As the engine said when it last refused a watch."""

    async def watch(self, listener: Listener, start: int | None = None, snapshot: bool = False) -> bool:
        watch = next(self._watches)
        self._listeners[watch] = listener  # before asking: replayed batches come before the answer
        answer: wire.WatchAnswer = await self._engine._ask(lambda ticket: wire.WatchCache(ticket, watch, start, snapshot))
        if not answer.started:
            del self._listeners[watch]
            self.oldest_kept = answer.oldest_kept
        return answer.started

    def unsubscribe(self, listener: Listener) -> None:
        for watch, known in list(self._listeners.items()):
            if known == listener:
                del self._listeners[watch]
                self._engine._send(wire.UnwatchCache(watch))

    def batch(self, message: wire.CacheBatch) -> None:
        listener = self._listeners.get(message.watch)
        if listener is not None:
            listener(message.batch)

    def engine_gone(self) -> None:
        """Every watcher learns that the batches it follows end here (a new engine numbers them from 0 again)."""
        listeners, self._listeners = self._listeners, {}
        for listener in listeners.values():
            listener(None)  # type: ignore[arg-type]  # the watchers' end (service.cache_watch)


class RemoteEngine:
    """The Engine protocol for a front end. Its methods are called on the event loop it was made on (calls from
    another thread are moved onto it)."""

    cache_events: RemoteCacheEvents | None = None

    def __init__(self, run_dir: pathlib.Path, index: int, load_vocabulary: VocabularyLoader) -> None:
        self.index = index
        self._run_dir = run_dir
        self._load_vocabulary = load_vocabulary
        self._vocabulary: Vocabulary | None = None
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._context = zmq.Context()
        self._inbox = self._context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.RCVHWM, 0)
        self._inbox.bind(f"ipc://{run_dir / wire.front_end_socket(index)}")
        self._inbox_fd: int = self._inbox.getsockopt(zmq.FD)  # type: ignore[assignment]  # an int for FD
        self._loop.add_reader(self._inbox_fd, self._read)
        self._outbox: zmq.Socket[bytes] | None = None
        self._sinks: dict[str, EventSink] = {}
        self._tickets = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._stats = EngineStats()
        self._engine_pid = 0
        self._pidfd = -1
        self._welcome: asyncio.Future[wire.Welcome] | None = None
        self.restarts = 0
        """How many times the engine was started again after dying (as the engine counts them)."""
        self._death_callbacks: list[Callable[[BaseException], None]] = []
        self._ready_callbacks: list[Callable[[], None]] = []
        self.info: ModelInfo
        self.cache_event_sources = ("", "", "")
        """Where the engine publishes its KV-cache events over ZMQ: endpoint, replay endpoint, topic."""

    # -- connecting ----------------------------------------------------------------------------------

    async def connect(self) -> ModelInfo:
        """Says Hello until an engine answers; the model's description (its vocabulary loaded the first time)."""
        self._outbox = outbox = self._context.socket(zmq.DEALER)
        outbox.setsockopt(zmq.IDENTITY, wire.front_end_identity(self.index))
        outbox.setsockopt(zmq.SNDHWM, 0)  # a burst of submits is never dropped
        outbox.setsockopt(zmq.LINGER, 0)
        outbox.connect(f"ipc://{self._run_dir / wire.ENGINE_SOCKET}")
        self._welcome = self._loop.create_future()
        hello = wire.encode(wire.Hello(self.index, os.getpid(), f"ipc://{self._run_dir / wire.front_end_socket(self.index)}"))
        while True:
            outbox.send(hello)
            try:
                welcome = await asyncio.wait_for(asyncio.shield(self._welcome), HELLO_INTERVAL_S)
                break
            except TimeoutError:
                continue
        if self._vocabulary is None:
            self._vocabulary = await asyncio.to_thread(self._load_vocabulary, welcome.info)
        self.info, self.restarts, self._engine_pid = welcome.info, welcome.restarts, welcome.pid
        self.cache_event_sources = welcome.cache_events
        if welcome.info.cache_block_size and self.cache_events is None:
            self.cache_events = RemoteCacheEvents(self)
        self._pidfd = os.pidfd_open(welcome.pid)
        self._loop.add_reader(self._pidfd, self._engine_exited)
        return welcome.info

    def on_death(self, callback: Callable[[BaseException], None]) -> None:
        """`callback(exc)` runs on the event loop when the engine process exits."""
        self._death_callbacks.append(callback)

    def on_ready(self, callback: Callable[[], None]) -> None:
        """`callback()` runs on the event loop when an engine started again has answered."""
        self._ready_callbacks.append(callback)

    def _engine_exited(self) -> None:
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        log.error("the engine process (pid %d) exited", self._engine_pid)
        gone = EngineGone(f"the engine process (pid {self._engine_pid}) exited")
        sinks, self._sinks = self._sinks, {}
        deliver_all([(sink, ErrorEvent(str(gone), ErrorKind.ENGINE_DOWN)) for sink in sinks.values()])
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(gone)
        self._waiting.clear()
        if self._outbox is not None:
            self._outbox.close()  # what it still held for the dead engine is dropped
            self._outbox = None
        if self.cache_events is not None:
            self.cache_events.engine_gone()
        for callback in self._death_callbacks:
            callback(gone)
        asyncio.ensure_future(self._reconnect())

    async def _reconnect(self) -> None:
        await self.connect()
        log.info("the engine is back (restarts: %d)", self.restarts)
        for callback in self._ready_callbacks:
            callback()

    # -- the engine's messages -------------------------------------------------------------------------

    def _read(self) -> None:
        """Everything the engine has sent (ZMQ's descriptor says only that something changed: drain it)."""
        inbox = self._inbox
        while inbox.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[operator,arg-type]  # an int for EVENTS
            try:
                message = wire.decode_to_front_end(inbox.recv(zmq.NOBLOCK))
            except msgspec.DecodeError as exc:  # an engine of another version: its message is lost, not the loop
                log.error("an unreadable message from the engine dropped: %s", exc)
                continue
            if type(message) is wire.Events:
                sinks = self._sinks
                deliver_all([(sink, event) for request_id, event in message.events
                             if (sink := sinks.get(request_id)) is not None])
            elif isinstance(message, wire.StatusReport):
                self._stats = message.stats
                self._settle(message.ticket, message)
            elif isinstance(message, wire.CacheBatch):
                if self.cache_events is not None:
                    self.cache_events.batch(message)
            elif isinstance(message, wire.Compiled | wire.WatchAnswer):
                self._settle(message.ticket, message)
            elif isinstance(message, wire.Welcome) and self._welcome is not None and not self._welcome.done():
                self._welcome.set_result(message)

    def _settle(self, ticket: int, answer: Any) -> None:
        future = self._waiting.pop(ticket, None)
        if future is not None and not future.done():
            future.set_result(answer)

    async def _ask(self, message: Callable[[int], wire.Compile | wire.Status | wire.WatchCache]) -> Any:
        ticket = next(self._tickets)
        future = self._waiting[ticket] = self._loop.create_future()
        self._send(message(ticket))
        return await future

    def _send(self, message: wire.ToEngine) -> None:
        if threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self._send, message)
        elif self._outbox is not None:
            self._outbox.send(wire.encode(message))

    # -- the Engine protocol ---------------------------------------------------------------------------

    async def compile(self, spec: ConstraintSpec) -> CompileReport:
        answer: wire.Compiled = await self._ask(lambda ticket: wire.Compile(ticket, spec))
        if answer.busy:
            raise TooManyCompiles(answer.busy)
        if answer.report is None:
            raise ConstraintError(answer.error, answer.kind)
        return answer.report

    def submit(self, request: GenerationRequest, sink: EventSink) -> None:
        if self._outbox is None or self._pidfd < 0:
            deliver_all([(sink, ErrorEvent("the engine is starting again", ErrorKind.ENGINE_DOWN))])
            return
        self._sinks[request.request_id] = sink
        self._send(wire.Submit(request))

    def cancel(self, request_id: str) -> None:
        self._send(wire.Cancel(request_id))

    def release(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        self._send(wire.Release(request_id))

    def pause(self, request_id: str) -> None:
        self._send(wire.Pause(request_id))

    def resume(self, request_id: str) -> None:
        self._send(wire.Resume(request_id))

    @property
    def stats(self) -> EngineStats:
        """The engine's figures as it last sent them (at most STATS_INTERVAL_S old while they change)."""
        return self._stats

    async def current_stats(self) -> EngineStats:
        """The engine's figures now."""
        report: wire.StatusReport = await self._ask(wire.Status)
        return report.stats

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        assert self._vocabulary is not None, "connect() comes first"
        return self._vocabulary.tokenize(text, add_special)

    def token_piece(self, token_id: int) -> bytes:
        assert self._vocabulary is not None, "connect() comes first"
        return self._vocabulary.token_piece(token_id)

    def render_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, special_tokens_in_content: bool = False,
        context: ChatContext = ChatContext(),
    ) -> list[int]:
        assert self._vocabulary is not None, "connect() comes first"
        return self._vocabulary.render_chat(messages, add_generation_prompt, special_tokens_in_content, context)

    def close(self) -> None:
        self._loop.remove_reader(self._inbox_fd)
        if self._pidfd >= 0:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1
        if self._outbox is not None:
            self._outbox.close(linger=1000)  # releases and cancels still go out
        self._inbox.close(linger=0)
        vocabulary_close = getattr(self._vocabulary, "close", None)
        if vocabulary_close is not None:
            vocabulary_close()
