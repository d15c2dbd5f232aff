"""The owner-thread core for exllamav2's dynamic generator (see backend.worker).

The generator is not thread-safe, so only the engine thread calls it: submit
and cancel arrive as commands and are applied between `iterate()` calls.
Results become events for each request's sink by job identifier, returned to
the worker to deliver (see backend.worker); results for a job already
cancelled are dropped. An exception from `iterate()` ends every running stream
with an error and the generator is rebuilt, so the engine keeps serving. It
publishes the same EngineStats as the llama.cpp core (backend.exllamav2.figures).

Admission is the shared fairness policy's (backend.common.fairness), as on llama.cpp: jobs
wait here, and one is enqueued whenever the generator holds fewer than
max_batch_size, the most urgent and the least served caller's first; requests
past the engine's capacity are shed, and a job not started within its queue
timeout ends. When the batch is full, a more urgent request, or one of a caller
under its share after a time slice, preempts a running job: it is cancelled and
comes back as a new job that continues its stream (backend.exllamav2.preemption;
constrained jobs are never preempted). A request for n samples is n jobs
(backend.exllamav2.held).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from backend.common.core import CoreBase
from backend.common.stats import EngineStats
from backend.config import EngineConfig
from backend.constraints import CompiledConstraint
from backend.events import ErrorEvent, EventSink, FinishReason
from backend.exllamav2.admission import Admission
from backend.exllamav2.figures import engine_stats
from backend.exllamav2.held import HeldJob, JobFactory, hold
from backend.types import GenerationRequest

log = logging.getLogger(__name__)


class ExLlamaV2Core(CoreBase[HeldJob]):
    def __init__(
        self,
        make_generator: Callable[[], Any],
        make_job: JobFactory,
        eos_token_ids: tuple[int, ...],
        piece: Callable[[int], bytes],
        vocab_size: int,
        cache_tokens: int,
        config: EngineConfig = EngineConfig(),
    ) -> None:
        """`config.max_batch_size` is the generator's (1 when it runs unpaged)."""
        super().__init__(EngineStats(cache_tokens_total=cache_tokens))
        self._make_generator = make_generator
        self._generator: Any = make_generator()
        self._make_job = make_job
        self._translation = (frozenset(eos_token_ids), piece, vocab_size)
        self.held = Admission(config, make_job, self.ledger)
        self.policy = self.held.policy
        self._cache_tokens_total = cache_tokens

    def add(self, request: GenerationRequest, sink: EventSink, constraint: CompiledConstraint | None = None) -> None:
        if self._generator is None and not self._rebuild():
            self._emit(sink, ErrorEvent("the generator failed and could not be rebuilt; see the server log"))
            return
        try:
            leader = hold(request, sink, self._make_job, self._translation, self.held.turns, constraint)
        except Exception as exc:  # validation should have caught it; never let it reach iterate() or this thread
            log.exception("exllamav2 refused request %s", request.request_id)
            self._emit(sink, ErrorEvent(f"the generator refused the job: {exc}"))
            return
        self.held.queue(leader, self._generator)

    def _group(self, request_id: str) -> list[HeldJob]:
        return self.held.group(request_id)

    def pause(self, request_id: str) -> None:
        """A no-op: the generator cannot hold one job back. A slow reader's job runs on and its
        tokens wait in the request's buffer (at most max_new_tokens of them), and its cache pages
        go back to the others as soon as it ends rather than being held for a reader who may not return."""

    def resume(self, request_id: str) -> None:
        """See pause()."""

    def has_work(self) -> bool:
        return bool(self.held.jobs)

    def holds_sequences(self) -> bool:
        return bool(self.held.jobs)

    def expire(self) -> None:
        self._end_expired()

    def _end_expired(self) -> bool:
        """Ends the jobs past their deadline, and those not started within their queue timeout; True if any."""
        now = time.monotonic()
        held = len(self.held.jobs)
        for entry in [e for e in self.held.jobs.values() if e.results.deadline_passed(now)]:
            self._end(entry, FinishReason.TIME_LIMIT)
        for entry in [e for e in self.held.jobs.values() if e.results.started_at is None]:
            deadline = entry.request.queue_deadline
            if deadline is not None and now >= deadline:
                error = self.ledger.timed_out(entry)
                self.held.fail(entry, error.message, error.kind, self._generator)
        return len(self.held.jobs) < held

    def step(self) -> None:
        self.steps += 1
        # The last command or step ended with an admission pass; only places freed since need another
        # before this step (a pass over a long queue costs milliseconds: docs/benchmarks.md).
        if self._end_expired():
            self.held.admit(self._generator, self.steps)
        try:
            results = self._generator.iterate()
        except Exception as exc:  # it would end every job anyway: fail them, rebuild, carry on
            log.exception("exllamav2 iterate() failed; rebuilding the generator")
            for entry in list(self.held.jobs.values()):
                self._emit(entry.sink, ErrorEvent(f"the generator failed: {exc}"))
            self.held.clear()
            self._rebuild()
            return
        for result in results:
            found = self.held.jobs.get(result.get("identifier"))
            if found is None or not found.enqueued:
                continue  # a job cancelled between iterates: its late results are dropped
            entry = found
            if entry.results.started_at is None:  # "started" comes first, but any result means it is active
                self._started(entry)
            event = entry.results.translate(result, self.steps)
            if isinstance(event, ErrorEvent):  # its constraint failed: end it, the others carry on
                self.held.remove(entry, self._generator)
                self._emit(entry.sink, event)
            elif event is not None:
                self._emit(entry.sink, event)
                if event.tokens:
                    self.policy.charge(entry, len(event.tokens))
                    self.ledger.generated(entry, len(event.tokens))
                if event.finish is not None:
                    self.held.forget(entry)
                    usage = event.finish.usage
                    self.ledger.cached(usage.cached_tokens)
                    self.ledger.checked(usage.draft_tokens, usage.accepted_draft_tokens)

    def _started(self, entry: HeldJob) -> None:
        entry.results.started_at = time.monotonic()
        prompt_tokens = len(entry.request.prompt_token_ids)
        self.ledger.started(entry, prompt_tokens)
        if not entry.request.sample_index:  # a request's other samples share its prompt's pages (see held)
            self.policy.charge(entry, prompt_tokens)

    def _rebuild(self) -> bool:
        """A fresh generator; None, and False, when that fails too (the next request tries again)."""
        _stop_threads(self._generator)
        try:
            self._generator = self._make_generator()
        except Exception:
            log.exception("exllamav2 generator rebuild failed")
            self._generator = None
        return self._generator is not None

    def close(self) -> None:
        for entry in list(self.held.jobs.values()):
            self._end(entry, FinishReason.CANCELLED)
        _stop_threads(self._generator)

    def _end(self, entry: HeldJob, reason: FinishReason) -> None:
        """Ends it with a finish, and the samples still waiting on it with theirs."""
        self.held.remove(entry, self._generator)
        for ended in (entry, *entry.samples):
            self._emit(ended.sink, ended.results.end(reason, self.steps))

    def _settle(self) -> None:
        """After every step and batch of commands: admit what can start in the next step, publish the figures."""
        self.held.admit(self._generator, self.steps + 1)
        self._outputs += self.held.outputs
        self.held.outputs.clear()
        self.stats = engine_stats(
            self.ledger, self.steps, list(self.held.jobs.values()), self._generator, self._cache_tokens_total
        )


def _stop_threads(generator: Any) -> None:
    """0.3.2's generator starts two 16-worker pools (sampling, and filters) and never stops them:
    each generator replaced without this would leak their threads."""
    for name in ("sampling_pool", "filter_pool"):
        pool = getattr(generator, name, None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
