"""The shared exllama core on CPU, for both generations: the real binding of each over doubles that behave
like exllamav2 0.3.2's and exllamav3 1.6.5's generators (tests/harness/exllama_fakes.py and the generation's
own part beside it). Every test runs once per generation (`generation`).

Neither library imports without CUDA, so these tests drive the owner-thread core through the generator's
queue API (enqueue / cancel / iterate) as their sources have it: results without text, several per iterate,
held text released with its ids later, a stop-token EOS whose tokens are only in `held`, an assertion from
enqueue, a cancel that emits nothing, an exception from iterate, the page table behind the cache figures.
"""

from __future__ import annotations

import math

import pytest

from backend.events import ErrorEvent, FinishReason
from backend.exllama.job_fields import job_fields
from backend.types import GenerationRequest, OutputParams, SamplingParams, StopParams
from tests.harness.exllama_fakes import EOS, GENERATIONS, eos, fake_core, fake_job_class, streaming

PIECES = {10: b"Hel", 11: b"lo", 12: b" wor", 13: b"ld", 2: b""}


def request(request_id: str, prompt: tuple[int, ...] = (1, 5, 6), output: OutputParams = OutputParams(),
            **stopping) -> GenerationRequest:
    return GenerationRequest(request_id, prompt, SamplingParams(temperature=0.0),
                             StopParams(**({"max_new_tokens": 16} | stopping)), output)


@pytest.fixture(params=GENERATIONS)
def generation(request) -> str:
    return request.param


@pytest.fixture
def setup(generation):
    return fake_core(generation, vocab_size=16, piece=lambda t: PIECES.get(t, b"?"), cache_tokens=4096)


def collect(events: list):
    return lambda event: events.append(event)


def run(core, generator, request_id: str, samples: list[tuple]) -> None:
    """Lets the fake generator sample these tokens for the job, to its end."""
    generator.samples[request_id] = list(samples)
    while core.has_work():
        core.step()


def delivered(events: list) -> list[int]:
    return [t.token_id for e in events for t in e.tokens]


def test_results_without_text_and_several_per_iterate(setup):
    core, generators = setup
    events: list = []
    core.add(request("a"), collect(events))
    generators[0].script = [
        [{"job": None, "stage": "started", "eos": False, "serial": 1, "identifier": "a"},
         {"job": None, "stage": "prefill", "eos": False, "serial": 1, "identifier": "a", "curr_progress": 3, "max_progress": 3}],
        [streaming("a"), streaming("a", [10, 11], "Hello")],  # a token held (no text, no id), then both released
        [streaming("a", [12, 13], " world")],
        [eos("a", "max_new_tokens", 4, text="")],
    ]
    while core.has_work():
        core.step()
    assert "".join(e.text for e in events) == "Hello world"
    assert [t.token_id for e in events for t in e.tokens] == [10, 11, 12, 13]
    finish = events[-1].finish
    assert finish.reason is FinishReason.MAX_TOKENS and finish.usage.completion_tokens == 4
    assert finish.timings.time_to_first_token_s == pytest.approx(0.03) and finish.timings.decode_s == pytest.approx(0.3)


def test_a_stop_token_eos_delivers_the_held_tokens_and_the_stop_token(setup):
    core, generators = setup
    events: list = []
    core.add(request("a", stop_sequences=("Hello!",)), collect(events))
    # "Hel" and "lo" are held (they could become "Hello!"); 0.3.2 emits the EOS without them.
    run(core, generators[0], "a", [(10, b"Hel"), (11, b"lo"), (2, b"")])
    assert "".join(e.text for e in events) == "Hello"
    assert delivered(events) == [10, 11, 2]
    finish = events[-1].finish
    assert finish.reason is FinishReason.EOS_TOKEN and finish.usage.completion_tokens == events[-1].generated_tokens == 3


def test_a_stop_token_keeps_the_held_text_but_not_its_own(setup):
    core, generators = setup
    events: list = []
    core.add(request("a", stop_sequences=("Hello!",), stop_token_ids=frozenset({13})), collect(events))
    run(core, generators[0], "a", [(10, b"Hel"), (11, b"lo"), (13, b"ld")])
    assert "".join(e.text for e in events) == "Hello" and delivered(events) == [10, 11, 13]
    assert events[-1].finish.reason is FinishReason.STOP_TOKEN and events[-1].finish.stop_token_id == 13


def test_held_tokens_get_their_logprobs_from_the_held_logits(setup):
    core, generators = setup
    events: list = []
    core.add(request("a", stop_sequences=("Help",), output=OutputParams(return_logprobs=True)), collect(events))
    first, last = [-math.inf] * 16, [-math.inf] * 16
    first[10], first[12], last[2] = math.log(0.25), math.log(0.75), 0.0
    run(core, generators[0], "a", [(10, b"Hel", first), (2, b"", last)])
    assert [(t.token_id, t.logprob) for e in events for t in e.tokens] == [(10, pytest.approx(math.log(0.25))), (2, 0.0)]


