"""Fair sharing in the exllama core, for both generations over their doubles (tests/harness/exllama_fakes.py):
jobs wait in the core's own queue and enter the generator as places
free, the most urgent and the least served caller's first; a more urgent one takes a place at once
(test_preemption.py); a caller at its limit waits; past capacity the flood's newest is shed; a job not
started within its queue timeout ends."""

from __future__ import annotations

import time

import pytest

from backend.events import ErrorEvent, ErrorKind
from backend.types import GenerationRequest, SamplingParams, Scheduling, StopParams
from tests.harness.core_driver import run_until_idle
from tests.harness.exllama_fakes import GENERATIONS, fake_core

TOKENS = 3


def request(request_id: str, caller: str, priority: int = 0, queue_timeout_s: float | None = None) -> GenerationRequest:
    return GenerationRequest(request_id, (1, 5, 6), SamplingParams(temperature=0.0),
                             StopParams(max_new_tokens=TOKENS),
                             scheduling=Scheduling(caller, priority=priority, queue_timeout_s=queue_timeout_s))


@pytest.fixture(params=GENERATIONS)
def make_core(request):
    return lambda **settings: fake_core(request.param, vocab_size=16,
                                        **({"max_batch_size": 2, "max_queued_requests": 8} | settings))


def add(core, generators, request_id: str, caller: str, events: dict, **scheduling) -> None:
    events[request_id] = []
    core.add(request(request_id, caller, **scheduling), events[request_id].append)
    generators[0].samples[request_id] = [(10, b"x")] * TOKENS


def enqueue_order(generators) -> list[str]:
    return [job.identifier for job in generators[0].enqueued]


def test_jobs_enter_the_generator_by_priority_then_least_served_caller(make_core):
    core, generators = make_core()
    events: dict = {}
    for i in range(4):
        add(core, generators, f"a{i}", "a", events)
    add(core, generators, "b0", "b", events)
    add(core, generators, "urgent", "c", events, priority=3)
    # Two places in the generator, the rest wait here; the urgent one takes a0's place at once (the
    # generator had not started it: it starts again later).
    assert enqueue_order(generators) == ["a0", "a1", "urgent"]
    assert [job.identifier for job in generators[0].cancelled] == ["a0"]
    assert core.stats.queued_requests == 6
    run_until_idle(core, limit=200)
    # As places freed: b (served least), then a's in arrival order, a0 first.
    assert enqueue_order(generators) == ["a0", "a1", "urgent", "b0", "a0", "a2", "a3"]
    assert all(not isinstance(e[-1], ErrorEvent) and e[-1].finish is not None for e in events.values())
    tallies = {t.caller: t for t in core.stats.callers}
    assert tallies["a"].generated_tokens_total == 4 * TOKENS and tallies["b"].prompt_tokens_total == 3


def test_a_caller_at_its_running_limit_leaves_the_free_place_to_others(make_core):
    core, generators = make_core(max_running_per_caller=1)
    events: dict = {}
    add(core, generators, "a0", "a", events)
    add(core, generators, "a1", "a", events)
    add(core, generators, "b0", "b", events)
    assert enqueue_order(generators) == ["a0", "b0"]
    run_until_idle(core, limit=200)
    assert enqueue_order(generators) == ["a0", "b0", "a1"]


def test_past_capacity_the_floods_newest_waiting_job_is_shed(make_core):
    core, generators = make_core(max_batch_size=1, max_queued_requests=2)
    events: dict = {}
    for i in range(3):
        add(core, generators, f"a{i}", "a", events)
    add(core, generators, "b0", "b", events)
    assert isinstance(events["a2"][-1], ErrorEvent) and events["a2"][-1].kind is ErrorKind.SHED
    run_until_idle(core, limit=200)
    assert enqueue_order(generators) == ["a0", "b0", "a1"]
    assert generators[0].cancelled == []  # a shed job never reached the generator


def test_a_job_not_started_within_its_queue_timeout_ends(make_core):
    core, generators = make_core(max_batch_size=1)
    events: dict = {}
    add(core, generators, "a0", "a", events)
    add(core, generators, "b0", "b", events, queue_timeout_s=0.05)
    time.sleep(0.05)
    core.expire()
    event = events["b0"][-1]
    assert isinstance(event, ErrorEvent) and event.kind is ErrorKind.QUEUE_TIMEOUT
    run_until_idle(core, limit=200)
    assert enqueue_order(generators) == ["a0"]
    assert {t.caller: t.queue_timeouts_total for t in core.stats.callers}["b"] == 1


def test_queued_jobs_that_find_no_place_do_not_keep_another_callers_job_from_one(make_core):
    # a and b each hold a place past their time slice, b served far more; a's next jobs cannot take b's
    # place (a would then hold two to b's none), while c, holding nothing, can. a's come first in the
    # queue: once one of them found no place, the others like it are skipped, not c.
    core, generators = make_core(time_slice_steps=1, max_queued_requests=16)
    events: dict = {}
    for request_id, caller in (("a0", "a"), ("b0", "b")):
        generators[0].samples[request_id] = [(10, b"x")] * 50  # before it is enqueued: they run on
        events[request_id] = []
        long = GenerationRequest(request_id, (1, 5, 6), SamplingParams(temperature=0.0), StopParams(max_new_tokens=50),
                                 scheduling=Scheduling(caller))
        core.add(long, events[request_id].append)
    for _ in range(3):
        core.step()
    core.queue.policy.counters.charge("b", 1000, 1.0)
    for request_id, caller in (("a1", "a"), ("a2", "a"), ("c0", "c")):
        add(core, generators, request_id, caller, events)
    assert enqueue_order(generators) == ["a0", "b0", "c0"]
    assert [job.identifier for job in generators[0].cancelled] == ["b0"]
    assert core.stats.queued_requests == 3  # a1, a2, and b0 to come back
