"""How many threads llama.cpp computes with, when the `threads` setting leaves it to the engine.

llama.cpp's threads wait for each other at every operation. On a quiet machine every core decodes
fastest (2 threads 1.6-1.8x faster than 1 on 2 cores); when anything else wants a core, a thread
that loses its core stalls the others, and every core becomes 10-50x slower than every core but one
(docs/benchmarks.md). Neither count is right on a machine whose load changes, so the engine tries:
it decodes with one count, now and then decodes a few steps with the other, and keeps whichever
took less time per row (prompt chunks and decoding steps alike, each by its size: DecodeCosts.work).
It starts on every core but one, safe on a loaded machine, and tries the other after FIRST_PROBE
decodes, so a quiet machine's cores are all at work from the first prompts on. A probe that loses
waits at least FIRST_INTERVAL decodes for the next, twice as long each time, up to MAX_INTERVAL; one
whose first step is far slower ends at once, so a probe on a loaded machine costs one slow step. When
the steps of the count in use turn far slower than they were (another process took a core), the
other count is tried at once.

Each count keeps its own DecodeCosts, so the speculation planner always weighs what rows cost with
the threads it will run.
"""

from __future__ import annotations

import logging
import statistics

from backend.common.cores import usable_cores
from backend.llamacpp.speculation.costs import DecodeCosts

FIRST_PROBE = 1
"""Decodes before the first probe: the incumbent's pace, roughly (a cold first decode favours the probe, which its
own PROBE_STEPS then confirm or not; on a loaded machine its first step ends it)."""
FIRST_INTERVAL = 200
"""Decodes before the next probe after one that wins, and at least after one that loses."""
log = logging.getLogger(__name__)

MAX_INTERVAL = 6400
PROBE_STEPS = 6
WIN = 0.9
"""A probe wins when its time per row is under this share of the steps just before it."""
ABORT = 3.0
"""A probe ends at its first step when that step's time per row is over this many times theirs."""


class ThreadTuner:
    def __init__(self, fixed: int = 0, cores: int | None = None, plain_row_share: float = 0.8) -> None:
        cores = cores or usable_cores()
        self.candidates = [fixed] if fixed else sorted({cores, max(1, cores - 1)}, reverse=True)
        self.costs = {threads: DecodeCosts(plain_row_share) for threads in self.candidates}
        self.incumbent = self.candidates[-1]  # every core but one: safe on a loaded machine
        self.threads = self.incumbent
        self._interval = FIRST_PROBE
        self._since_probe = 0
        self._recent: list[float] = []  # the incumbent's time per row, its last PROBE_STEPS decodes
        self._typical: float | None = None  # ... and its moving average over many more
        self._probe: list[float] = []

    @property
    def current_costs(self) -> DecodeCosts:
        return self.costs[self.threads]

    def record(self, passes: int, rows: int, logit_rows: int, seconds: float) -> int:
        """Takes one decode's time; returns the thread count for the next."""
        self.current_costs.record(passes, rows, logit_rows, seconds)
        per_row = seconds / self.current_costs.work(passes, rows, logit_rows)
        if self.threads == self.incumbent:
            self._recent = [*self._recent, per_row][-PROBE_STEPS:]
            self._since_probe += 1
            slowed = self._typical is not None and statistics.median(self._recent) > ABORT * self._typical
            self._typical = per_row if self._typical is None else 0.95 * self._typical + 0.05 * per_row
            due = self._since_probe >= self._interval or (slowed and len(self._recent) == PROBE_STEPS)
            if len(self.candidates) > 1 and due:
                self.threads = next(t for t in self.candidates if t != self.incumbent)
                self._probe = []
            return self.threads
        self._probe.append(per_row)
        before = statistics.median(self._recent)
        if len(self._probe) == 1 and per_row > ABORT * before:
            return self._settle(won=False)
        if len(self._probe) >= PROBE_STEPS:
            return self._settle(won=statistics.median(self._probe) < WIN * before)
        return self.threads

    def _settle(self, won: bool) -> int:
        if won:
            log.info("llama.cpp now computes with %d threads (%d decoded slower here)", self.threads, self.incumbent)
            self.incumbent, self._interval = self.threads, FIRST_INTERVAL
            self._typical = statistics.median(self._probe)  # what it proved it does
        else:  # the incumbent's pace now is the normal: a machine slow for both counts is not probed again at once
            self._interval = min(MAX_INTERVAL, max(FIRST_INTERVAL, 2 * self._interval))
            self._typical = statistics.median(self._recent)
        self.threads, self._since_probe, self._recent = self.incumbent, 0, []
        return self.threads
