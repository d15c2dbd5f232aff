"""n samples on the exllama core: n jobs with the same prompt, for both generations over their doubles
(tests/harness/exllama_fakes.py). The first sample is admitted as any request; the others are enqueued
right behind it where the batch has places (a paged generator then shares the prompt's pages), each with
its own seed, its events carrying its index; one cancel ends them all; the prompt is charged once."""

from __future__ import annotations

import pytest

from backend.events import ErrorEvent, ErrorKind, FinishReason, TokenEvent
from backend.exllama.engine import EXLLAMA_REQUEST_FEATURES
from backend.types import GenerationRequest, ModelInfo, SamplingParams, Scheduling, StopParams
from service.validate import RequestValidator
from tests.harness.exllama_fakes import EOS, GENERATIONS, fake_core
from tokenspout.v1 import generation_pb2 as pb

PROMPT = (1, 5, 6, 7)
SEEDS = (11, 12, 13)
IDS = ("r", "r·1", "r·2")


@pytest.fixture(params=GENERATIONS)
def make_core(request):
    return lambda **settings: fake_core(request.param, vocab_size=64,
                                        **({"max_batch_size": 4, "max_queued_requests": 4} | settings))


def samples_request(request_id: str = "r", caller: str = "a", seeds: tuple[int, ...] = SEEDS) -> GenerationRequest:
    return GenerationRequest(request_id, PROMPT, SamplingParams(temperature=0.9, seed=seeds[0]),
                             StopParams(max_new_tokens=3), scheduling=Scheduling(caller), sample_seeds=seeds)


def script(generators, ids=IDS) -> None:
    for i, request_id in enumerate(ids):
        generators[0].samples[request_id] = [(30 + i, f"s{i}".encode())] * 3


def run(core) -> None:
    for _ in range(100):
        if not core.has_work():
            return
        core.step()
    raise AssertionError("the core did not finish")


def by_index(events: list) -> dict[int, list[TokenEvent]]:
    grouped: dict[int, list[TokenEvent]] = {}
    for event in events:
        grouped.setdefault(event.index, []).append(event)
    return grouped


def test_n_samples_are_n_jobs_with_the_same_prompt_each_with_its_seed_and_their_events_carry_its_index(make_core):
    core, generators = make_core()
    script(generators)
    events: list = []
    core.add(samples_request(), events.append)
    jobs = generators[0].enqueued
    assert [job.identifier for job in jobs] == list(IDS)  # enqueued together: they share the prompt's pages
    assert all(job.input_ids == list(PROMPT) for job in jobs)
    assert [job.fields["seed"] for job in jobs] == list(SEEDS)
    run(core)
    samples = by_index(events)
    assert sorted(samples) == [0, 1, 2]
    for index, sample in samples.items():
        assert "".join(e.text for e in sample) == f"s{index}" * 3
        finish = sample[-1].finish
        assert finish.reason is FinishReason.MAX_TOKENS and finish.seed == SEEDS[index]
        assert finish.usage.prompt_tokens == len(PROMPT) and finish.usage.completion_tokens == 3


def test_the_prompt_is_charged_to_the_caller_once_whatever_n(make_core):
    core, generators = make_core()
    script(generators)
    core.add(samples_request(), lambda event: None)
    core.step()  # every sample started, one token each
    assert core.queue.policy.counters["a"] == len(PROMPT) + 3
    assert core.stats.started_total == 3 and core.stats.running_sequences == 3
    run(core)
    tally = {t.caller: t for t in core.stats.callers}["a"]
    assert tally.prompt_tokens_total == 3 * len(PROMPT) and tally.generated_tokens_total == 9  # per sample, as llama.cpp


def test_samples_take_the_free_places_behind_their_first_and_queue_for_the_rest(make_core):
    core, generators = make_core(max_batch_size=2, max_running_per_caller=1)
    script(generators)
    events: list = []
    core.add(samples_request(), events.append)
    # The second joins its first past the caller's limit, as llama.cpp forks samples; the third waits.
    assert [job.identifier for job in generators[0].enqueued] == ["r", "r·1"]
    assert core.stats.queued_requests == 3  # none started yet
    run(core)
    assert [job.identifier for job in generators[0].enqueued] == list(IDS)
    assert sorted(by_index(events)) == [0, 1, 2]


def test_cancelling_the_request_cancels_every_sample_running_or_waiting(make_core):
    core, generators = make_core(max_batch_size=2)
    script(generators)
    events: list = []
    core.add(samples_request(), events.append)
    core.step()
    core.cancel("r")
    ends = [e for e in events if e.finish is not None]
    assert sorted(e.index for e in ends) == [0, 1, 2]
    assert all(e.finish.reason is FinishReason.CANCELLED for e in ends)
    assert {job.identifier for job in generators[0].cancelled} == {"r", "r·1"}  # r·2 never reached it
    assert not core.has_work()


def test_samples_still_waiting_on_their_first_end_with_it(make_core):
    core, generators = make_core(max_batch_size=1)
    script(generators, ("busy",))
    core.add(GenerationRequest("busy", PROMPT, stopping=StopParams(max_new_tokens=3)), lambda event: None)
    events: list = []
    core.add(samples_request(), events.append)  # its first waits for the place, the others wait on it
    core.cancel("r")
    assert sorted(e.index for e in events) == [0, 1, 2]
    assert all(e.finish.reason is FinishReason.CANCELLED for e in events)
    run(core)
    assert [job.identifier for job in generators[0].enqueued] == ["busy"]


def test_a_requests_samples_join_the_engines_capacity_only_as_they_are_enqueued(make_core):
    core, generators = make_core(max_batch_size=1, max_queued_requests=1)
    script(generators, ("busy",))
    core.add(GenerationRequest("busy", PROMPT, stopping=StopParams(max_new_tokens=3)), lambda event: None)
    events: list = []
    core.add(samples_request(), events.append)  # busy and r's first fill the capacity: its samples wait on it
    assert events == []
    late: list = []
    core.add(GenerationRequest("late", PROMPT, stopping=StopParams(max_new_tokens=1)), late.append)
    assert isinstance(late[-1], ErrorEvent) and late[-1].kind is ErrorKind.SHED


@pytest.mark.parametrize("seed, expected", [(100, (100, 101, 102)), (None, None)])
def test_validation_lets_n_through_to_exllamav2_with_a_seed_per_sample(seed, expected):
    info = ModelInfo("m", "exllamav2", 4096, 32000, 8, 1, EOS, False, ("temperature", "seed"),
                     request_features=EXLLAMA_REQUEST_FEATURES)
    sampling = pb.SamplingParams(temperature=0.7, **({} if seed is None else {"seed": seed}))
    params = RequestValidator(info).params(pb.GenerateStreamRequest(prompt="a", n=3, sampling=sampling))
    assert len(set(params.sample_seeds)) == 3  # as for llama.cpp: the request's seed + i, else random ones
    if expected is not None:
        assert params.sample_seeds == expected
