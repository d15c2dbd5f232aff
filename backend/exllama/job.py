"""The jobs the exllama core holds: one per sample of a request, waiting here or in the generator.

A request for n samples is n jobs with the same prompt. Its first sample (the leader) goes through
admission as any request does; the others wait on it, outside the queue and the engine's capacity,
and are enqueued right behind it when it is (each that finds no batch place free queues as any
request does), as llama.cpp forks a request's samples once its first is placed. Started in the same
iterate(), they share the leader's prompt pages: both generations find a page by the hash of the
tokens it holds, so the prompt is computed once, whatever n (exllamav2 unpaged runs one job at a
time, and each computes it). One cancel reaches every sample of a request (`group`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from backend.constraints import CompiledConstraint
from backend.events import EventSink
from backend.exllama.grammar_filter import GrammarFilterCore
from backend.exllama.results import JobResults, Translation
from backend.types import GenerationRequest


@dataclass(frozen=True)
class Resume:
    """What a job that continues a preempted one is built from (backend.exllama.preemption)."""

    output: tuple[int, ...]
    """The ids the old job output (all of them reached the caller)."""
    previous: Any
    """The old generator job: its random generator and sampler go on in the new one."""


JobFactory = Callable[[GenerationRequest, Resume | None, CompiledConstraint | None], tuple[Any, GrammarFilterCore | None]]
"""Builds a request's generator job (or, given a Resume, the one that continues it after a preemption),
and the grammar filter core it carries when given its compiled constraint."""


@dataclass
class SampleJob:
    """One sample of a request, as one generator job."""

    request: GenerationRequest
    job: Any
    """Its generator job (exllamav2's ExLlamaV2DynamicJob, exllamav3's Job)."""
    sink: EventSink
    results: JobResults
    turn: int
    """Its place in the queue, from arrival: kept across preemption, so it comes back before later arrivals."""
    enqueued: bool = False
    """In the generator (running, or waiting there for cache pages), not in the core's own queue."""
    admitted_step: int = 0
    """The core step it was last enqueued at (a time slice runs from there)."""
    samples: list[SampleJob] = field(default_factory=list)
    """A leader's other samples, until it is enqueued."""

    @property
    def group(self) -> str:
        return self.request.group

    @property
    def tokens(self) -> tuple[int, ...]:
        """Prompt and output so far (what backend.common.fairness weighs a sequence by)."""
        return (*self.request.prompt_token_ids, *self.results.token_ids)

    @property
    def started(self) -> bool:
        """The generator has started a job of it (this one or one it gave way from)."""
        return self.results.clock.admitted_at is not None

    @property
    def preempted(self) -> bool:
        """Started once, and now back in the core's queue."""
        return self.started and not self.enqueued


def jobs_for(request: GenerationRequest, sink: EventSink, make_job: JobFactory, translation: Translation,
             turns: Iterator[int], compiled: CompiledConstraint | None = None) -> SampleJob:
    """The request's first sample, holding its others; each sample's job built now, so a request
    that cannot be built is refused whole."""
    held = []
    for sample in request.samples():
        job, constraint = make_job(sample, None, compiled)
        held.append(SampleJob(sample, job, sink, JobResults(sample, translation, constraint), turn=next(turns)))
    leader, leader.samples = held[0], held[1:]
    return leader
