"""Fair sharing in the llama.cpp core, driven step by step on the real model: a newcomer gets a slot from
the caller holding them all, a more urgent request at the next step, sheddable work goes first, queue
timeouts and shedding end requests with their own errors, and every preempted stream ends with exactly
the greedy tokens it has alone."""

from __future__ import annotations

import time

import pytest

from backend.events import ErrorEvent, ErrorKind, FinishReason
from backend.types import GenerationRequest, SamplingParams, Scheduling, StopParams
from tests.backend.llamacpp.test_engine_core import Recorder, make_core, run_until_idle

PROMPTS = ["Water boils at", "The moon is", "Cats are", "Rain falls", "Trees grow", "Rivers run"]


def request(model, request_id: str, prompt: str, caller: str, max_new_tokens: int = 24, priority: int = 0,
            queue_timeout_s: float | None = None) -> GenerationRequest:
    return GenerationRequest(
        request_id, tuple(model.tokenize(prompt)), SamplingParams(temperature=0.0),
        StopParams(max_new_tokens=max_new_tokens, ignore_eos=True),
        scheduling=Scheduling(caller, priority=priority, queue_timeout_s=queue_timeout_s),
    )


def token_ids(rec: Recorder) -> list[int]:
    return [t.token_id for _, event in rec.events for t in event.tokens]


@pytest.fixture(scope="module")
def solo(model):
    """Each prompt's greedy tokens when it runs alone."""
    core = make_core(model, max_batch_size=1)
    try:
        tokens = {}
        for prompt in PROMPTS:
            rec = Recorder(core)
            core.add(request(model, prompt, prompt, "solo", max_new_tokens=40), rec)
            run_until_idle(core)
            tokens[prompt] = token_ids(rec)
        return tokens
    finally:
        core.close()


def test_a_newcomer_gets_a_slot_from_the_caller_holding_them_all_and_the_flood_loses_nothing(model, solo):
    core = make_core(model, max_batch_size=2, time_slice_steps=4)
    try:
        flood = {f"a{i}": Recorder(core) for i in range(4)}
        for i, rec in enumerate(flood.values()):
            core.add(request(model, f"a{i}", PROMPTS[i], "a", max_new_tokens=40), rec)
        for _ in range(20):  # past the 16 tokens worth keeping in the cache
            core.step()
        newcomer = Recorder(core)
        core.add(request(model, "b", PROMPTS[4], "b", max_new_tokens=4), newcomer)
        arrived = core.steps
        run_until_idle(core)
        # It started at the very next step (prefill and first token), not after the two queued ones of "a".
        assert newcomer.first_token_step() == arrived + 1
        assert newcomer.finish.reason is FinishReason.MAX_TOKENS
        assert core.stats.preempted_total == 1
        for i, rec in enumerate(flood.values()):  # the one preempted came back and lost nothing
            assert rec.finish.reason is FinishReason.MAX_TOKENS and token_ids(rec) == solo[PROMPTS[i]][:40]
        # Its own cells were kept as a cached prefix: only the last two tokens were computed again.
        assert core.stats.recomputed_tokens_total == 2
        tallies = {t.caller: t for t in core.stats.callers}
        assert tallies["a"].preempted_total == 1 and tallies["b"].generated_tokens_total == 4
        assert tallies["a"].generated_tokens_total == 4 * 40 and tallies["a"].prompt_tokens_total > 0
    finally:
        core.close()


def test_two_flooding_callers_take_turns_and_each_ends_as_it_would_alone(model, solo):
    """Time-slicing between callers that both stay backlogged: neither waits for the other's queue, the slots
    swap after a time slice, and every stream, preempted or not, has its solo tokens."""
    core = make_core(model, max_batch_size=2, time_slice_steps=4)
    try:
        recs, prompts = {}, {}
        for caller in ("a", "b"):
            for i in range(3):
                recs[caller, i] = Recorder(core)
                prompts[caller, i] = PROMPTS[i + (3 if caller == "b" else 0)]
                core.add(request(model, f"{caller}{i}", prompts[caller, i], caller), recs[caller, i])
        run_until_idle(core)
        for key, rec in recs.items():
            assert token_ids(rec) == solo[prompts[key]][:24], key
        # "b" was not served only once "a" was done: its first streams finished before a's last.
        last_step = {key: rec.events[-1][0] for key, rec in recs.items()}
        assert min(last_step["b", i] for i in range(3)) < max(last_step["a", i] for i in range(3))
        assert core.stats.preempted_total >= 1
    finally:
        core.close()


