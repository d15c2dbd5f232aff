"""Recompute preemption in the exllama core, for both generations over their doubles
(tests/harness/exllama_fakes.py): a job gives its place by being cancelled, and comes back as a new
job whose prompt is the old one's prompt and output; the caller's stream goes on with nothing
repeated or lost. Only a job holding nothing back, and without a constraint, gives way."""

from __future__ import annotations

import pytest

from backend.constraints import ConstraintSpec
from backend.events import FinishReason, TokenEvent
from backend.exllama.job_fields import job_fields, job_input
from backend.types import GenerationRequest, SamplingParams, Scheduling, StopParams
from tests.harness.core_driver import run_until_idle
from tests.harness.exllama_fakes import EOS, GENERATIONS, fake_core

PROMPT = (1, 5, 6)
WORDS = [(20 + i, f" w{i}".encode()) for i in range(6)]


@pytest.fixture(params=GENERATIONS)
def make_core(request):
    return lambda **settings: fake_core(request.param, vocab_size=64,
                                        **({"max_batch_size": 1, "max_queued_requests": 8} | settings))


def request(request_id: str, caller: str = "a", priority: int = 0, max_new_tokens: int = 6, seed: int = 7,
            **stopping) -> GenerationRequest:
    return GenerationRequest(request_id, PROMPT, SamplingParams(temperature=0.8, seed=seed),
                             StopParams(max_new_tokens=max_new_tokens, **stopping),
                             scheduling=Scheduling(caller, priority=priority))


def add(core, generators, events: dict, req: GenerationRequest, samples: list[tuple]) -> None:
    events[req.request_id] = []
    generators[0].samples[req.request_id] = list(samples)
    core.add(req, events[req.request_id].append)


def jobs_of(generators, request_id: str) -> list:
    return [job for job in generators[0].enqueued if job.identifier == request_id]


def ids(events: list) -> list[int]:
    return [t.token_id for e in events for t in e.tokens]


def test_a_more_urgent_request_preempts_a_running_job_whose_stream_goes_on_without_repeats_or_gaps(make_core):
    core, generators = make_core()
    events: dict = {}
    add(core, generators, events, request("low"), WORDS)
    core.step()
    core.step()  # two tokens out
    add(core, generators, events, request("urgent", caller="b", priority=1, max_new_tokens=2), WORDS[:2])
    assert core.stats.preempted_total == 1 and core.stats.preempted_sequences == 1
    run_until_idle(core, limit=200)
    first, second = jobs_of(generators, "low")
    assert generators[0].cancelled == [first]
    assert [job.identifier for job in generators[0].enqueued] == ["low", "urgent", "low"]
    # The job that continues it holds the prompt and the two tokens out, samples the rest from the same
    # random generator and sampler settings, and counts its budget from there.
    assert second.input_ids == [*PROMPT, 20, 21] and second.max_new_tokens == 4
    assert second.rng is first.rng and second.sampling is first.sampling
    low = events["low"]
    assert ids(low) == [token for token, _ in WORDS]
    assert "".join(e.text for e in low) == " w0 w1 w2 w3 w4 w5"
    finish = low[-1].finish
    assert finish.reason is FinishReason.MAX_TOKENS and finish.usage.completion_tokens == low[-1].generated_tokens == 6
    assert finish.usage.prompt_tokens == len(PROMPT)
    tallies = {t.caller: t for t in core.stats.callers}
    assert tallies["a"].preempted_total == 1 and tallies["a"].generated_tokens_total == 6
    assert core.stats.preempted_sequences == 0 and core.stats.recomputed_tokens_total == len(PROMPT) + 2


def test_a_job_holding_back_part_of_a_stop_string_gives_way_only_once_it_has_released_it(make_core):
    core, generators = make_core()
    events: dict = {}
    add(core, generators, events, request("low", stop_sequences=("Hello!",)),
        [(10, b"Hel"), (11, b"p"), (12, b" and"), (13, b" Hel"), (14, b"lo!")])
    core.step()  # "Hel" is held: it could become "Hello!"
    add(core, generators, events, request("urgent", caller="b", priority=1, max_new_tokens=1), WORDS[:1])
    assert core.stats.preempted_total == 0 and [job.identifier for job in generators[0].enqueued] == ["low"]
    core.step()  # "Help" is released: nothing held, and it gives way
    assert core.stats.preempted_total == 1
    run_until_idle(core, limit=200)
    assert jobs_of(generators, "low")[1].input_ids == [*PROMPT, 10, 11]
    low = events["low"]
    assert "".join(e.text for e in low) == "Help and " and ids(low) == [10, 11, 12, 13, 14]
    assert low[-1].finish.reason is FinishReason.STOP_SEQUENCE and low[-1].finish.stop_sequence == "Hello!"