@pytest.mark.parametrize("include, text", [(False, "Hel"), (True, "Hello w")])
def test_a_stop_sequence_is_cut_unless_included(setup, include, text):
    core, generators = setup
    events: list = []
    core.add(request("a", stop_sequences=("lo w",), include_stop_sequence=include), collect(events))
    run(core, generators[0], "a", [(10, b"Hel"), (11, b"lo"), (12, b" wor")])
    assert "".join(e.text for e in events) == text and delivered(events) == [10, 11, 12]
    assert events[-1].finish.reason is FinishReason.STOP_SEQUENCE and events[-1].finish.stop_sequence == "lo w"


def test_logprobs_and_alternatives_come_from_the_steps_logits(setup):
    core, generators = setup
    events: list = []
    wants = GenerationRequest("a", (1, 5, 6), SamplingParams(temperature=0.0), StopParams(16),
                              OutputParams(return_logprobs=True, top_logprobs=2))
    assert job_fields(wants, EOS)["return_logits"] and not job_fields(wants, EOS)["return_probs"]
    core.add(wants, collect(events))
    step = [-math.inf] * 20  # padded past the 16-token vocabulary; the padding must not count
    first, second = list(step), list(step)
    first[10], first[12], first[13], first[18] = math.log(0.5), math.log(0.3), math.log(0.2), 99.0
    second[11], second[13], second[19] = 0.0, -math.inf, 99.0
    generators[0].script = [[streaming("a", [10, 11], "Hello", logits=[[first, second]])]]
    core.step()
    tokens = events[0].tokens
    assert [t.logprob for t in tokens] == pytest.approx([math.log(0.5), 0.0])
    assert [(top.token_id, top.piece) for top in tokens[0].top_logprobs] == [(10, b"Hel"), (12, b" wor")]
    assert tokens[0].top_logprobs[1].logprob == pytest.approx(math.log(0.3))
    assert tokens[1].top_logprobs[0].token_id == 11


def test_an_enqueue_assertion_fails_only_that_request(setup):
    core, generators = setup
    events: list = []
    core.add(request("big", max_new_tokens=5000), collect(events))  # 20 pages; the cache has 16
    assert isinstance(events[0], ErrorEvent) and "cannot be enqueued" in events[0].message
    assert not core.has_work()


def test_cancel_between_iterates_frees_the_job_and_drops_late_results(setup):
    core, generators = setup
    events: list = []
    core.add(request("a"), collect(events))
    generators[0].script = [[streaming("a", [10], "Hel")], [streaming("a", [11], "lo")]]
    core.step()
    core.cancel("a")
    assert generators[0].cancelled == generators[0].enqueued
    assert events[-1].finish.reason is FinishReason.CANCELLED and events[-1].finish.usage.completion_tokens == 1
    core.step()  # the script still holds a result for "a": dropped
    assert len(events) == 2 and not core.has_work() and core.stats.cancelled_total == 1


def test_a_banned_strings_rewind_drops_the_suppressed_tokens(setup, generation):
    core, generators = setup
    events: list = []
    banned = GenerationRequest("b", (1, 5, 6), SamplingParams(temperature=0.0, banned_strings=("lo",)), StopParams(16))
    core.add(banned, collect(events))
    # As 0.3.2 emits it, the text is rewound and the token ids still hold the suppressed token; 1.6.5 rewinds both.
    released = [10, 11] if generation == "exllamav2" else [10]
    generators[0].script = [
        [streaming("b", released, "Hel", suppressed_text="lo", suppressed_tokens=[[11]])],
        [eos("b", "max_new_tokens", 2, token_ids=[[12]], text=" wor")],
    ]
    core.step()
    core.step()
    assert [t.token_id for e in events for t in e.tokens] == [10, 12]
    assert [e.generated_tokens for e in events] == [1, 2] and events[-1].finish.usage.completion_tokens == 2


def test_a_healed_job_counts_its_regenerated_token_within_max_new_tokens(setup):
    core, generators = setup
    healed = GenerationRequest(
        "h", (1, 5, 6), SamplingParams(temperature=0.0, token_healing=True), StopParams(max_new_tokens=3, min_new_tokens=1)
    )
    fields = job_fields(healed, EOS)
    assert (fields["max_new_tokens"], fields["min_new_tokens"], fields["token_healing"]) == (2, 0, True)
    events: list = []
    core.add(healed, collect(events))
    # Both count a healed job from -1, so their own new_tokens ends one short of the tokens it emitted.
    run(core, generators[0], "h", [(13, b"ld"), (10, b"Hel"), (11, b"lo")])
    assert len(delivered(events)) == 3 and events[-1].finish.usage.completion_tokens == 3


