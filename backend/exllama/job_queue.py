"""What the exllama core holds, and what enters the generator: the queue, shedding, a request's
samples, and preemption (engine thread only).

Jobs wait here, and one is enqueued whenever the generator holds fewer than max_batch_size, in
the order the shared fairness policy ranks them (backend.common.fairness); past the engine's
capacity the least entitled request waiting is shed. When the batch is full, the policy may name
a job to give way (a less urgent one at once, or after a time slice one of a caller over its
share): it is cancelled in the generator and comes back as a job that continues its stream
(backend.exllama.preemption). A request's other samples are enqueued right behind its first
(backend.exllama.job).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

from backend.common.core import Output
from backend.common.fairness import FairnessPolicy, HeldCallers
from backend.common.ledger import Ledger
from backend.config import EngineConfig
from backend.events import ErrorEvent, ErrorKind
from backend.exllama.job import JobFactory, SampleJob
from backend.exllama.preemption import comeback_cost, continuation, may_give_way, victim_for, why

log = logging.getLogger(__name__)


class JobQueue:
    def __init__(self, config: EngineConfig, make_job: JobFactory, page_size: int, ledger: Ledger) -> None:
        """`config.max_batch_size` is the generator's (1 when exllamav2 runs unpaged); `page_size` its cache page's."""
        self.policy = FairnessPolicy(config)
        self.jobs: dict[str, SampleJob] = {}
        """Every job held, in the queue or in the generator (a leader's samples join when it is enqueued)."""
        self.waiting: list[SampleJob] = []
        """Not in the generator: not started yet, or preempted."""
        self._holders = HeldCallers()
        self.turns = itertools.count()
        self._max_batch_size = config.max_batch_size
        self._page_size = page_size
        self._make_job = make_job
        self._ledger = ledger
        self.outputs: list[Output] = []
        """The errors it ended jobs with (shed, refused), for the core to deliver."""

    def enqueued(self) -> list[SampleJob]:
        return [entry for entry in self.jobs.values() if entry.enqueued]

    def group(self, request_id: str) -> list[SampleJob]:
        """Every sample of a request held (one, unless it asked for several)."""
        return [entry for entry in self.jobs.values() if entry.group == request_id]

    def add(self, entry: SampleJob, generator: Any) -> None:
        """Into the queue as a new request; past capacity, the least entitled request waiting is shed."""
        self.policy.arrived(entry, self.waiting, self.enqueued(), self._holders.callers())
        self.jobs[entry.request.request_id] = entry
        self._holders.add(entry)
        self.waiting.append(entry)
        while len(self.jobs) > self.policy.capacity:
            shed = self.policy.to_shed([e for e in self.waiting if not e.preempted], list(self.jobs.values()))
            if shed is None:
                break
            error = self._ledger.shed(shed)
            self.fail(shed, error.message, error.kind, generator)

    def admit(self, generator: Any, step: int) -> None:
        """Enqueues the jobs the policy picks while there is a place in the batch (the free places filled from
        one ranking), or one to take."""
        while generator is not None and self.waiting:
            enqueued = self.enqueued()
            filling = self.policy.fill(self._candidates(), enqueued, self._max_batch_size)
            for entry in filling:
                forks = bool(entry.samples)
                self._start(entry, generator, step)
                if forks:  # its other samples took places of their own behind it: rank again
                    break
            if filling:
                continue
            placed = self._place(enqueued, step)
            if placed is None:
                return
            entry, victim = placed
            if victim is not None:
                self._preempt(victim, entry, generator)
            self._start(entry, generator, step)

    def _candidates(self) -> list[SampleJob]:
        return sorted(self.waiting, key=lambda entry: entry.turn)

    def _start(self, entry: SampleJob, generator: Any, step: int) -> None:
        """From the queue into the generator, its other samples behind it."""
        self.waiting.remove(entry)
        if self._enqueue(entry, generator, step):
            self._release_samples(entry, generator, step)

    def _place(self, enqueued: list[SampleJob], step: int) -> tuple[SampleJob, SampleJob | None] | None:
        """The waiting job the policy starts next, and the one in the generator it displaces (see
        FairnessPolicy.place); None when none can start."""
        willing: list[SampleJob] | None = None

        def victim(entry: SampleJob) -> SampleJob | None:
            nonlocal willing
            if willing is None:  # the same for every candidate of the pass
                willing = [job for job in enqueued if may_give_way(job)]
            return victim_for(self.policy, entry, enqueued, willing, step, self._page_size)

        return self.policy.place(self._candidates(), enqueued, self._max_batch_size, victim)

    def _enqueue(self, entry: SampleJob, generator: Any, step: int) -> bool:
        try:
            generator.enqueue(entry.job)
        except Exception as exc:  # e.g. both generations assert when the job can never fit the cache
            log.exception("the generator refused request %s", entry.request.request_id)
            self.forget(entry)
            self.outputs.append((entry.sink, ErrorEvent(f"the generator refused the job: {exc}")))
            return False
        entry.enqueued, entry.admitted_step = True, step
        return True

    def _release_samples(self, leader: SampleJob, generator: Any, step: int) -> None:
        """A leader's other samples: right behind it where the batch has places (they share its prompt
        pages; the policy is not asked, as llama.cpp forks them), else queued as any request is."""
        samples, leader.samples = leader.samples, []
        for sample in samples:
            if len(self.enqueued()) < self._max_batch_size:
                self.jobs[sample.request.request_id] = sample
                self._holders.add(sample)
                self._enqueue(sample, generator, step)
            else:
                self.add(sample, generator)

    def _preempt(self, victim: SampleJob, newcomer: SampleJob, generator: Any) -> None:
        """Cancels the victim's job and queues the one that continues it."""
        generator.cancel(victim.job)  # frees its pages, which keep their keys and values
        victim.enqueued, computed = False, victim.started
        try:
            victim.job = continuation(victim, self._make_job, self._page_size)
        except Exception as exc:
            log.exception("could not continue preempted request %s", victim.request.request_id)
            self.forget(victim)
            self.outputs.append((victim.sink, ErrorEvent(f"the generator refused the job that continues it: {exc}")))
            return
        self.waiting.append(victim)
        self._ledger.preempted(victim)
        if computed:  # what its comeback is expected to compute again, its pages kept
            self._ledger.recomputed(comeback_cost(victim, self._page_size))
        log.info("preempted %s (%s, %d tokens) for %s", victim.request.request_id, why(victim, newcomer),
                 len(victim.tokens), newcomer.request.request_id)

    def remove(self, entry: SampleJob, generator: Any) -> None:
        """Out of the generator (its pages freed; it emits nothing) or the queue, and forgotten."""
        if entry.enqueued:
            generator.cancel(entry.job)
        else:
            self.waiting.remove(entry)
        self.forget(entry)

    def forget(self, entry: SampleJob) -> None:
        del self.jobs[entry.request.request_id]
        if self._holders.remove(entry):
            self.policy.left(self._holders.callers())

    def fail(self, entry: SampleJob, message: str, kind: ErrorKind, generator: Any) -> None:
        """Ends it with an error (the service then ends the whole request: samples waiting on it too)."""
        self.remove(entry, generator)
        self.outputs.append((entry.sink, ErrorEvent(message, kind)))

    def clear(self) -> None:
        """Forgets everything (the generator failed and every job with it)."""
        self.jobs.clear()
        self.waiting.clear()
        self._holders.clear()
        self.policy.left(set())
