"""The llama.cpp batching core driven step by step, on the real model, without threads."""

from __future__ import annotations

import llama_cpp
import pytest

from backend.config import EngineConfig
from backend.events import ErrorEvent, ErrorKind, FinishReason, TokenEvent
from backend.llamacpp.core import LlamaCppCore
from backend.llamacpp.engine import LlamaCppEngine
from backend.llamacpp.sampling import Sampler
from backend.types import GenerationRequest, PrefixReuse, SamplingParams, StopParams
from tests.harness.core_driver import Recorder, make_core, request, run_until_idle


@pytest.fixture
def core(model):
    engine_core = make_core(model)
    yield engine_core
    engine_core.close()


def cache_cells(core: LlamaCppCore, slot: int) -> int:
    return llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(core.ctx), slot) + 1


def test_a_new_request_joins_at_the_next_step(core, model):
    a, b = Recorder(core), Recorder(core)
    core.add(request(model, "a", max_new_tokens=20), a)
    for _ in range(3):
        core.step()
    core.add(request(model, "b"), b)
    core.step()
    assert b.first_token_step() == 4  # prefilled and sampled in the very next step
    assert core.stats.running_sequences == 2
    # Both sequences advance one token per step, in the same llama_decode.
    core.step()
    assert [step for step, _ in a.events][-1] == [step for step, _ in b.events][-1] == 5
    run_until_idle(core)
    assert a.finish.reason is b.finish.reason is FinishReason.MAX_TOKENS


def test_a_finished_sequence_frees_its_cache_at_once(core, model):
    rec = Recorder(core)
    core.add(request(model, "a", max_new_tokens=5), rec)
    core.step()
    assert cache_cells(core, 0) > 0
    run_until_idle(core)
    assert rec.finish.usage.completion_tokens == 5
    assert core.stats.running_sequences == 0 and core.stats.cache_tokens_used == 0
    # Its cells stay only as an idle cached prefix, which any request may overwrite.
    assert core.stats.prefix_cache_entries == 1 and cache_cells(core, 0) == core.stats.prefix_cache_tokens > 0


def test_cancel_ends_a_running_sequence_and_frees_its_cache(core, model):
    rec = Recorder(core)
    core.add(request(model, "a", max_new_tokens=100), rec)
    for _ in range(4):
        core.step()
    core.cancel("a")
    assert rec.finish.reason is FinishReason.CANCELLED
    assert core.stats.running_sequences == 0 and core.stats.cache_tokens_used == 0 and not core.has_work()
    assert core.stats.prefix_cache_entries == 1 and cache_cells(core, 0) == core.stats.prefix_cache_tokens


def test_cancel_of_a_waiting_request(core, model):
    recs = {rid: Recorder(core) for rid in "abc"}
    for rid, rec in recs.items():
        core.add(request(model, rid, max_new_tokens=50), rec)
    core.step()
    assert core.stats.running_sequences == 2  # two slots; "c" waits
    core.cancel("c")
    assert recs["c"].finish.reason is FinishReason.CANCELLED and len(recs["c"].events) == 1
    core.cancel("a")
    core.cancel("b")
    assert not core.has_work()


def test_requests_beyond_the_slots_wait_for_a_free_one(core, model):
    recs = {rid: Recorder(core) for rid in "abc"}
    for rid, rec in recs.items():
        core.add(request(model, rid, max_new_tokens=4), rec)
    run_until_idle(core)
    assert all(rec.finish.reason is FinishReason.MAX_TOKENS for rec in recs.values())
    assert recs["c"].first_token_step() > recs["a"].events[-1][0]


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(core, model):
    short, long_ = Recorder(core), Recorder(core)
    core.add(request(model, "short", max_new_tokens=30), short)
    core.step()
    core.add(request(model, "long", prompt="word " * 150, max_new_tokens=2), long_)
    before, started = len(short.events), core.steps
    while not long_.events:
        core.step()
    # 150 prompt tokens in groups of at most 63 (see PromptLayout), one a step; the decoding
    # sequence waits at most batch_tokens (64) prompt rows, so it decodes between the groups.
    decoded = len(short.events) - before
    assert decoded >= 2 and core.steps - started == 3 + decoded
    run_until_idle(core)


def test_a_burst_is_prefilled_one_prompt_a_step_in_arrival_order(model):
    """A CPU prefills a token at the same cost batched or not, so prefilling one prompt a step,
    before any decoding, gives the first of a burst its first token at once and the last about
    when all together would have."""
    core = make_core(model, max_batch_size=3)
    try:
        recs = [Recorder(core) for _ in range(3)]
        for i, rec in enumerate(recs):
            core.add(request(model, f"r{i}", prompt=f"Question {i}: why is the sky blue?", max_new_tokens=4), rec)
        for _ in range(3):
            core.step()
        assert [rec.first_token_step() for rec in recs] == [1, 2, 3]
        assert [len(rec.events) for rec in recs] == [1, 1, 1]  # prompts first: decoding waits for them
        core.step()
        assert [len(rec.events) for rec in recs] == [2, 2, 2]  # then all three decode together
        run_until_idle(core)
    finally:
        core.close()