def test_a_one_token_prompt_is_not_healed(setup):
    core, generators = setup
    one = GenerationRequest("h", (5,), SamplingParams(temperature=0.0, token_healing=True), StopParams(max_new_tokens=3))
    fields = job_fields(one, EOS)
    assert (fields["max_new_tokens"], fields["token_healing"]) == (3, False)  # both heal only longer prompts
    events: list = []
    core.add(one, collect(events))
    run(core, generators[0], "h", [(10, b"Hel"), (11, b"lo"), (12, b" wor")])
    assert delivered(events) == [10, 11, 12] and events[-1].finish.usage.completion_tokens == 3


def test_a_job_that_cannot_be_built_fails_alone(setup, generation, monkeypatch):
    core, generators = setup
    failed: list = []
    with monkeypatch.context() as library:  # the library refuses a keyword the binding gives every job
        library.setattr(fake_job_class(generation), "PARAMETERS", frozenset({"identifier"}))
        core.add(request("explode"), collect(failed))
    assert isinstance(failed[0], ErrorEvent) and "would drop these silently" in failed[0].message
    later: list = []
    core.add(request("b"), collect(later))
    generators[0].script = [[eos("b", "max_new_tokens", 1, token_ids=[[10]], text="Hel")]]
    core.step()
    assert later[-1].finish.reason is FinishReason.MAX_TOKENS


def test_a_failed_rebuild_fails_new_requests_until_one_succeeds(setup):
    core, generators = setup
    core.add(request("a"), collect([]))
    generators[0].explode = True
    generators.failing = True
    core.step()  # iterate() fails, and so does the rebuild
    refused: list = []
    core.add(request("b"), collect(refused))
    assert isinstance(refused[0], ErrorEvent) and "could not be rebuilt" in refused[0].message
    generators.failing = False
    served: list = []
    core.add(request("c"), collect(served))  # rebuilds first
    generators[-1].script = [[eos("c", "max_new_tokens", 1, token_ids=[[10]], text="Hel")]]
    core.step()
    assert len(generators) == 2 and served[-1].finish.reason is FinishReason.MAX_TOKENS


def test_a_paused_job_runs_on_and_loses_nothing(setup):
    core, generators = setup
    events: list = []
    core.add(request("a"), collect(events))
    generators[0].script = [[streaming("a", [10], "Hel")], [eos("a", "max_new_tokens", 2, token_ids=[[11]], text="lo")]]
    core.pause("a")  # the slow-reader signal: exllamav2 cannot hold one job back
    core.step()
    core.step()
    assert "".join(e.text for e in events) == "Hello" and events[-1].finish.reason is FinishReason.MAX_TOKENS
    assert not generators[0].cancelled and not core.has_work()


def test_cancel_of_a_pending_job_and_after_eos(setup):
    core, generators = setup
    events: list = []
    core.add(request("pending"), collect(events))
    core.cancel("pending")  # never iterated: still cancelled in the generator
    assert [j.identifier for j in generators[0].cancelled] == ["pending"]
    core.add(request("done"), collect(events))
    generators[0].script = [[eos("done", "max_new_tokens", 1, token_ids=[[10]], text="Hel")]]
    core.step()
    core.cancel("done")  # after EOS: a no-op
    assert [j.identifier for j in generators[0].cancelled] == ["pending"]
    assert [e.finish.reason for e in events] == [FinishReason.CANCELLED, FinishReason.MAX_TOKENS]


def test_an_exception_from_iterate_fails_the_streams_and_rebuilds_the_generator(setup):
    core, generators = setup
    first: list = []
    second: list = []
    core.add(request("a"), collect(first))
    core.add(request("b"), collect(second))
    generators[0].explode = True
    core.step()
    assert all(isinstance(events[-1], ErrorEvent) for events in (first, second))
    assert len(generators) == 2 and not core.has_work()
    # The old one's threads go (exllamav2: its 2 x 16; exllamav3: close()), the new one's stay.
    assert generators[0].threads_stopped() and not generators[1].threads_stopped()
    later: list = []
    core.add(request("c"), collect(later))
    generators[1].script = [[eos("c", "max_new_tokens", 1, token_ids=[[10]], text="Hel")]]
    core.step()
    assert later[-1].finish.reason is FinishReason.MAX_TOKENS  # the engine keeps serving


