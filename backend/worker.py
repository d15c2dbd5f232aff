"""The one thread that owns a model: commands in, steps, events out.

`EngineCore` is the synchronous part an engine implements (tests can drive it
step by step without threads). Like vLLM's `EngineCore.step()`, each of its
methods returns the outputs it produced, (sink, event) pairs, and never calls a
sink itself; `EngineWorker` runs it on a dedicated thread and delivers them:

    while running: apply queued commands; if there is work, step(); deliver the outputs

It blocks on the command queue while there is nothing to do (waking now and
then while paused sequences hold the cache, so their time limits still apply).
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from backend.common.cache_events import CacheEventHub
from backend.common.stats import CancelOrder, EngineStats
from backend.engine import EventBatcher, EventSink
from backend.events import Event, TokenEvent
from backend.types import GenerationRequest

log = logging.getLogger(__name__)

# How often an idle worker holding paused sequences checks their deadlines.
_PAUSED_CHECK_S = 0.1


Output = tuple[EventSink, Event]
"""One event for one request's sink, as an engine core returns it."""


def deliver(sink: EventSink, event: Event) -> None:
    """Hands an event to a request's sink; a failing sink (its caller's loop is gone) ends nothing else."""
    try:
        sink(event)
    except Exception:
        log.exception("could not deliver an event")


def deliver_all(outputs: Iterable[Output]) -> None:
    """Delivers a step's outputs: to each sink one by one, or together to their EventBatcher in one call."""
    batches: dict[EventBatcher, list[Output]] = {}
    for output in outputs:  # nothing allocated per output: this runs for every token of every stream
        batcher: EventBatcher | None = getattr(output[0], "batcher", None)
        if batcher is None:
            deliver(*output)
        elif (batch := batches.get(batcher)) is not None:
            batch.append(output)
        else:
            batches[batcher] = [output]
    for batcher, batch in batches.items():
        try:
            batcher.deliver(batch)
        except Exception:
            log.exception("could not deliver %d events", len(batch))


def starts_a_stream(outputs: list[Output]) -> bool:
    """Whether any of the outputs is a sequence's first event with tokens."""
    return any(type(event) is TokenEvent and event.tokens and event.generated_tokens == len(event.tokens)
               for _, event in outputs)


class Command(enum.Enum):
    ADD = "add"
    CANCEL = "cancel"
    PAUSE = "pause"
    RESUME = "resume"
    SHUTDOWN = "shutdown"


class EngineCore(Protocol):
    """Every method returns the outputs it produced, in order, for the caller to deliver."""

    stats: EngineStats
    settle_later: bool
    """Set while the worker applies a batch of commands: each command leaves what follows every command
    (admission, the published figures) to one `settle()` after the batch. A burst of hundreds of arrivals
    ran both for each arrival, over every request held."""

    def first_token_hold_s(self) -> float:
        """How long the worker holds the next step after one that produced a sequence's first token, so that
        the threads that send it (the service's, a sidecar's, a local caller's) run before the engine takes
        the CPU cores again (0: not at all; an engine whose steps leave the cores free needs no hold)."""
        ...

    def add(self, request: GenerationRequest, sink: EventSink) -> list[Output]: ...

    def cancel(self, order: CancelOrder) -> list[Output]: ...

    def pause(self, request_id: str) -> list[Output]: ...

    def resume(self, request_id: str) -> list[Output]: ...

    def has_work(self) -> bool:
        """Whether step() would do anything: a waiting request or an unpaused sequence."""
        ...

    def holds_sequences(self) -> bool: ...

    def expire(self) -> list[Output]:
        """Ends every sequence whose time is up, paused or waiting ones included."""
        ...

    def step(self) -> list[Output]: ...

    def close(self) -> list[Output]:
        """Ends every request (CANCELLED) and frees the model's working memory."""
        ...

    def settle(self) -> list[Output]:
        """What follows every command or step: admission where the engine admits between steps, the
        published figures, and the outputs not handed over yet."""
        ...


class EngineWorker:
    def __init__(self, core: EngineCore, name: str = "engine") -> None:
        self._core = core
        self._commands: queue.SimpleQueue[tuple[Command, Any]] = queue.SimpleQueue()
        self.death_callbacks: list[Callable[[BaseException], None]] = []
        """Called on this thread if the loop crashes, before its requests are closed (liveness)."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest, sink: EventSink) -> None:
        self._commands.put((Command.ADD, (request, sink)))

    def cancel(self, request_id: str) -> None:
        self._commands.put((Command.CANCEL, CancelOrder(request_id, time.monotonic(), self._core.stats.steps)))

    def pause(self, request_id: str) -> None:
        self._commands.put((Command.PAUSE, request_id))

    def resume(self, request_id: str) -> None:
        self._commands.put((Command.RESUME, request_id))

    def close(self) -> None:
        if self._thread.is_alive():
            self._commands.put((Command.SHUTDOWN, None))
            self._thread.join()

    def _run(self) -> None:
        try:
            while True:
                if self._core.has_work():
                    timeout: float | None = 0.0
                elif self._core.holds_sequences():
                    timeout = _PAUSED_CHECK_S
                else:
                    timeout = None
                if not self._apply_commands(timeout):
                    return
                outputs = self._core.step() if self._core.has_work() else self._core.expire()
                deliver_all(outputs)
                # The engine's answer first: without a hold (a GPU engine) the step's events are not scanned.
                if (hold := self._core.first_token_hold_s()) and starts_a_stream(outputs):
                    time.sleep(hold)
        except Exception as exc:  # a bug in the loop itself; per-sequence faults are handled in step()
            log.exception("engine loop crashed")
            for callback in self.death_callbacks:
                callback(exc)
            raise
        finally:
            deliver_all(self._core.close())

    def _apply_commands(self, timeout: float | None) -> bool:
        """Applies every queued command, waiting up to `timeout` for the first; False on shutdown."""
        try:
            command, arg = self._commands.get(block=timeout != 0.0, timeout=timeout)
        except queue.Empty:
            return True
        # Each handler takes its own command's argument, which the queue holds untyped.
        handlers: dict[Command, Callable[[Any], list[Output]]] = {
            Command.ADD: lambda arg: self._core.add(*arg),
            Command.CANCEL: self._core.cancel,
            Command.PAUSE: self._core.pause,
            Command.RESUME: self._core.resume,
        }
        outputs: list[Output] = []
        self._core.settle_later = True
        try:
            while command is not Command.SHUTDOWN:
                outputs += handlers[command](arg)
                try:
                    command, arg = self._commands.get_nowait()
                except queue.Empty:
                    break
        finally:
            self._core.settle_later = False
            deliver_all(outputs)
        deliver_all(self._core.settle())
        return command is not Command.SHUTDOWN


class WorkerEngine:
    """The command half of the Engine protocol, for an engine whose core runs on an EngineWorker.

    Subclasses set `self.core` and `self._worker`; every method here is thread-safe.
    """

    core: EngineCore
    _worker: EngineWorker
    cache_events: CacheEventHub | None = None

    def submit(self, request: GenerationRequest, sink: EventSink) -> None:
        self._worker.submit(request, sink)

    def cancel(self, request_id: str) -> None:
        self._worker.cancel(request_id)

    def pause(self, request_id: str) -> None:
        self._worker.pause(request_id)

    def resume(self, request_id: str) -> None:
        self._worker.resume(request_id)

    def on_death(self, callback: Callable[[BaseException], None]) -> None:
        """`callback(exc)` runs on the engine thread if it dies."""
        self._worker.death_callbacks.append(callback)

    @property
    def stats(self) -> EngineStats:
        return self.core.stats