def test_a_short_prompt_waits_for_one_group_of_a_long_one_not_all_of_it(core, model):
    long_, short = Recorder(core), Recorder(core)
    core.add(request(model, "long", prompt="word " * 200, max_new_tokens=2), long_)
    core.step()  # the long prompt's first group (of four)
    core.add(request(model, "short", max_new_tokens=2), short)
    core.step()  # its second: it was waiting before the short one came
    core.step()
    assert short.first_token_step() == 3 and not long_.events
    assert core.scheduler.running["long"].prefilling
    run_until_idle(core)
    assert long_.finish.reason is short.finish.reason is FinishReason.MAX_TOKENS


def test_a_fault_in_one_sequence_leaves_the_other_running(core, model, monkeypatch):
    good, bad = Recorder(core), Recorder(core)
    original = core.picker.pick

    def faulty(ctx, row, slot, sampler, output):
        if output.request.request_id == "bad":
            raise RuntimeError("injected")
        return original(ctx, row, slot, sampler, output)

    monkeypatch.setattr(core.picker, "pick", faulty)
    core.add(request(model, "good"), good)
    core.add(request(model, "bad"), bad)
    run_until_idle(core)
    assert isinstance(bad.events[-1][1], ErrorEvent) and "injected" in bad.events[-1][1].message
    assert good.finish.reason is FinishReason.MAX_TOKENS and good.finish.usage.completion_tokens == 8
    assert core.stats.cache_tokens_used == 0


def test_the_threaded_engine_delivers_events_from_its_worker(model_path):
    import queue

    engine = LlamaCppEngine(model_path, EngineConfig.of(prefix_cache_exact=True))
    try:
        # GetModelInfo tells callers that greedy output does not follow the cache (the default: it may)
        assert engine.info.prefix_reuse is PrefixReuse.EXACT and not engine.info.reuses_decoded_cells
        events: queue.Queue = queue.Queue()
        engine.submit(
            GenerationRequest(
                "x", tuple(engine.tokenize("Hi")), SamplingParams(temperature=0), StopParams(max_new_tokens=3, ignore_eos=True)
            ),
            events.put,
        )
        received = [events.get(timeout=30) for _ in range(3)]
        assert received[-1].finish is not None and received[-1].generated_tokens == 3
    finally:
        engine.close()


def test_a_paused_sequence_keeps_its_cache_and_resumes(core, model):
    a, b = Recorder(core), Recorder(core)
    core.add(request(model, "a", max_new_tokens=10), a)
    core.add(request(model, "b", max_new_tokens=10), b)
    core.step()  # prefills a (one prompt a step), then b beside a's decoding
    core.step()
    core.pause("a")
    cells, a_had = cache_cells(core, 0), len(a.events)
    for _ in range(3):
        core.step()
    assert len(a.events) == a_had and len(b.events) == 4  # only b advanced
    assert cache_cells(core, 0) == cells and core.stats.paused_sequences == 1
    run_until_idle(core)
    assert not core.has_work() and core.holds_sequences()  # a is parked: the worker may sleep
    core.resume("a")
    run_until_idle(core)
    assert a.finish.usage.completion_tokens == 10 and not core.holds_sequences()


def test_a_deadline_that_passes_while_waiting_never_starts(core, model):
    import dataclasses
    import time

    recs = {rid: Recorder(core) for rid in "abc"}
    core.add(request(model, "a", max_new_tokens=30), recs["a"])
    core.add(request(model, "b", max_new_tokens=30), recs["b"])
    late = dataclasses.replace(request(model, "c"), deadline=time.monotonic() + 0.01)
    core.add(late, recs["c"])
    core.step()
    time.sleep(0.02)
    core.step()
    assert recs["c"].finish.reason is FinishReason.TIME_LIMIT
    assert recs["c"].finish.usage.completion_tokens == 0 and core.stats.started_total == 2
    core.cancel("a")
    core.cancel("b")


def test_cancel_latency_is_recorded_in_steps(core, model):
    import time

    from backend.worker import CancelOrder

    core.add(request(model, "a", max_new_tokens=50), Recorder(core))
    for _ in range(5):
        core.step()
    core.cancel(CancelOrder("a", time.monotonic(), core.steps - 1))
    assert core.stats.last_cancel_latency_steps == 1 and core.stats.cancelled_total == 1
    assert core.stats.cache_tokens_used == 0


