"""Drives an engine core in-process the way backend.worker does: every call's outputs are delivered."""

from __future__ import annotations

from typing import Any

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
            outputs = attribute(*args, **kwargs)
            deliver_all(outputs)
            return outputs

        return command