def test_a_more_urgent_request_starts_at_the_next_step_and_sheddable_sequences_give_way_first(model):
    core = make_core(model, max_batch_size=2, time_slice_steps=1000)  # no fair-share preemption in this test
    try:
        low, normal = Recorder(core), Recorder(core)
        core.add(request(model, "low", PROMPTS[0], "a", max_new_tokens=40, priority=-1), low)
        core.add(request(model, "normal", PROMPTS[1], "a", max_new_tokens=40), normal)
        for _ in range(5):
            core.step()
        # Priority 0 from the same caller, no time slice passed: the sheddable sequence gives way.
        zero = Recorder(core)
        core.add(request(model, "zero", PROMPTS[2], "a", max_new_tokens=4), zero)
        core.step()
        assert "low" in core.scheduler.preempted and "zero" in core.scheduler.running
        urgent = Recorder(core)
        core.add(request(model, "urgent", PROMPTS[3], "b", max_new_tokens=4, priority=5), urgent)
        arrived = core.steps
        core.step()
        assert "urgent" in core.scheduler.running  # admitted at the very next step
        run_until_idle(core)
        assert urgent.first_token_step() == arrived + 1
        assert all(rec.finish.reason is FinishReason.MAX_TOKENS for rec in (low, normal, zero, urgent))
    finally:
        core.close()


def test_past_capacity_the_floods_newest_queued_request_is_shed_and_sheddable_ones_first(model):
    core = make_core(model, max_batch_size=1, max_queued_requests=2)
    try:
        recs = {name: Recorder(core) for name in ("a0", "a1", "a-low", "a2", "b")}
        core.add(request(model, "a0", PROMPTS[0], "a"), recs["a0"])
        core.step()
        core.add(request(model, "a1", PROMPTS[1], "a"), recs["a1"])
        core.add(request(model, "a-low", PROMPTS[2], "a", priority=-1), recs["a-low"])
        core.add(request(model, "a2", PROMPTS[3], "a"), recs["a2"])  # past capacity: the sheddable one goes
        assert isinstance(recs["a-low"].events[-1][1], ErrorEvent)
        assert recs["a-low"].events[-1][1].kind is ErrorKind.SHED
        core.add(request(model, "b", PROMPTS[4], "b"), recs["b"])  # past capacity again: a's newest goes
        assert recs["a2"].events[-1][1].kind is ErrorKind.SHED
        run_until_idle(core)
        assert all(recs[name].finish.reason is FinishReason.MAX_TOKENS for name in ("a0", "a1", "b"))
        assert {t.caller: t.shed_total for t in core.stats.callers} == {"a": 2, "b": 0}
    finally:
        core.close()


def test_a_request_not_started_within_its_queue_timeout_ends_with_queue_timeout(model):
    core = make_core(model, max_batch_size=1)
    try:
        running, waiting, patient = Recorder(core), Recorder(core), Recorder(core)
        # Started at the next step, well within its queue timeout however loaded the machine; the timeout then
        # passes while it runs (the sleep below).
        core.add(request(model, "running", PROMPTS[0], "a", max_new_tokens=60, queue_timeout_s=0.3), running)
        core.step()
        core.add(request(model, "waiting", PROMPTS[1], "b", queue_timeout_s=0.3), waiting)
        core.add(request(model, "patient", PROMPTS[2], "b"), patient)
        time.sleep(0.3)
        core.step()
        event = waiting.events[-1][1]
        assert isinstance(event, ErrorEvent) and event.kind is ErrorKind.QUEUE_TIMEOUT and "300 ms" in event.message
        run_until_idle(core)
        # The running one had started, so its short queue timeout no longer applies; the patient one waits.
        assert running.finish.reason is patient.finish.reason is FinishReason.MAX_TOKENS
        assert {t.caller: t.queue_timeouts_total for t in core.stats.callers}["b"] == 1
    finally:
        core.close()


