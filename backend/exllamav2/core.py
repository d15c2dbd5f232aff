"""The owner-thread core for exllamav2's dynamic generator (see backend.worker).

The generator is not thread-safe, so only the engine thread calls it: submit
and cancel arrive as commands and are applied between `iterate()` calls.
Results fan out to each request's sink by job identifier; results for a job
already cancelled are dropped. An exception from `iterate()` ends every
running stream with an error and the generator is rebuilt, so the engine
keeps serving.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from backend.engine import EngineStats, EventSink
from backend.exllamav2.filter_core import GrammarFilterCore
from backend.exllamav2.results import JobResults
from backend.types import ErrorEvent, Finish, FinishReason, GenerationRequest, TokenEvent, Timings, Usage
from backend.worker import CancelOrder, deliver

log = logging.getLogger(__name__)


@dataclass
class _Job:
    request: GenerationRequest
    job: Any
    sink: EventSink
    results: JobResults


JobFactory = Callable[[GenerationRequest], tuple[Any, GrammarFilterCore | None]]
"""Builds a request's exllamav2 job, and the grammar filter core it carries, if constrained."""


class ExLlamaV2Core:
    def __init__(
        self,
        make_generator: Callable[[], Any],
        make_job: JobFactory,
        eos_token_ids: tuple[int, ...],
        piece: Callable[[int], bytes],
        vocab_size: int,
        cache_tokens: int,
    ) -> None:
        self._make_generator = make_generator
        self._generator: Any = make_generator()
        self._make_job = make_job
        self._eos_token_ids = frozenset(eos_token_ids)
        self._piece = piece
        self._vocab_size = vocab_size
        self._jobs: dict[str, _Job] = {}
        self.steps = 0
        self.stats = EngineStats(cache_tokens_total=cache_tokens)

    def add(self, request: GenerationRequest, sink: EventSink) -> None:
        if self._generator is None and not self._rebuild():
            deliver(sink, ErrorEvent("the generator failed and could not be rebuilt; see the server log"))
            return
        try:
            job, constraint = self._make_job(request)
            self._generator.enqueue(job)
        except Exception as exc:  # validation should have caught it; never let it reach iterate() or this thread
            log.exception("exllamav2 refused request %s", request.request_id)
            deliver(sink, ErrorEvent(f"the generator refused the job: {exc}"))
            return
        results = JobResults(request, self._eos_token_ids, self._piece, self._vocab_size, constraint)
        self._jobs[request.request_id] = _Job(request, job, sink, results)
        self._publish()

    def cancel(self, order: CancelOrder | str) -> None:
        if isinstance(order, str):
            order = CancelOrder(order, time.monotonic(), self.steps)
        entry = self._jobs.get(order.request_id)
        if entry is None:
            return  # finished already: nothing to free
        self._end(entry, FinishReason.CANCELLED)
        self.stats = dataclasses.replace(
            self.stats,
            cancelled_total=self.stats.cancelled_total + 1,
            last_cancel_latency_steps=self.steps - order.issued_at_step,
            last_cancel_latency_s=time.monotonic() - order.issued_at,
        )
        self._publish()

    def pause(self, request_id: str) -> None:
        """A no-op: the generator cannot hold one job back. A slow reader's job runs on and its
        tokens wait in the request's buffer (at most max_new_tokens of them), and its cache pages
        go back to the others as soon as it ends rather than being held for a reader who may not return."""

    def resume(self, request_id: str) -> None:
        """See pause()."""

    def has_work(self) -> bool:
        return bool(self._jobs)

    def holds_sequences(self) -> bool:
        return bool(self._jobs)

    def expire(self) -> None:
        now = time.monotonic()
        for entry in [e for e in self._jobs.values() if e.results.deadline_passed(now)]:
            self._end(entry, FinishReason.TIME_LIMIT)

    def step(self) -> None:
        self.steps += 1
        self.expire()
        try:
            results = self._generator.iterate()
        except Exception as exc:  # it would end every job anyway: fail them, rebuild, carry on
            log.exception("exllamav2 iterate() failed; rebuilding the generator")
            for entry in list(self._jobs.values()):
                deliver(entry.sink, ErrorEvent(f"the generator failed: {exc}"))
            self._jobs.clear()
            self._rebuild()
            self._publish()
            return
        for result in results:
            entry = self._jobs.get(result.get("identifier"))
            if entry is None:
                continue  # a job cancelled between iterates: its late results are dropped
            event = entry.results.translate(result)
            if isinstance(event, ErrorEvent):  # its constraint failed: end it, the others carry on
                self._remove(entry)
                deliver(entry.sink, event)
            elif event is not None:
                deliver(entry.sink, dataclasses.replace(event, step=self.steps))
                if event.finish is not None:
                    del self._jobs[entry.request.request_id]
        self._publish()

    def _rebuild(self) -> bool:
        """A fresh generator; None, and False, when that fails too (the next request tries again)."""
        try:
            self._generator = self._make_generator()
        except Exception:
            log.exception("exllamav2 generator rebuild failed")
            self._generator = None
        return self._generator is not None

    def close(self) -> None:
        for entry in list(self._jobs.values()):
            self._end(entry, FinishReason.CANCELLED)

    def _remove(self, entry: _Job) -> None:
        self._generator.cancel(entry.job)  # frees its pages; emits nothing
        del self._jobs[entry.request.request_id]

    def _end(self, entry: _Job, reason: FinishReason) -> None:
        self._remove(entry)
        now = time.monotonic()
        elapsed = now - entry.request.arrival_time
        finish = Finish(
            reason=reason,
            usage=Usage(len(entry.request.prompt_token_ids), entry.results.generated),
            timings=Timings(0.0, elapsed, 0.0, 0.0, elapsed),
            seed=entry.request.sampling.seed,
        )
        deliver(entry.sink, TokenEvent((), "", entry.results.generated, finish, self.steps))

    def _publish(self) -> None:
        self.stats = dataclasses.replace(self.stats, steps=self.steps, running_sequences=len(self._jobs))
