"""The first-token hold: after a step that gave a sequence its first token, the next step waits
first_token_hold_ms, unless another request still waits for its own first token (it would wait too).

llama.cpp's threads take every core they are given; so held, the threads that send that token (the
service's, a sidecar's, a local caller's on the same cores) run before the next decode: a first token
reached its caller 1-5 ms sooner in seven rounds of eight (`python -m bench first_token`, docs/benchmarks.md).
"""

from __future__ import annotations

import time

from backend.events import Event, TokenEvent
from backend.llamacpp.scheduler import Scheduler


class FirstTokenHold:
    def __init__(self, hold_ms: float) -> None:
        self.hold_s = hold_ms / 1000
        self._started = False
        """A step since the last hold gave a sequence its first token."""

    def note(self, event: Event) -> None:
        """Called for every event a step produces."""
        if type(event) is TokenEvent and event.tokens and event.generated_tokens == len(event.tokens):
            self._started = True

    def before_step(self, scheduler: Scheduler) -> None:
        """Waits, when the last step started a stream and nobody else waits for a first token."""
        started, self._started = self._started, False
        if not started or not self.hold_s or scheduler.waiting:
            return
        if any(seq.output.first_token_at is None for seq in scheduler.running.values()):
            return
        time.sleep(self.hold_s)
