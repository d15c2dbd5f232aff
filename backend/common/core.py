"""What every engine core shares (backend.worker runs them): the outbox, the step count, the ledger and
the published figures, and `cancel` written once over each core's own `_group` and `_end`.

A core's commands and `step()` only append (sink, event) pairs to the outbox; `settle()` is the one way
they leave. The worker calls it once after each batch of commands and once after each step, so what
follows every change (admission between steps, the published figures) runs once per batch, however
many commands the batch held.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Generic, TypeVar

from backend.common.ledger import Ledger
from backend.common.stats import CancelOrder, EngineStats
from backend.events import Event, EventSink, FinishReason

log = logging.getLogger(__name__)

Output = tuple[EventSink, Event]
"""One event for one request's sink, as a core hands it over."""

Item = TypeVar("Item")
"""What a core holds per sequence (its Sequence, SampleJob, ...)."""


class CoreBase(Generic[Item]):
    def __init__(self, stats: EngineStats) -> None:
        self._outputs: list[Output] = []
        self.steps = 0
        self.ledger = Ledger()
        self.stats = stats
        """The snapshot `settle()` publishes (one reference assignment: atomic for readers on other threads)."""

    def cancel(self, order: CancelOrder) -> None:
        """Ends every sequence of the request (CANCELLED) and counts how long the cancel took to serve."""
        group = self._group(order.request_id)
        if not group:
            return  # finished already: nothing to free
        for item in group:
            self._end(item, FinishReason.CANCELLED)
        self.ledger.cancelled(order, self.steps, time.monotonic())

    def end_leftovers(self, request_id: str) -> None:
        """Before a request joins: a front end frees an id only once its request ended or was cancelled, so
        anything still holding that id here is a leftover (a ghost). It ends now (CANCELLED), never to share the
        core's bookkeeping, keyed by id, with the new request."""
        leftovers = self._group(request_id)
        if leftovers:
            log.warning("request %s arrived while %d sequence(s) of that id still ran: ended", request_id, len(leftovers))
        for item in leftovers:
            self._end(item, FinishReason.CANCELLED)

    def settle(self) -> list[Output]:
        """What follows a batch of commands or a step (`_settle`: admission, the figures), then the outbox."""
        self._settle()
        outputs, self._outputs = self._outputs, []
        return outputs

    def _emit(self, sink: EventSink, event: Event) -> None:
        self._outputs.append((sink, event))

    # -- each core's own ------------------------------------------------------------

    def _group(self, request_id: str) -> Sequence[Item]:
        """Every sequence the request holds here (its samples, waiting or running)."""
        raise NotImplementedError

    def _end(self, item: Item, reason: FinishReason) -> None:
        """Ends one sequence with `reason` (its finish in the outbox) and frees what it holds."""
        raise NotImplementedError

    def _settle(self) -> None:
        """Publishes `stats` (and admits, where the core admits between steps)."""
        raise NotImplementedError
