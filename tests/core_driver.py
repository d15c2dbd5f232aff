"""Drives an engine core in-process the way backend.worker does: every call's outputs are delivered."""

from __future__ import annotations

import time
from typing import Any

from backend.engine import CancelOrder
from backend.worker import deliver_all

_COMMANDS = frozenset({"add", "cancel", "pause", "resume", "expire", "step", "close"})


class Delivering:
    """Wraps a core; its commands deliver the events they return to the requests' sinks, and return them too."""

    def __init__(self, core: Any) -> None:
        self.core = core

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.core, name)
        if name not in _COMMANDS:
            return attribute

        def command(*args, **kwargs):
            if name == "cancel" and isinstance(args[0], str):  # as the worker issues it, now
                args = (CancelOrder(args[0], time.monotonic(), self.core.steps),)
            outputs = attribute(*args, **kwargs)
            deliver_all(outputs)
            return outputs

        return command
