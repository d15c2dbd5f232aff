"""What an engine served and refused, counted once: the ledger both engine cores keep.

Each verb counts one event where it happens, for the engine as a whole (EngineCounters) and for
the caller it was for (CallerTallies), and the refusals are worded here, so both engines say the
same:

    started     a request entered the batch for the first time (its prompt tokens)
    cached      prompt tokens taken from the prefix cache instead of being computed
    generated   output tokens a caller received
    checked     proposed tokens checked, and the ones accepted (speculative decoding)
    preempted   a running sequence gave its place to another
    recomputed  tokens computed again when a preempted sequence came back
    retiled     tokens computed again as prompt rows when a sequence ended (to be shared)
    cancelled   a cancel ended a request (how long it took to serve)
    shed        a waiting request refused, the engine over its capacity (its ErrorEvent)
    timed_out   a waiting request not started within its queue timeout (its ErrorEvent)

`snapshot` publishes it all as one EngineStats. Engine thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Unpack

from backend.common.fairness import Held, caller_of
from backend.common.stats import CallerTally, CancelOrder, EngineCounters, EngineStats, LiveFigures
from backend.events import ErrorEvent, ErrorKind

MAX_TRACKED_CALLERS = 256
"""Callers whose totals are kept for GetServerStatus beyond those holding requests now."""
SHED = ("the server is full and this request gave its queue place to a caller under its share or of higher "
        "priority; retry later or elsewhere")


class Ledger:
    def __init__(self) -> None:
        self.totals = EngineCounters()
        self.callers = CallerTallies()

    def started(self, item: Held, prompt_tokens: int) -> None:
        self.totals.started(prompt_tokens)
        self.callers.of(item).prompt_tokens_total += prompt_tokens

    def cached(self, tokens: int) -> None:
        self.totals.cached_prompt_tokens_total += tokens

    def generated(self, item: Held, tokens: int) -> None:
        self.callers.of(item).generated_tokens_total += tokens

    def checked(self, proposed: int, accepted: int) -> None:
        self.totals.draft_tokens_total += proposed
        self.totals.accepted_draft_tokens_total += accepted

    def preempted(self, item: Held) -> None:
        self.totals.preempted_total += 1
        self.callers.of(item).preempted_total += 1

    def recomputed(self, tokens: int) -> None:
        self.totals.recomputed_tokens_total += tokens

    def retiled(self, tokens: int) -> None:
        self.totals.retiled_tokens_total += tokens

    def cancelled(self, order: CancelOrder, step: int, now: float) -> None:
        self.totals.cancelled(order, step, now)

    def shed(self, item: Held) -> ErrorEvent:
        self.totals.shed_total += 1
        self.callers.of(item).shed_total += 1
        return ErrorEvent(SHED, ErrorKind.SHED)

    def timed_out(self, item: Held) -> ErrorEvent:
        self.callers.of(item).queue_timeouts_total += 1
        timeout_ms = (item.request.scheduling.queue_timeout_s or 0.0) * 1000
        return ErrorEvent(f"not started within its queue_timeout_ms ({timeout_ms:g} ms)", ErrorKind.QUEUE_TIMEOUT)

    def snapshot(
        self, running: Iterable[Held], queued: Iterable[Held], preempted: Iterable[Held], **live: Unpack[LiveFigures]
    ) -> EngineStats:
        """The totals, each caller's with who runs, queues and waits preempted, and the engine's live
        figures (steps, cache use, ...), as one EngineStats."""
        return self.totals.snapshot(callers=self.callers.snapshot(running, queued, preempted), **live)


_LiveCounts = tuple[tuple[tuple[str, int], ...], ...]
"""Callers' running, queued and preempted counts, as (caller, count) pairs sorted by caller."""


class CallerTallies:
    """Totals per caller, bounded: past MAX_TRACKED_CALLERS the idle caller served least is forgotten."""

    REFRESH_S = 0.1
    """A snapshot is taken again after this long, or at once when who holds what changes: copying every
    tracked caller each engine step cost up to a millisecond a step, and its totals are for monitoring."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._tallies: dict[str, CallerTally] = {}
        self._clock = clock
        self._last: tuple[tuple[CallerTally, ...], _LiveCounts, float] | None = None  # (snapshot, live counts, taken at)

    def of(self, item: Held) -> CallerTally:
        return self._tally(caller_of(item), item.request.scheduling.weight)

    def _tally(self, caller: str, weight: float) -> CallerTally:
        """The caller's tally (made if new), with the weight its latest request has."""
        tally = self._tallies.get(caller)
        if tally is None:
            tally = self._tallies[caller] = CallerTally(caller)
        tally.weight = weight
        return tally

    def snapshot(
        self, running: Iterable[Held], queued: Iterable[Held], preempted: Iterable[Held]
    ) -> tuple[CallerTally, ...]:
        """Every tracked caller with its live counts, busiest first (at most REFRESH_S old while the live
        counts stay as they are)."""
        live: dict[str, dict[str, int]] = {}
        weights: dict[str, float] = {}  # each caller's weight as its last item has it, as `of` sets it
        for name, items in (("running", running), ("queued", queued), ("preempted", preempted)):
            counts: dict[str, int] = {}
            for item in items:  # caller_of and `of` inlined: this runs over every held item after each step and command batch
                scheduling = item.request.scheduling
                counts[scheduling.caller] = counts.get(scheduling.caller, 0) + 1
                weights[scheduling.caller] = scheduling.weight
            live[name] = counts
        for caller, weight in weights.items():
            self._tally(caller, weight)
        key, now = tuple(tuple(sorted(counts.items())) for counts in live.values()), self._clock()
        if self._last is not None and self._last[1] == key and now - self._last[2] < self.REFRESH_S:
            return self._last[0]
        tallies = sorted(
            (CallerTally(**{**vars(tally), **{name: counts.get(tally.caller, 0) for name, counts in live.items()}})
             for tally in self._tallies.values()),
            key=lambda t: (-(t.running + t.queued + t.preempted), -(t.prompt_tokens_total + t.generated_tokens_total)),
        )
        for forgotten in tallies[MAX_TRACKED_CALLERS:]:  # idle ones, served least (callers holding requests stay)
            if not (forgotten.running or forgotten.queued or forgotten.preempted):
                del self._tallies[forgotten.caller]
        snapshot = tuple(tallies[:MAX_TRACKED_CALLERS])
        self._last = (snapshot, key, now)
        return snapshot
