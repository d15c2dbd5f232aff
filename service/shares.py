"""Admission at the door: one bounded capacity (batch places and queue places) that callers share, and
each caller's own limit. Decided on the event loop, before a request is validated or compiled.

- A caller holding `max_running_per_caller + max_queued_per_caller` requests is refused
  (RESOURCE_EXHAUSTED, CALLER_OVER_LIMIT), whatever the others do; by default that is the whole
  capacity, so a caller alone may use the whole server.
- When the server is full, a request is still let in if its priority is not negative and its caller
  holds less than its share of the capacity (capacity x its weight / the weights of the callers
  holding requests, itself included), or more requests of lower priority are in flight than have
  been let in past full. The engine then sheds the least entitled waiting request
  (backend.fairness: the lowest priority, of the caller holding the most per weight, the newest),
  so the total stays bounded and the flood pays, not the newcomer. Otherwise the request is
  refused (RESOURCE_EXHAUSTED, OVERLOADED).
- Under `scheduling = fifo`, full is full.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

from service.errors import caller_over_limit, overloaded

# Callers whose refusals are counted for GetServerStatus; past it the one refused least is forgotten.
_MAX_COUNTED_CALLERS = 256


class Shares:
    def __init__(self, capacity: int, per_caller_limit: int, fair: bool) -> None:
        self.capacity = capacity
        self.per_caller_limit = per_caller_limit
        self._fair = fair
        self._held: collections.Counter[str] = collections.Counter()
        self._weights: dict[str, float] = {}
        self._priorities: collections.Counter[int] = collections.Counter()
        self.refused: collections.Counter[str] = collections.Counter()
        """Requests refused at the door, per fairness key (CALLER_OVER_LIMIT or OVERLOADED)."""

    @property
    def total(self) -> int:
        return sum(self._held.values())

    def check(self, key: str, weight: float, priority: int, places: int = 1) -> None:
        """Raises ServiceError (counted in `refused`) when a request of this caller, for `places` sequences
        (its samples), may not come in now."""
        held, total = self._held[key], self.total
        if total + places > self.capacity and not self._may_displace(key, weight, priority):
            self._refuse(key)
            raise overloaded(total, self.capacity)
        if held + places > self.per_caller_limit:
            self._refuse(key)
            raise caller_over_limit(held, self.per_caller_limit)

    @contextlib.contextmanager
    def hold(self, key: str, weight: float, priority: int, places: int = 1) -> Iterator[None]:
        """Holds places for one request's sequences (that `check` let in) while it runs."""
        self._held[key] += places
        self._weights[key] = weight
        self._priorities[priority] += places
        try:
            yield
        finally:
            self._held[key] -= places
            if not self._held[key]:
                del self._held[key], self._weights[key]
            self._priorities[priority] -= places
            if not self._priorities[priority]:
                del self._priorities[priority]

    def _may_displace(self, key: str, weight: float, priority: int) -> bool:
        if not self._fair or priority < 0:
            return False
        lower = sum(count for p, count in self._priorities.items() if p < priority)
        if lower > self.total - self.capacity:  # one less urgent request for each let in past full
            return True
        weights = sum(w for k, w in self._weights.items() if k != key) + weight
        return self._held[key] < self.capacity * weight / weights

    def _refuse(self, key: str) -> None:
        self.refused[key] += 1
        if len(self.refused) > _MAX_COUNTED_CALLERS:
            least, _ = min(self.refused.items(), key=lambda item: item[1])
            del self.refused[least]
