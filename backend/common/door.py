"""Admission at the engine's door: one bounded capacity (batch places and queue places) that callers
share, and each caller's own limit. Decided when a request is submitted, for every front end at once
(one caller's flood through two front ends is still one caller), before the engine queues it.

- A caller holding `max_running_per_caller + max_queued_per_caller` requests is refused
  (CALLER_OVER_LIMIT), whatever the others do; by default that is the whole capacity, so a caller
  alone may use the whole server.
- When the server is full, a request is still let in if its priority is not negative and its caller
  holds less than its share of the capacity (capacity x its weight / the weights of the callers
  holding requests, itself included), or more requests of lower priority are in flight than have
  been let in past full. The engine then sheds the least entitled waiting request
  (backend.common.fairness: the lowest priority, of the caller holding the most per weight, the
  newest), so the total stays bounded and the flood pays, not the newcomer. Otherwise the request is
  refused (OVERLOADED).
- Under `scheduling = fifo`, full is full.

A request's places are held from `enter` until its caller is done with it (`leave`), whether the
engine ended it or not.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

from backend.events import ErrorEvent, ErrorKind

# Callers whose refusals are counted for GetServerStatus; past it the one refused least is forgotten.
_MAX_COUNTED_CALLERS = 256


@dataclass(frozen=True)
class _Held:
    key: str
    weight: float
    priority: int
    places: int


class Door:
    """Thread-safe."""

    def __init__(self, capacity: int, per_caller_limit: int, fair: bool) -> None:
        self.capacity = capacity
        self.per_caller_limit = per_caller_limit
        self._fair = fair
        self._lock = threading.Lock()
        self._requests: dict[str, _Held] = {}
        self._held: collections.Counter[str] = collections.Counter()
        self._weights: dict[str, float] = {}
        self._priorities: collections.Counter[int] = collections.Counter()
        self.total = 0
        self.refused: collections.Counter[str] = collections.Counter()
        """Requests refused, per fairness key (CALLER_OVER_LIMIT or OVERLOADED)."""
        self.refused_total = 0

    def enter(self, request_id: str, key: str, weight: float, priority: int, places: int = 1) -> ErrorEvent | None:
        """Holds `places` (the request's samples) for the request, or says why it may not come in now."""
        with self._lock:
            refusal = self._refusal(key, weight, priority, places)
            if refusal is not None:
                self._refuse(key)
                return refusal
            self._requests[request_id] = _Held(key, weight, priority, places)
            self._held[key] += places
            self._weights[key] = weight
            self._priorities[priority] += places
            self.total += places
            return None

    def leave(self, request_id: str) -> None:
        """Gives the request's places back (nothing, for one never let in or already gone)."""
        with self._lock:
            held = self._requests.pop(request_id, None)
            if held is None:
                return
            self._held[held.key] -= held.places
            if not self._held[held.key]:
                del self._held[held.key], self._weights[held.key]
            self._priorities[held.priority] -= held.places
            if not self._priorities[held.priority]:
                del self._priorities[held.priority]
            self.total -= held.places

    def refusals(self) -> tuple[int, tuple[tuple[str, int], ...]]:
        """Requests refused, in all and per caller."""
        with self._lock:
            return self.refused_total, tuple(self.refused.items())

    def _refusal(self, key: str, weight: float, priority: int, places: int) -> ErrorEvent | None:
        held, total = self._held[key], self.total
        if total + places > self.capacity and not self._may_displace(key, weight, priority):
            return ErrorEvent(f"the server is full ({total} of {self.capacity} requests running or queued); retry later",
                              ErrorKind.OVERLOADED)
        if held + places > self.per_caller_limit:
            return ErrorEvent(f"you have {held} requests running or queued here, the most one caller may "
                              f"({self.per_caller_limit}); retry later", ErrorKind.CALLER_OVER_LIMIT)
        return None

    def _may_displace(self, key: str, weight: float, priority: int) -> bool:
        if not self._fair or priority < 0:
            return False
        lower = sum(count for p, count in self._priorities.items() if p < priority)
        if lower > self.total - self.capacity:  # one less urgent request for each let in past full
            return True
        weights = sum(w for k, w in self._weights.items() if k != key) + weight
        return self._held[key] < self.capacity * weight / weights

    def _refuse(self, key: str) -> None:
        self.refused_total += 1
        self.refused[key] += 1
        if len(self.refused) > _MAX_COUNTED_CALLERS:
            least, _ = min(self.refused.items(), key=lambda item: item[1])
            del self.refused[least]