def test_a_token_the_grammar_rejects_ends_only_that_stream(core, model, monkeypatch):
    from backend.constraints import ConstraintCompiler, ConstraintSpec

    compiled = ConstraintCompiler(model.constraint_tokenizer()).compile(ConstraintSpec("regex", "[0-9]{5}"))
    letter = model.tokenize("x", add_special=False)[0]
    original = Sampler.sample
    constrained = GenerationRequest("c", tuple(model.tokenize("Digits:")), SamplingParams(temperature=0.0),
                                    StopParams(max_new_tokens=8), constraint=compiled.spec)

    def sample(sampler, ctx, index):  # a sampler that ignores the mask for the constrained sequence
        token = original(sampler, ctx, index)
        constrained_seq = core.scheduler.running.get("c")
        return letter if constrained_seq is not None and constrained_seq.sampler is sampler else token

    monkeypatch.setattr(Sampler, "sample", sample)
    good, bad = Recorder(core), Recorder(core)
    core.add(request(model, "plain"), good)
    core.add(constrained, bad, compiled)
    run_until_idle(core)
    failure = bad.events[-1][1]
    assert isinstance(failure, ErrorEvent) and "rejected" in failure.message
    assert failure.kind is ErrorKind.CONSTRAINT_FAILED, "the caller's constraint failed, not the engine"
    assert compiled.health.failed, "a failed matcher's constraint must leave the cache"
    assert all(isinstance(event, ErrorEvent) or not event.text for _, event in bad.events)  # never output
    assert good.finish.usage.completion_tokens == 8


def test_a_gap_left_by_a_finished_sequence_is_closed_without_changing_outputs(model):
    core = make_core(model, max_batch_size=3, prefix_cache=False)
    try:
        solo = Recorder(core)
        core.add(request(model, "solo", prompt="Rivers run", max_new_tokens=30), solo)
        run_until_idle(core)
        recs = {rid: Recorder(core) for rid in ("a", "b", "c")}
        core.add(request(model, "a", max_new_tokens=30), recs["a"])
        core.add(request(model, "b", max_new_tokens=2), recs["b"])
        core.add(request(model, "c", prompt="Rivers run", max_new_tokens=30), recs["c"])
        core.step()
        assert [core.scheduler.running[r].slot for r in "abc"] == [0, 1, 2]
        while "b" in core.scheduler.running:  # prefilled one prompt a step, then 2 tokens
            core.step()
        assert core.scheduler.running["c"].slot == 2
        core.step()  # c moves down into the slot b left
        assert core.scheduler.running["c"].slot == 1
        assert cache_cells(core, 2) == 0 and cache_cells(core, 1) > 0
        run_until_idle(core)
        token_ids = lambda rec: [t.token_id for _, e in rec.events for t in e.tokens]  # noqa: E731
        assert token_ids(recs["c"]) == token_ids(solo)  # the moved cache is exact
    finally:
        core.close()


def test_a_first_token_holds_the_next_step_only_while_no_other_request_waits_for_its_own(core, model, monkeypatch):
    """llama.cpp's next step waits a moment after a first token so that it is sent before its threads take the
    cores again; not while another request still waits for its own first token (it would wait for the hold too)."""
    holds: list[float] = []
    monkeypatch.setattr("backend.llamacpp.first_token_hold.time.sleep", holds.append)
    a, b = Recorder(core), Recorder(core)
    core.add(request(model, "a", max_new_tokens=8), a)
    core.add(request(model, "b", max_new_tokens=8), b)

    def started(rec: Recorder) -> bool:
        return any(isinstance(event, TokenEvent) and event.tokens for _, event in rec.events)

    while not started(a) and not started(b):
        core.step()
    assert started(a) != started(b)  # one prompt a llama_decode
    while not (started(a) and started(b)):
        core.step()
    assert holds == []  # the other's first token would have waited for each of those holds
    core.step()
    assert holds == [EngineConfig().llamacpp.first_token_hold_ms / 1000] and holds[0] > 0
    run_until_idle(core)


def test_a_request_arriving_under_a_live_id_ends_the_leftover_and_no_slot_is_lost(model):
    """A front end reuses an id only once its request ended, so a sequence still holding it is a ghost: it ends
    (CANCELLED) when the new request arrives. Two live sequences of one id lost a slot, and the next step's
    compaction crashed the engine loop (seen in the fuzz test)."""
    core = make_core(model, max_batch_size=3)
    try:
        old, beside, new = Recorder(core), Recorder(core), Recorder(core)
        core.add(request(model, "same", max_new_tokens=40), old)
        core.add(request(model, "beside", max_new_tokens=40), beside)
        for _ in range(3):
            core.step()
        core.add(request(model, "same", max_new_tokens=4), new)
        assert old.finish is not None and old.finish.reason is FinishReason.CANCELLED
        run_until_idle(core)
        assert new.finish.reason is FinishReason.MAX_TOKENS and beside.finish.reason is FinishReason.MAX_TOKENS
        slots = core.slots
        assert sorted(slots._free) == list(range(slots.count))  # every slot free again, none held twice
    finally:
        core.close()
