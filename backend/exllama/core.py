"""The owner-thread core for either exllama generation's dynamic generator (see backend.worker).

Neither generator is thread-safe, so only the engine thread calls it: submit and cancel arrive as
commands and are applied between `iterate()` calls. Results become events for each request's sink
by job identifier (backend.exllama.results); results for a job already cancelled are dropped. A
result that reports one job failed (exllamav3 contains such failures to the job) ends that request
with an error; an exception from `iterate()` ends every running stream with an error and the
generator is rebuilt, so the engine keeps serving. It publishes the same EngineStats as the
llama.cpp core (backend.exllama.figures). What differs between the generations is the binding's
(backend.exllama.binding).

Admission is the shared fairness policy's (backend.common.fairness), as on llama.cpp: jobs
wait here, and one is enqueued whenever the generator holds fewer than max_batch_size, the most
urgent and the least served caller's first; requests past the engine's capacity are shed, and a
job not started within its queue timeout ends. When the batch is full, a more urgent request, or
one of a caller under its share after a time slice, preempts a running job: it is cancelled and
comes back as a new job that continues its stream (backend.exllama.preemption; constrained jobs
are never preempted). A request for n samples is n jobs (backend.exllama.job).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from backend.common.core import CoreBase
from backend.common.stats import EngineStats
from backend.config import EngineConfig
from backend.constraints import CompiledConstraint
from backend.events import ErrorEvent, EventSink, FinishReason, TokenEvent
from backend.exllama.binding import GeneratorBinding
from backend.exllama.figures import engine_stats
from backend.exllama.job import SampleJob, jobs_for
from backend.exllama.job_queue import JobQueue
from backend.exllama.results import Translation
from backend.types import GenerationRequest

log = logging.getLogger(__name__)


class ExllamaCore(CoreBase[SampleJob]):
    def __init__(self, binding: GeneratorBinding, translation: Translation, cache_tokens: int,
                 config: EngineConfig = EngineConfig()) -> None:
        """`config.max_batch_size` is the generator's (1 when exllamav2 runs unpaged)."""
        super().__init__(EngineStats(cache_tokens_total=cache_tokens))
        self._binding = binding
        self._translation = translation
        self._cache_tokens_total = cache_tokens
        self.queue = JobQueue(config, binding.new_job, binding.page_size, self.ledger)
        self._generator: Any = binding.new_generator()

    def add(self, request: GenerationRequest, sink: EventSink, constraint: CompiledConstraint | None = None) -> None:
        self.end_leftovers(request.request_id)
        if self._generator is None and not self._rebuild():
            self._emit(sink, ErrorEvent("the generator failed and could not be rebuilt; see the server log"))
            return
        try:
            leader = jobs_for(request, sink, self._binding.new_job, self._translation, self.queue.turns, constraint)
        except Exception as exc:  # validation should have caught it; never let it reach iterate() or this thread
            log.exception("the generator refused request %s", request.request_id)
            self._emit(sink, ErrorEvent(f"the generator refused the job: {exc}"))
            return
        self.queue.add(leader, self._generator)

    def _group(self, request_id: str) -> list[SampleJob]:
        return self.queue.group(request_id)

    def pause(self, request_id: str) -> None:
        """A no-op: the generator cannot hold one job back. A slow reader's job runs on and its
        tokens wait in the request's buffer (at most max_new_tokens of them), and its cache pages
        go back to the others as soon as it ends rather than being held for a reader who may not return."""

    def resume(self, request_id: str) -> None:
        """See pause()."""

    def has_work(self) -> bool:
        return bool(self.queue.jobs)

    def holds_sequences(self) -> bool:
        return bool(self.queue.jobs)

    def expire(self) -> None:
        self._end_expired()

    def _end_expired(self) -> bool:
        """Ends the jobs past their deadline, and those not started within their queue timeout; True if any."""
        now = time.monotonic()
        held = len(self.queue.jobs)
        for entry in [e for e in self.queue.jobs.values() if e.results.clock.deadline_passed(now)]:
            self._end(entry, FinishReason.TIME_LIMIT)
        for entry in [e for e in self.queue.jobs.values() if not e.started]:
            deadline = entry.request.queue_deadline
            if deadline is not None and now >= deadline:
                error = self.ledger.timed_out(entry)
                self.queue.fail(entry, error.message, error.kind, self._generator)
        return len(self.queue.jobs) < held

    def step(self) -> None:
        self.steps += 1
        # The last command or step ended with an admission pass; only places freed since need another
        # before this step (a pass over a long queue costs milliseconds: docs/benchmarks.md).
        if self._end_expired():
            self.queue.admit(self._generator, self.steps)
        try:
            results = self._generator.iterate()
        except Exception as exc:  # it would end every job anyway: fail them, rebuild, carry on
            log.exception("the generator's iterate() failed; rebuilding it")
            for entry in list(self.queue.jobs.values()):
                self._emit(entry.sink, ErrorEvent(f"the generator failed: {exc}"))
            self.queue.clear()
            self._rebuild()
            return
        for result in results:
            if result["stage"] == "error":  # exllamav3 reaped the job (its pages are free); no identifier here
                self._failed(result["job"].identifier, result["error"])
                continue
            found = self.queue.jobs.get(result.get("identifier"))
            if found is None or not found.enqueued:
                continue  # a job cancelled between iterates: its late results are dropped
            self._deliver(found, result)

    def _deliver(self, entry: SampleJob, result: dict[str, Any]) -> None:
        if not entry.started:  # "started" comes first, but any result means it is active
            self._started(entry)
        event = entry.results.translate(result, self.steps)
        if isinstance(event, ErrorEvent):  # its constraint failed: end it, the others carry on
            self.queue.remove(entry, self._generator)
            self._emit(entry.sink, event)
        elif event is not None:
            self._emit(entry.sink, event)
            self._count(entry, event)

    def _count(self, entry: SampleJob, event: TokenEvent) -> None:
        if event.tokens:
            self.queue.policy.charge(entry, len(event.tokens))
            self.ledger.generated(entry, len(event.tokens))
        if event.finish is not None:
            self.queue.forget(entry)
            usage = event.finish.usage
            self.ledger.cached(usage.cached_tokens)
            self.ledger.checked(usage.draft_tokens, usage.accepted_draft_tokens)

    def _failed(self, identifier: str, error: BaseException) -> None:
        """The generator failed one job and let it go: its request ends with the error."""
        entry = self.queue.jobs.get(identifier)
        if entry is None:
            return
        log.error("the generator failed request %s: %s", identifier, error)
        self.queue.forget(entry)  # the generator holds nothing of it any more
        self._emit(entry.sink, ErrorEvent(f"the generator failed this request: {error}"))

    def _started(self, entry: SampleJob) -> None:
        entry.results.clock.admitted()
        prompt_tokens = len(entry.request.prompt_token_ids)
        self.ledger.started(entry, prompt_tokens)
        if not entry.request.sample_index:  # a request's other samples share its prompt's pages (see job)
            self.queue.policy.charge(entry, prompt_tokens)

    def _rebuild(self) -> bool:
        """A fresh generator; None, and False, when that fails too (the next request tries again)."""
        if self._generator is not None:
            self._binding.retire(self._generator)
        try:
            self._generator = self._binding.new_generator()
        except Exception:
            log.exception("rebuilding the generator failed")
            self._generator = None
        return self._generator is not None

    def close(self) -> None:
        for entry in list(self.queue.jobs.values()):
            self._end(entry, FinishReason.CANCELLED)
        if self._generator is not None:
            self._binding.retire(self._generator)

    def _end(self, entry: SampleJob, reason: FinishReason) -> None:
        """Ends it with a finish, and the samples still waiting on it with theirs."""
        self.queue.remove(entry, self._generator)
        for ended in (entry, *entry.samples):
            self._emit(ended.sink, ended.results.end(reason, self.steps))

    def _settle(self) -> None:
        """After every step and batch of commands: admit what can start in the next step, publish the figures."""
        self.queue.admit(self._generator, self.steps + 1)
        self._outputs += self.queue.outputs
        self.queue.outputs.clear()
        pages = self._binding.pages(self._generator) if self._generator is not None else ()
        self.stats = engine_stats(self.ledger, self.steps, list(self.queue.jobs.values()), pages,
                                  self._binding.page_size, self._cache_tokens_total)
