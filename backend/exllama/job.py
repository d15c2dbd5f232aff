"""The jobs the exllamav2 core holds: one per sample of a request, waiting here or in the generator.

A request for n samples is n jobs with the same prompt. Its first sample (the leader) goes through
admission as any request does; the others wait on it, outside the queue and the engine's capacity,
and are enqueued right behind it when it is (each that finds no batch place free queues as any
request does), as llama.cpp forks a request's samples once its first is placed. Started in the same
iterate(), they share the leader's prompt pages in a paged generator: exllamav2 finds a page by the
hash of the tokens it holds, so the prompt is computed once, whatever n (unpaged, one job runs at a
time and each computes it). One cancel reaches every sample of a request (`group`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from backend.constraints import CompiledConstraint
from backend.events import EventSink
from backend.exllamav2.filter_core import GrammarFilterCore
from backend.exllamav2.results import JobResults
from backend.types import SAMPLE_SEPARATOR, GenerationRequest


@dataclass(frozen=True)
class Resume:
    """What a job that continues a preempted one is built from (backend.exllamav2.preemption)."""

    output: tuple[int, ...]
    """The ids the old job output (all of them reached the caller)."""
    previous: Any
    """The old ExLlamaV2DynamicJob: its random generator and sampler settings go on in the new one."""


JobFactory = Callable[[GenerationRequest, Resume | None, CompiledConstraint | None], tuple[Any, GrammarFilterCore | None]]
"""Builds a request's exllamav2 job (or, given a Resume, the one that continues it after a preemption),
and the grammar filter core it carries when given its compiled constraint."""

Translation = tuple[frozenset[int], Callable[[int], bytes], int]
"""What JobResults needs besides the request: the EOS ids, token id -> bytes, the vocabulary's size."""


@dataclass
class HeldJob:
    request: GenerationRequest
    job: Any
    sink: EventSink
    results: JobResults
    turn: int
    """Its place in the queue, from arrival: kept across preemption, so it comes back before later arrivals."""
    enqueued: bool = False
    """In the generator (running, or waiting there for cache pages), not in the core's own queue."""
    admitted_step: int = 0
    """The core step it was last enqueued at (a time slice runs from there)."""
    samples: list[HeldJob] = field(default_factory=list)
    """A leader's other samples, until it is enqueued."""

    @property
    def group(self) -> str:
        """The id of the request it is a sample of (its own, unless it is one of several samples)."""
        request_id = self.request.request_id
        return request_id.rpartition(SAMPLE_SEPARATOR)[0] if self.request.sample_index else request_id

    @property
    def tokens(self) -> tuple[int, ...]:
        """Prompt and output so far (what backend.common.fairness weighs a sequence by)."""
        return (*self.request.prompt_token_ids, *self.results.token_ids)

    @property
    def preempted(self) -> bool:
        """Started once, and now back in the core's queue."""
        return self.results.started_at is not None and not self.enqueued


def hold(request: GenerationRequest, sink: EventSink, make_job: JobFactory, translation: Translation,
         turns: Iterator[int], compiled: CompiledConstraint | None = None) -> HeldJob:
    """The request's first sample, holding its others; each sample's job built now, so a request
    that cannot be built is refused whole."""
    held = []
    for sample in request.samples():
        job, constraint = make_job(sample, None, compiled)
        held.append(HeldJob(sample, job, sink, JobResults(sample, *translation, constraint), turn=next(turns)))
    leader, leader.samples = held[0], held[1:]
    return leader
