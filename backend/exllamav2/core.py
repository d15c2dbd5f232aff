"""The owner-thread core for exllamav2's dynamic generator (see backend.worker).

The generator is not thread-safe, so only the engine thread calls it: submit
and cancel arrive as commands and are applied between `iterate()` calls.
Results become events for each request's sink by job identifier, returned to
the worker to deliver (see backend.worker); results for a job already
cancelled are dropped. An exception from `iterate()` ends every running stream
with an error and the generator is rebuilt, so the engine keeps serving. It
publishes the same EngineStats as the llama.cpp core; the generator's own
prefix reuse (deduplicated cache pages) shows in `usage.cached_tokens`.

Admission is the shared fairness policy's (backend.common.fairness), as on llama.cpp: jobs
wait here, and one is enqueued whenever the generator holds fewer than
max_batch_size, the most urgent and the least served caller's first; requests
past the engine's capacity are shed, and a job not started within its queue
timeout ends. The generator cannot pause one job, so nothing is preempted here:
a more urgent request takes the next place that frees (see the README).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from backend.config import EngineConfig
from backend.common.stats import CancelOrder, EngineCounters, EngineStats
from backend.engine import EventSink
from backend.exllamav2.filter_core import GrammarFilterCore
from backend.exllamav2.results import JobResults
from backend.common.fairness import FairnessPolicy, caller_of
from backend.types import ErrorEvent, ErrorKind, FinishReason, GenerationRequest
from backend.worker import Output

log = logging.getLogger(__name__)


@dataclass
class _Job:
    request: GenerationRequest
    job: Any
    sink: EventSink
    results: JobResults
    enqueued: bool = False
    """In the generator (running, or waiting there for cache pages), not in our own queue."""


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
        config: EngineConfig = EngineConfig(),
    ) -> None:
        """`config.max_batch_size` is the generator's (1 when it runs unpaged)."""
        self._make_generator = make_generator
        self._generator: Any = make_generator()
        self._make_job = make_job
        self._eos_token_ids = frozenset(eos_token_ids)
        self._piece = piece
        self._vocab_size = vocab_size
        self._jobs: dict[str, _Job] = {}
        """Every job held, in our queue or in the generator."""
        self._waiting: list[_Job] = []
        """Not yet enqueued, in arrival order."""
        self._max_batch_size = config.max_batch_size
        self.policy = FairnessPolicy(config)
        self._outputs: list[Output] = []
        self.steps = 0
        self.counters = EngineCounters()
        self._cache_tokens_total = cache_tokens
        self.stats = EngineStats(cache_tokens_total=cache_tokens)

    def add(self, request: GenerationRequest, sink: EventSink) -> list[Output]:
        if self._generator is None and not self._rebuild():
            return [(sink, ErrorEvent("the generator failed and could not be rebuilt; see the server log"))]
        try:
            job, constraint = self._make_job(request)
        except Exception as exc:  # validation should have caught it; never let it reach iterate() or this thread
            log.exception("exllamav2 refused request %s", request.request_id)
            return [(sink, ErrorEvent(f"the generator refused the job: {exc}"))]
        results = JobResults(request, self._eos_token_ids, self._piece, self._vocab_size, constraint)
        entry = _Job(request, job, sink, results)
        self.policy.arrived(entry, self._waiting, self._enqueued(), {caller_of(e) for e in self._jobs.values()})
        self._jobs[request.request_id] = entry
        self._waiting.append(entry)
        while len(self._jobs) > self.policy.capacity:
            shed = self.policy.to_shed(self._waiting, list(self._jobs.values()))
            if shed is None:
                break
            self.policy.tallies.of(shed).shed_total += 1
            self._remove(shed)
            self._outputs.append((shed.sink, ErrorEvent(
                "the server is full and this request gave its queue place to a caller under its share or of "
                "higher priority; retry later or elsewhere", ErrorKind.SHED)))
        self._admit()
        self._publish()
        return self._take_outputs()

    def _enqueued(self) -> list[_Job]:
        return [entry for entry in self._jobs.values() if entry.enqueued]

    def _admit(self) -> None:
        """Enqueues the jobs the policy picks while the generator holds fewer than max_batch_size."""
        while self._generator is not None and self._waiting:
            enqueued = self._enqueued()
            entry = self.policy.next(self._waiting, enqueued) if len(enqueued) < self._max_batch_size else None
            if entry is None:
                return
            self._waiting.remove(entry)
            try:
                self._generator.enqueue(entry.job)
            except Exception as exc:  # e.g. 0.3.2 asserts when the job can never fit the cache
                log.exception("exllamav2 refused request %s", entry.request.request_id)
                self._forget(entry)
                self._outputs.append((entry.sink, ErrorEvent(f"the generator refused the job: {exc}")))
                continue
            entry.enqueued = True

    def cancel(self, order: CancelOrder) -> list[Output]:
        entry = self._jobs.get(order.request_id)
        if entry is None:
            return []  # finished already: nothing to free
        self._end(entry, FinishReason.CANCELLED)
        self.counters.cancelled(order, self.steps, time.monotonic())
        self._publish()
        return self._take_outputs()

    def pause(self, request_id: str) -> list[Output]:
        """A no-op: the generator cannot hold one job back. A slow reader's job runs on and its
        tokens wait in the request's buffer (at most max_new_tokens of them), and its cache pages
        go back to the others as soon as it ends rather than being held for a reader who may not return."""
        return []

    def resume(self, request_id: str) -> list[Output]:
        """See pause()."""
        return []

    def has_work(self) -> bool:
        return bool(self._jobs)

    def holds_sequences(self) -> bool:
        return bool(self._jobs)

    def expire(self) -> list[Output]:
        now = time.monotonic()
        for entry in [e for e in self._jobs.values() if e.results.deadline_passed(now)]:
            self._end(entry, FinishReason.TIME_LIMIT)
        for entry in [e for e in self._jobs.values() if e.results.started_at is None]:
            deadline = entry.request.queue_deadline
            if deadline is not None and now >= deadline:
                self.policy.tallies.of(entry).queue_timeouts_total += 1
                self._remove(entry)
                timeout_ms = entry.request.scheduling.queue_timeout_s * 1000
                message = f"not started within its queue_timeout_ms ({timeout_ms:g} ms)"
                self._outputs.append((entry.sink, ErrorEvent(message, ErrorKind.QUEUE_TIMEOUT)))
        self._admit()
        self._publish()
        return self._take_outputs()

    def step(self) -> list[Output]:
        self.steps += 1
        self._outputs.extend(self.expire())
        try:
            results = self._generator.iterate()
        except Exception as exc:  # it would end every job anyway: fail them, rebuild, carry on
            log.exception("exllamav2 iterate() failed; rebuilding the generator")
            for entry in list(self._jobs.values()):
                self._outputs.append((entry.sink, ErrorEvent(f"the generator failed: {exc}")))
            self._jobs.clear()
            self._waiting.clear()
            self.policy.left(set())
            self._rebuild()
            self._publish()
            return self._take_outputs()
        for result in results:
            entry = self._jobs.get(result.get("identifier"))
            if entry is None:
                continue  # a job cancelled between iterates: its late results are dropped
            if entry.results.started_at is None:  # "started" comes first, but any result means it is active
                self._started(entry)
            event = entry.results.translate(result)
            if isinstance(event, ErrorEvent):  # its constraint failed: end it, the others carry on
                self._remove(entry)
                self._outputs.append((entry.sink, event))
            elif event is not None:
                self._outputs.append((entry.sink, dataclasses.replace(event, step=self.steps)))
                if event.tokens:
                    self.policy.charge(entry, len(event.tokens))
                    self.policy.tallies.of(entry).generated_tokens_total += len(event.tokens)
                if event.finish is not None:
                    self._forget(entry)
                    usage = event.finish.usage
                    self.counters.cached_prompt_tokens_total += usage.cached_tokens
                    self.counters.draft_tokens_total += usage.draft_tokens
                    self.counters.accepted_draft_tokens_total += usage.accepted_draft_tokens
        self._admit()
        self._publish()
        return self._take_outputs()

    def _started(self, entry: _Job) -> None:
        entry.results.started_at = time.monotonic()
        prompt_tokens = len(entry.request.prompt_token_ids)
        self.counters.started(prompt_tokens)
        self.policy.charge(entry, prompt_tokens)
        self.policy.tallies.of(entry).prompt_tokens_total += prompt_tokens

    def _rebuild(self) -> bool:
        """A fresh generator; None, and False, when that fails too (the next request tries again)."""
        _stop_threads(self._generator)
        try:
            self._generator = self._make_generator()
        except Exception:
            log.exception("exllamav2 generator rebuild failed")
            self._generator = None
        return self._generator is not None

    def close(self) -> list[Output]:
        for entry in list(self._jobs.values()):
            self._end(entry, FinishReason.CANCELLED)
        _stop_threads(self._generator)
        return self._take_outputs()

    def _take_outputs(self) -> list[Output]:
        outputs, self._outputs = self._outputs, []
        return outputs

    def _remove(self, entry: _Job) -> None:
        if entry.enqueued:
            self._generator.cancel(entry.job)  # frees its pages; emits nothing
        else:
            self._waiting.remove(entry)
        self._forget(entry)

    def _forget(self, entry: _Job) -> None:
        del self._jobs[entry.request.request_id]
        holding = {caller_of(e) for e in self._jobs.values()}
        if caller_of(entry) not in holding:
            self.policy.left(holding)

    def _end(self, entry: _Job, reason: FinishReason) -> None:
        self._remove(entry)
        self._outputs.append((entry.sink, dataclasses.replace(entry.results.end(reason), step=self.steps)))

    def _publish(self) -> None:
        """The same figures as the llama.cpp core: started jobs run, the rest queue. The cache's used
        tokens are the pages jobs hold (each reserves prompt + max_new_tokens up front); its cached
        prefixes are the free pages that still hold keys and values a later prompt can reuse (0.3.2's
        unreferenced_pages lists every free page, the never-used ones too)."""
        running = [e for e in self._jobs.values() if e.results.started_at is not None]
        queued = [e for e in self._jobs.values() if e.results.started_at is None]
        pages = getattr(self._generator, "all_pages", None) or ()
        cached = [page for page in pages if page.ref_count == 0 and page.kv_position > 0]
        page_size = getattr(self._generator, "page_size", 256)
        self.stats = self.counters.snapshot(
            steps=self.steps,
            running_sequences=len(running),
            queued_requests=len(self._jobs) - len(running),
            cache_tokens_used=sum(page.ref_count > 0 for page in pages) * page_size,
            cache_tokens_total=self._cache_tokens_total,
            prefix_cache_entries=len(cached),
            prefix_cache_tokens=sum(page.kv_position for page in cached),
            callers=self.policy.tallies.snapshot(running, queued, ()),
        )


def _stop_threads(generator: Any) -> None:
    """0.3.2's generator starts two 16-worker pools (sampling, and filters) and never stops them:
    each generator replaced without this would leak their threads."""
    for name in ("sampling_pool", "filter_pool"):
        pool = getattr(generator, name, None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
