"""The one thread that owns a model: commands in, steps, events out.

`EngineCore` is the synchronous part an engine implements (tests can drive it
step by step without threads); `EngineWorker` runs it on a dedicated thread:

    while running: apply queued commands; if there is work, step()

It blocks on the command queue only while there is nothing to do.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
from typing import Any, Protocol

from backend.engine import EventSink
from backend.types import GenerationRequest

log = logging.getLogger(__name__)


class Command(enum.Enum):
    ADD = "add"
    CANCEL = "cancel"
    SHUTDOWN = "shutdown"


class EngineCore(Protocol):
    def add(self, request: GenerationRequest, sink: EventSink) -> None: ...

    def cancel(self, request_id: str) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> None: ...

    def close(self) -> None: ...


class EngineWorker:
    def __init__(self, core: EngineCore, name: str = "engine") -> None:
        self._core = core
        self._commands: queue.SimpleQueue[tuple[Command, Any]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest, sink: EventSink) -> None:
        self._commands.put((Command.ADD, (request, sink)))

    def cancel(self, request_id: str) -> None:
        self._commands.put((Command.CANCEL, request_id))

    def close(self) -> None:
        if self._thread.is_alive():
            self._commands.put((Command.SHUTDOWN, None))
            self._thread.join()

    def _run(self) -> None:
        try:
            while self._apply_commands(block=not self._core.has_work()):
                if self._core.has_work():
                    self._core.step()
        except Exception:  # a bug in the loop itself; per-sequence faults are handled in step()
            log.exception("engine loop crashed")
            raise
        finally:
            self._core.close()

    def _apply_commands(self, block: bool) -> bool:
        """Applies every queued command; returns False on shutdown."""
        try:
            command, arg = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if command is Command.SHUTDOWN:
                return False
            if command is Command.ADD:
                self._core.add(*arg)
            else:
                self._core.cancel(arg)
            try:
                command, arg = self._commands.get_nowait()
            except queue.Empty:
                return True