def test_job_fields_are_explicit():
    req = GenerationRequest(
        "r1", (1, 2), SamplingParams(temperature=0.7, top_p=0.9, seed=5),
        StopParams(max_new_tokens=40, min_new_tokens=2, stop_sequences=("\n\n",), stop_token_ids=frozenset({7})),
        OutputParams(return_logprobs=True, top_logprobs=3),
    )
    assert job_fields(req, EOS) == {
        "max_new_tokens": 40, "min_new_tokens": 2, "seed": 5, "stop_conditions": ["\n\n", 2, 7],
        "decode_special_tokens": False, "return_probs": False, "return_top_tokens": 0, "return_logits": True,
        "token_healing": False, "banned_strings": None, "identifier": "r1",
    }
    healing = GenerationRequest("r3", (1, 2), SamplingParams(banned_strings=("As an AI",), token_healing=True))
    assert job_fields(healing, EOS)["banned_strings"] == ["As an AI"] and job_fields(healing, EOS)["token_healing"]
    ignoring = GenerationRequest("r2", (1,), stopping=StopParams(ignore_eos=True))
    assert job_fields(ignoring, EOS)["stop_conditions"] == []
    # A job allowed one token heals none: the healed token would be all of it (and exllamav3 asserts one more).
    single = GenerationRequest("r4", (1, 2), SamplingParams(token_healing=True), StopParams(max_new_tokens=1))
    assert (job_fields(single, EOS)["token_healing"], job_fields(single, EOS)["max_new_tokens"]) == (False, 1)


def test_the_same_engine_stats_as_the_llama_cpp_core(setup):
    import time

    from backend.worker import CancelOrder

    core, generators = setup
    finished: list = []
    cancelled: list = []
    core.add(request("a"), collect(finished))
    core.add(request("b"), collect(cancelled))
    assert core.stats.queued_requests == 2 and core.stats.running_sequences == 0
    generators[0].script = [
        [{"job": None, "stage": "started", "eos": False, "serial": 1, "identifier": "a"}],
        [{**eos("a", "max_new_tokens", 1), "cached_tokens": 2}],
    ]
    core.step()
    stats = core.stats
    assert (stats.started_total, stats.running_sequences, stats.queued_requests, stats.prompt_tokens_total) == (1, 1, 1, 3)
    core.step()
    # The generator's own prefix reuse (deduplicated pages) is the request's cached_tokens and the server's hit rate.
    assert finished[-1].finish.usage.cached_tokens == 2 and core.stats.cached_prompt_tokens_total == 2
    assert core.stats.prefix_hit_rate == pytest.approx(2 / 3)
    core.cancel(CancelOrder("b", time.monotonic(), core.steps - 2))
    assert core.stats.max_cancel_latency_steps == 2 and core.stats.running_sequences == core.stats.queued_requests == 0
    finish = cancelled[-1].finish  # built through the same path as every other Finish, with real timings
    assert finish.reason is FinishReason.CANCELLED and finish.usage.prompt_tokens == 3
    assert 0 <= finish.timings.queue_s <= finish.timings.total_s and finish.seed == 0


def test_the_cache_figures_come_from_the_page_table(setup):
    core, generators = setup
    events: list = []
    core.add(request("long", prompt=tuple(range(300)), max_new_tokens=4), collect(events))
    assert (core.stats.prefix_cache_entries, core.stats.prefix_cache_tokens) == (0, 0)  # 16 free pages, none used yet
    generators[0].samples["long"] = [(10, b"Hel"), (11, b"lo")]
    core.step()
    # 304 tokens reserve two whole pages up front, whatever the job has generated so far.
    assert core.stats.cache_tokens_used == 512 and core.stats.cache_tokens_total == 4096
    assert core.stats.prefix_cache_entries == 0
    core.cancel("long")
    # Its pages are free again, and still hold its 300 prompt tokens for a later prompt.
    stats = core.stats
    assert (stats.cache_tokens_used, stats.prefix_cache_entries, stats.prefix_cache_tokens) == (0, 2, 300)


def test_closing_stops_the_generators_threads(setup):
    core, generators = setup
    assert not generators[0].threads_stopped()
    core.close()
    assert generators[0].threads_stopped()


def test_the_generators_draft_counts_are_the_requests_usage_and_the_servers_totals(setup):
    core, generators = setup
    finished: list = []
    core.add(request("a"), collect(finished))
    generators[0].script = [
        [{"job": None, "stage": "started", "eos": False, "serial": 1, "identifier": "a"}],
        [{**eos("a", "max_new_tokens", 1), "accepted_draft_tokens": 5, "rejected_draft_tokens": 3}],
    ]
    core.step()
    core.step()
    usage = finished[-1].finish.usage
    assert (usage.draft_tokens, usage.accepted_draft_tokens) == (8, 5)
    assert (core.stats.draft_tokens_total, core.stats.accepted_draft_tokens_total) == (8, 5)


