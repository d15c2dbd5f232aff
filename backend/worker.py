"""The one thread that owns a model: commands in, steps, events out.

`EngineCore` is the synchronous part an engine implements (tests can drive it
step by step without threads). Like vLLM's `EngineCore.step()`, its commands and
`step()` never call a sink: they leave (sink, event) pairs in the core's outbox,
and `settle()` hands them over with what follows every change (admission, the
published figures). `EngineWorker` runs a core on a dedicated thread:

    while running: apply queued commands; step() if there is work (settling the commands first), else
                   expire(); settle and deliver the outputs

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

from backend.common.core import Output
from backend.common.stats import CancelOrder, EngineStats
from backend.constraints import (
    CompiledConstraint,
)
from backend.events import Event, EventBatcher, EventSink
from backend.types import GenerationRequest

log = logging.getLogger(__name__)

# How often an idle worker holding paused sequences checks their deadlines.
_PAUSED_CHECK_S = 0.1


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


class Command(enum.Enum):
    ADD = "add"
    CANCEL = "cancel"
    PAUSE = "pause"
    RESUME = "resume"
    SHUTDOWN = "shutdown"


class EngineCore(Protocol):
    """Commands and `step()` leave their outputs in the core; `settle()` returns them, in order, for the caller
    to deliver (backend.common.core.CoreBase is the shared part)."""

    stats: EngineStats

    def add(self, request: GenerationRequest, sink: EventSink, constraint: CompiledConstraint | None = None) -> None:
        """`constraint`: the request's, compiled (the engine resolves it before the core sees the request)."""
        ...

    def cancel(self, order: CancelOrder) -> None: ...

    def pause(self, request_id: str) -> None: ...

    def resume(self, request_id: str) -> None: ...

    def has_work(self) -> bool:
        """Whether step() would do anything: a waiting request or an unpaused sequence."""
        ...

    def holds_sequences(self) -> bool: ...

    def expire(self) -> None:
        """Ends every sequence whose time is up, paused or waiting ones included."""
        ...

    def step(self) -> None: ...

    def close(self) -> None:
        """Ends every request (CANCELLED) and frees the model's working memory."""
        ...

    def settle(self) -> list[Output]:
        """What follows every batch of commands or step: admission where the engine admits between steps,
        the published figures; then the outputs not handed over yet."""
        ...


class EngineWorker:
    def __init__(self, core: EngineCore, name: str = "engine") -> None:
        self._core = core
        self._commands: queue.SimpleQueue[tuple[Command, Any]] = queue.SimpleQueue()
        self.death_callbacks: list[Callable[[BaseException], None]] = []
        """Called on this thread if the loop crashes, before its requests are closed (liveness)."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest, sink: EventSink, constraint: CompiledConstraint | None = None) -> None:
        self._commands.put((Command.ADD, (request, sink, constraint)))

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
        core = self._core
        try:
            while True:
                if core.has_work():
                    timeout: float | None = 0.0
                elif core.holds_sequences():
                    timeout = _PAUSED_CHECK_S
                else:
                    timeout = None
                applied = self._apply_commands(timeout)
                if applied is None:
                    return
                if core.has_work():
                    if applied:  # admitted before the step, and what the commands produced out now
                        deliver_all(core.settle())
                    core.step()
                else:
                    core.expire()
                deliver_all(core.settle())
        except Exception as exc:  # a bug in the loop itself; per-sequence faults are handled in step()
            log.exception("engine loop crashed")
            for callback in self.death_callbacks:
                callback(exc)
            raise
        finally:
            core.close()
            deliver_all(core.settle())

    def _apply_commands(self, timeout: float | None) -> bool | None:
        """Applies every queued command, waiting up to `timeout` for the first: whether there was one; None on
        shutdown."""
        try:
            command, arg = self._commands.get(block=timeout != 0.0, timeout=timeout)
        except queue.Empty:
            return False
        core = self._core
        # Each handler takes its own command's argument, which the queue holds untyped.
        handlers: dict[Command, Callable[[Any], None]] = {
            Command.ADD: lambda arg: core.add(*arg),
            Command.CANCEL: core.cancel,
            Command.PAUSE: core.pause,
            Command.RESUME: core.resume,
        }
        while command is not Command.SHUTDOWN:
            handlers[command](arg)
            try:
                command, arg = self._commands.get_nowait()
            except queue.Empty:
                return True
        return None