def test_a_caller_at_its_running_limit_leaves_the_free_slot_to_others(model):
    core = make_core(model, max_batch_size=2, max_running_per_caller=1)
    try:
        a0, a1, b = Recorder(core), Recorder(core), Recorder(core)
        core.add(request(model, "a0", PROMPTS[0], "a"), a0)
        core.add(request(model, "a1", PROMPTS[1], "a"), a1)
        core.step()
        assert list(core.scheduler.running) == ["a0"] and core.stats.queued_requests == 1
        core.add(request(model, "b", PROMPTS[2], "b", max_new_tokens=4), b)
        arrived = core.steps
        run_until_idle(core)
        assert b.first_token_step() == arrived + 1
        assert a1.first_token_step() > a0.events[-1][0]  # a's second waited for its first
    finally:
        core.close()


def test_first_come_first_served_when_the_policy_is_off(model):
    core = make_core(model, max_batch_size=1, scheduling="fifo")
    try:
        a0, a1, b = Recorder(core), Recorder(core), Recorder(core)
        core.add(request(model, "a0", PROMPTS[0], "a", max_new_tokens=8), a0)
        core.add(request(model, "a1", PROMPTS[1], "a", max_new_tokens=8), a1)
        core.add(request(model, "b", PROMPTS[2], "b", max_new_tokens=8, priority=5), b)
        run_until_idle(core)
        assert a0.events[-1][0] < a1.first_token_step() < b.first_token_step()
        assert core.stats.preempted_total == 0
    finally:
        core.close()


def test_a_caller_that_reads_a_little_now_and_then_gives_its_slot_even_when_not_paused_that_moment(model):
    core = make_core(model, max_batch_size=1, time_slice_steps=4)
    try:
        slow, waiting = Recorder(core), Recorder(core)
        core.add(request(model, "slow", PROMPTS[0], "a", max_new_tokens=60), slow)
        core.step()
        for _ in range(4):  # paused one step, reading the next
            core.pause("slow")
            core.step()
            core.resume("slow")
            core.step()
        core.add(request(model, "waiting", PROMPTS[1], "a", max_new_tokens=4), waiting)  # its own caller's, too
        core.step()  # "slow" is reading this moment, but spent 4 of its 9 steps paused
        assert "waiting" in core.scheduler.running and "slow" in core.scheduler.preempted
        run_until_idle(core)
        assert slow.finish.reason is waiting.finish.reason is FinishReason.MAX_TOKENS
    finally:
        core.close()


def test_slow_readers_coming_back_and_forth_never_overtake_a_request_that_waited_meanwhile(model):
    """Measured before: 8 callers reading now and then held every slot; each one preempted came back, as soon
    as it read, ahead of a normal request, which waited seconds."""
    core = make_core(model, max_batch_size=1)
    try:
        recs = {name: Recorder(core) for name in ("s1", "s2", "normal")}
        core.add(request(model, "s1", PROMPTS[0], "a", max_new_tokens=40), recs["s1"])
        core.add(request(model, "s2", PROMPTS[1], "a", max_new_tokens=40), recs["s2"])
        core.step()
        core.pause("s1")
        core.step()  # s1 gives its slot to s2
        assert list(core.scheduler.running) == ["s2"]
        core.add(request(model, "normal", PROMPTS[2], "a", max_new_tokens=4), recs["normal"])
        core.resume("s1")  # s1's caller reads again: it queues behind the normal request
        core.pause("s2")
        core.step()
        assert list(core.scheduler.running) == ["normal"]
        core.resume("s2")
        run_until_idle(core)
        assert all(rec.finish.reason is FinishReason.MAX_TOKENS for rec in recs.values())
    finally:
        core.close()