def test_a_constrained_job_is_never_preempted(make_core):
    core, generators = make_core()
    events: dict = {}
    constrained = GenerationRequest("json", PROMPT, SamplingParams(temperature=0.0), StopParams(max_new_tokens=3),
                                    constraint=ConstraintSpec("regex", "[a-z]+"))
    add(core, generators, events, constrained, WORDS[:3])
    core.step()
    add(core, generators, events, request("urgent", caller="b", priority=1, max_new_tokens=1), WORDS[:1])
    run_until_idle(core, limit=200)
    assert core.stats.preempted_total == 0 and generators[0].cancelled == []
    assert [job.identifier for job in generators[0].enqueued] == ["json", "urgent"]  # it took the next free place


def test_a_caller_over_its_share_gives_a_place_after_a_time_slice(make_core):
    core, generators = make_core(max_batch_size=2, time_slice_steps=3)
    events: dict = {}
    long = [(20, b" w")] * 12
    add(core, generators, events, request("a0", max_new_tokens=12), long)
    add(core, generators, events, request("a1", max_new_tokens=12), long)
    add(core, generators, events, request("b0", caller="b", max_new_tokens=2), WORDS[:2])
    assert core.stats.preempted_total == 0  # equals: a slot is taken only after a time slice
    for _ in range(3):
        core.step()
    assert core.stats.preempted_total == 1
    run_until_idle(core, limit=200)
    assert all(len(ids(e)) == (2 if name == "b0" else 12) for name, e in events.items())
    assert all(e[-1].finish.reason is FinishReason.MAX_TOKENS for e in events.values())


def test_a_job_preempted_before_the_generator_started_it_starts_again_from_its_prompt(make_core):
    core, generators = make_core()
    events: dict = {}
    add(core, generators, events, request("low"), WORDS)
    add(core, generators, events, request("urgent", caller="b", priority=1, max_new_tokens=1), WORDS[:1])
    (first,), second = jobs_of(generators, "low"), core.queue.jobs["low"].job  # waiting to come back
    assert generators[0].cancelled == [first] and second.input_ids == list(PROMPT) and second.max_new_tokens == 6
    run_until_idle(core, limit=200)
    assert ids(events["low"]) == [token for token, _ in WORDS]
    assert core.stats.queued_requests == core.stats.preempted_sequences == 0


def test_a_preempted_job_can_be_cancelled_while_it_waits_to_come_back(make_core):
    core, generators = make_core()
    events: dict = {}
    add(core, generators, events, request("low"), WORDS)
    core.step()
    add(core, generators, events, request("urgent", caller="b", priority=1, max_new_tokens=3), WORDS[:3])
    core.cancel("low")
    last = events["low"][-1]
    assert isinstance(last, TokenEvent) and last.finish.reason is FinishReason.CANCELLED
    assert last.generated_tokens == 1 and core.stats.preempted_sequences == 0
    run_until_idle(core, limit=200)
    assert len(jobs_of(generators, "low")) == 1  # never came back


def test_the_job_that_continues_a_healed_one_holds_its_sequence_and_heals_nothing():
    healed = GenerationRequest("h", PROMPT, SamplingParams(temperature=0.0, token_healing=True),
                               StopParams(max_new_tokens=8, min_new_tokens=4))
    fresh = job_fields(healed, EOS)
    assert (fresh["token_healing"], fresh["max_new_tokens"], fresh["min_new_tokens"]) == (True, 7, 3)
    assert job_input(healed) == list(PROMPT)
    # Its first output replaced the prompt's last token: the sequence the old job held is prompt[:-1] + output.
    assert job_input(healed, (30, 31, 32)) == [1, 5, 30, 31, 32]
    resumed = job_fields(healed, EOS, generated=3)
    assert (resumed["token_healing"], resumed["max_new_tokens"], resumed["min_new_tokens"]) == (False, 5, 1)
