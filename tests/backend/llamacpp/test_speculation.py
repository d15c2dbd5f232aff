"""Speculative decoding on the real model: proposed tokens checked in the same decode as everything else
change nothing but the number of steps. Most checks here make the planner check every proposal (wrapped
from outside, as a test's policy), so the mechanism is exercised whatever the machine's costs say."""

from __future__ import annotations

import collections
import dataclasses
import json

import grpc
import pytest

from backend.constraints import ConstraintCompiler, ConstraintSpec
from backend.events import FinishReason, TokenEvent
from backend.llamacpp.sampling import TokenPicker
from backend.llamacpp.speculation import speculator as speculator_module
from backend.llamacpp.speculation.costs import DecodeCosts
from backend.llamacpp.speculation.drafts import AcceptanceRates, DraftState, proposal
from backend.llamacpp.speculation.planner import Candidate, plan_drafts
from backend.llamacpp.speculation.proposers import CopyCursor, NgramIndex, PastNgrams
from backend.types import ChatMessage, GenerationRequest, SamplingParams, SpeculationMode, SpeculationParams, StopParams
from tests.backend.llamacpp.test_prefix_cache import check_cells
from tests.harness.core_driver import Recorder, make_core
from tests.harness.helpers import greedy, rpc_error, stream, text_of
from tokenspout.v1 import generation_pb2 as pb

PASSAGE = (
    "The river rose through the night, and by morning the low fields were a grey sheet of water. Farmers moved "
    "their animals to the ridge, while the ferryman tied his boat to the old oak and waited for the rain to stop."
)
NGRAM = SpeculationParams(SpeculationMode.NGRAM, 16)
OFF = SpeculationParams(SpeculationMode.OFF, 16)


@pytest.fixture
def check_every_proposal(monkeypatch):
    """The planner checks every proposal it is offered, whatever checking costs here."""
    monkeypatch.setattr(speculator_module, "plan_drafts", lambda candidates, costs: [len(c.proposed) for c in candidates])


def copy_prompt(model, passage: str = PASSAGE) -> tuple[int, ...]:
    return tuple(model.render_chat([ChatMessage("user", f"Copy this passage exactly, word for word:\n\n{passage}")]))


def request(model, request_id: str, speculation: SpeculationParams, max_new_tokens: int = 60, **fields):
    sampling = fields.pop("sampling", SamplingParams(temperature=0.0))
    stopping = fields.pop("stopping", StopParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    prompt = fields.pop("prompt", copy_prompt(model))
    return GenerationRequest(request_id, prompt, sampling, stopping, speculation=speculation, **fields)


def run(core, *requests: GenerationRequest) -> dict[str, Recorder]:
    recs = {r.request_id: Recorder(core) for r in requests}
    for r in requests:
        core.add(r, recs[r.request_id])
    for _ in range(2000):
        if not core.has_work():
            return recs
        core.step()
        check_cells(core)
    raise AssertionError("the core did not finish")


def token_ids(rec: Recorder) -> list[int]:
    return [t.token_id for _, event in rec.events if isinstance(event, TokenEvent) for t in event.tokens]


def text(rec: Recorder) -> str:
    return "".join(event.text for _, event in rec.events if isinstance(event, TokenEvent))


def both_ways(model, make_request, check_every_proposal=None, **core_settings):
    """(off, on): the same request without and with speculation, each on a fresh core."""
    results = []
    for speculation in (OFF, NGRAM):
        core = make_core(model, context_length=512, max_batch_size=2, batch_tokens=128, **core_settings)
        try:
            results.append((run(core, make_request(speculation))["r"], core.stats))
        finally:
            core.close()
    return results


def test_the_ngram_index_proposes_what_followed_the_longest_earlier_match():
    index = NgramIndex()
    tokens = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert index.propose(tokens, 4) == ([4, 5, 9, 9], 3, 3)  # after the 3-gram 1, 2, 3, which ended at 3
    tokens.append(7)  # 2, 3, 7 never occurred: nothing to continue
    assert index.propose(tokens, 4) == ([], 0, 0)
    assert index.propose([5, 6], 4) == ([], 0, 0)  # too short to match


def test_past_ngrams_propose_what_followed_in_the_same_callers_finished_sequences():
    past = PastNgrams(capacity=6)
    past.learn("a", [1, 2, 3, 4, 5, 6, 7])
    assert past.propose("a", [9, 1, 2, 3, 4], 2) == [5, 6]
    assert past.propose("b", [9, 1, 2, 3, 4], 2) == []  # another caller's text never speeds anyone up
    assert past.propose("a", [2, 3], 2) == []  # shorter than the 4-gram it matches
    past.learn("a", [10, 11, 12, 13, 14, 15, 16, 17])
    assert len(past) == 6 and past.propose("a", [1, 2, 3, 4], 2) == []  # the oldest went first


def test_a_repeated_request_is_proposed_its_earlier_output_and_gives_the_same_tokens(model, check_every_proposal):
    core = make_core(model, context_length=512, max_batch_size=2, batch_tokens=128)
    try:
        first = run(core, request(model, "first", NGRAM, prompt=copy_prompt(model, "Name three rivers.")))["first"]
        again = run(core, request(model, "again", NGRAM, prompt=copy_prompt(model, "Name three rivers.")))["again"]
    finally:
        core.close()
    assert token_ids(again) == token_ids(first)
    assert again.finish.usage.accepted_draft_tokens > first.finish.usage.accepted_draft_tokens + 20


def test_the_planner_checks_only_where_it_pays():
    costs = DecodeCosts()
    for _ in range(30):  # a pass costs 8 ms, a row 2 ms here
        costs.record(1, 1, 1, 0.010)
        costs.record(1, 3, 3, 0.014)
        costs.record(1, 5, 5, 0.018)
    assert plan_drafts([Candidate(1, [7] * 8, acceptance=0.95)], costs) == [8]
    assert plan_drafts([Candidate(1, [7] * 8, acceptance=0.1)], costs) == [0]
    assert plan_drafts([Candidate(1, [], acceptance=0.95)], costs) == [0]
    expensive = DecodeCosts()
    for _ in range(30):  # a row costs as much as a whole step: checking never pays
        expensive.record(1, 1, 1, 0.010)
        expensive.record(1, 3, 3, 0.030)
        expensive.record(1, 5, 5, 0.050)
    assert plan_drafts([Candidate(1, [7] * 8, acceptance=0.95)], expensive) == [0]


def test_one_feeding_more_rows_than_the_others_costs_a_pass_the_planner_weighs():
    costs = DecodeCosts()
    for _ in range(30):  # the machine measured here: 8 ms a pass, 4.5 ms a row
        for passes, rows in ((1, 8), (2, 12), (1, 16), (3, 14)):
            costs.record(passes, rows, rows, 0.008 * passes + 0.0045 * rows)
    lone = [Candidate(1, [7] * 8, acceptance=0.9)] + [Candidate(1, [])] * 7
    assert plan_drafts(lone, costs) == [0] * 8  # a second pass for one sequence's rows does not pay
    every = [Candidate(1, [7] * 8, acceptance=0.97)] * 8
    assert plan_drafts(every, costs)[0] > 0  # all eight feeding alike: one pass


def test_a_check_never_ends_inside_a_forced_run_and_counts_forced_tokens_as_certain():
    forced = [False, False, True, True, True, False, False]  # a value's two tokens, a key of three, a value
    candidate = Candidate(1, [7] * 7, acceptance=0.5, forced=forced)
    assert [candidate.cut(k) for k in (1, 2, 3, 4, 6, 8)] == [1, 5, 5, 5, 6, 7]
    assert candidate.sampled(5) == 2  # rows with logits before the key only
    assert candidate.expected_accepted(5) == pytest.approx(0.5 + 0.25 * 4)  # the key comes with its value
    assert Candidate(1, [7] * 3, acceptance=0.5).expected_accepted(3) == pytest.approx(0.5 + 0.25 + 0.125)
    costs = DecodeCosts()
    for _ in range(30):  # a pass costs 8 ms, a row 4.5 ms: a plain step 12.5 ms
        for passes, rows in ((1, 8), (2, 12), (1, 16), (3, 14)):
            costs.record(passes, rows, rows, 0.008 * passes + 0.0045 * rows)
    keyed = Candidate(1, [7] * 12, acceptance=0.8, forced=[False] + [True] * 10 + [False])
    assert plan_drafts([keyed], costs) == [11]  # one guess, and the key that comes with it
    assert plan_drafts([Candidate(1, [7] * 12, acceptance=0.8)], costs)[0] < 11  # were they all guesses, fewer pay


def test_the_cost_model_learns_a_line_and_keeps_the_lone_row_apart():
    costs = DecodeCosts()
    costs.record(1, 1, 1, 0.0096)  # one lone row: llama.cpp's faster path
    for _ in range(40):
        costs.record(1, 120, 1, 0.008 + 0.0045 * (1 + 0.8 * 119))  # prompt chunks: many rows, logits on one
        costs.record(1, 5, 5, 0.008 + 0.0045 * 5)
        costs.record(2, 9, 9, 0.016 + 0.0045 * 9)
        costs.record(1, 1, 1, 0.0096)
    assert costs.estimate(1, 1, 1) == pytest.approx(0.0096, rel=0.001)  # a shape: its mean over a moving line
    assert costs.estimate(1, 17, 17) == pytest.approx(0.008 + 0.0045 * 17, rel=0.05)
    assert costs.estimate(2, 24, 24) == pytest.approx(0.016 + 0.0045 * 24, rel=0.05)
    steady = DecodeCosts()  # only plain steps of eight sequences, and prompt chunks, to learn from
    for _ in range(60):
        steady.record(1, 8, 8, 0.008 + 0.0045 * 8)
        steady.record(1, 60, 1, 0.008 + 0.0045 * (1 + 0.8 * 59))
    assert steady.estimate(2, 12, 12) == pytest.approx(0.016 + 0.0045 * 12, rel=0.1)


def test_a_shape_off_the_line_is_learned_apart_and_the_planner_drafts_around_it():
    costs = DecodeCosts()
    for _ in range(30):  # 8 ms a pass, 3 ms a row, but nine rows with logits cost 20 ms more (the output layer's tiles)
        for rows in (1, 3, 5, 7, 9):
            costs.record(1, rows, rows, 0.008 + 0.003 * rows + (0.020 if rows == 9 else 0))
    assert costs.estimate(1, 9, 9) == pytest.approx(0.055, rel=0.02)
    assert costs.estimate(1, 7, 7) == pytest.approx(0.029, rel=0.02)
    assert plan_drafts([Candidate(1, [7] * 8, acceptance=0.98)], costs) == [6]  # on the line alone: 8
    costs.record(1, 9, 9, 10.0)  # one decode stalled by another process
    assert costs.estimate(1, 9, 9) < 2 * 0.055  # moves the shape's estimate a bounded step


def test_acceptance_is_learned_per_source_and_shared_as_a_new_sequences_start():
    engine = AcceptanceRates()
    copying, fresh = DraftState(16), DraftState(16)
    untried = fresh.acceptance("prompt4", engine)
    for _ in range(20):
        copying.checked("prompt4", 8, 8)
        engine.checked("prompt4", 8, 8)
        copying.checked("output2", 4, 0)
        engine.checked("output2", 4, 0)
    assert copying.acceptance("prompt4", engine) > 0.95 and copying.acceptance("output2", engine) < 0.2
    assert fresh.acceptance("prompt4", engine) > 0.9 > untried  # what the engine saw is where it starts
    assert fresh.acceptance("output2", engine) < 0.25


def test_the_benefit_of_the_doubt_probes_an_unknown_source_but_never_makes_a_known_one_certain():
    engine, draft = AcceptanceRates(), DraftState(16)
    assert 0.85 < draft.acceptance("follow", engine) < 0.9  # never seen: worth a probe at one stream
    for _ in range(10):  # right 19 tokens in 20, seen a few times
        engine.checked("prompt4", 4, 4)
        engine.checked("prompt4", 16, 15)
    known = engine.rate("prompt4")
    assert 0.9 < known < draft.acceptance("prompt4", engine) < known + (1 - known) / 2


def test_a_proposal_says_where_it_came_from_and_is_short_while_that_is_little_known():
    engine = AcceptanceRates()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2, 3, 4]
    assert proposal(tokens, 11, DraftState(16), None, 8).source == "prompt4"
    assert proposal(tokens, 4, DraftState(16), None, 8).source == "output4"  # what followed it is output
    copying = list(range(1, 21)) + list(range(1, 13))  # twelve tokens repeat the prompt's first twelve
    assert proposal(copying, 20, DraftState(16), None, 8).source == "prompt4+"  # a copy well under way
    assert proposal(copying[:-8], 20, DraftState(16), None, 8).source == "prompt4"  # four tokens in
    assert len(proposal(tokens, 11, DraftState(16), None, 8, engine=engine).tokens) == 4  # a probe
    for _ in range(10):
        engine.checked("prompt4", 8, 8)
    assert len(proposal(tokens, 11, DraftState(16), None, 8, engine=engine).tokens) == 8
    past = PastNgrams()
    past.learn("a", [11, 12, 13, 14, 15, 16])
    offer = proposal([9, 11, 12, 13, 14], 5, DraftState(16), None, 8, (past, "a"))
    assert offer.tokens == [15, 16] and offer.source == "past"
    assert proposal([1, 2, 3], 3, DraftState(16), None, 8, (past, "a")).tokens == []


def test_greedy_output_is_the_same_and_takes_fewer_steps(model, check_every_proposal):
    (off, off_stats), (on, on_stats) = both_ways(model, lambda s: request(model, "r", s))
    assert token_ids(on) == token_ids(off) and len(token_ids(on)) == 60
    assert on_stats.accepted_draft_tokens_total > 20 and on.finish.usage.accepted_draft_tokens > 20
    assert on.finish.usage.draft_tokens == on_stats.draft_tokens_total >= on.finish.usage.accepted_draft_tokens
    assert on_stats.steps < off_stats.steps - 20
    assert off.finish.usage.draft_tokens == 0
    accepted_events = [e for _, e in on.events if isinstance(e, TokenEvent) and e.accepted_drafts]
    assert len(accepted_events) == on.finish.usage.accepted_draft_tokens
    assert len({e.step for e in accepted_events}) < len(accepted_events)  # several tokens in one step


def test_past_256_cached_tokens_beside_another_stream_the_tokens_are_still_plain_decodings(model, check_every_proposal):
    """Past 256 cached tokens llama.cpp rounds a lone sequence's single row its own way (docs/benchmarks.md);
    beside another stream every row, checked in a group or not, is computed alike."""
    prompt = copy_prompt(model, f"{PASSAGE} {PASSAGE} {PASSAGE}")
    outputs = []
    for speculation in (OFF, NGRAM):
        core = make_core(model, context_length=512, max_batch_size=2, batch_tokens=256)
        try:
            recs = run(core, request(model, "r", speculation, max_new_tokens=150, prompt=prompt),
                       request(model, "company", OFF, max_new_tokens=150, prompt=copy_prompt(model, "Name three rivers.")))
            outputs.append(token_ids(recs["r"]))
            accepted = recs["r"].finish.usage.accepted_draft_tokens
        finally:
            core.close()
    assert len(prompt) + 150 > 300 and len(outputs[1]) == 150 and accepted > 50
    assert outputs[1] == outputs[0]


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.0, repetition_penalty=1.1, penalty_last_n=16),
    SamplingParams(temperature=0.0, frequency_penalty=0.2, presence_penalty=0.1, penalty_last_n=16),
    SamplingParams(temperature=0.0, dry=dataclasses.replace(SamplingParams().dry, multiplier=0.8)),
    SamplingParams(temperature=0.8, top_k=20, seed=11),
], ids=["repetition", "frequency-presence", "dry", "sampled"])
def test_samplers_that_look_back_see_every_accepted_token(model, check_every_proposal, sampling):
    (off, _), (on, stats) = both_ways(model, lambda s: request(model, "r", s, sampling=sampling))
    assert token_ids(on) == token_ids(off)
    assert stats.draft_tokens_total > 0


def test_logit_bias_holds_on_accepted_tokens(model, check_every_proposal):
    banned = model.tokenize(" fields", add_special=False)[0]
    sampling = SamplingParams(temperature=0.0, logit_bias={banned: -100.0})
    (off, _), (on, stats) = both_ways(model, lambda s: request(model, "r", s, sampling=sampling))
    assert token_ids(on) == token_ids(off) and banned not in token_ids(on)
    assert stats.accepted_draft_tokens_total > 0


def test_a_stop_sequence_inside_an_accepted_run_never_leaks(model, check_every_proposal):
    stopping = StopParams(max_new_tokens=80, ignore_eos=True, stop_sequences=("grey sheet",))
    (off, _), (on, stats) = both_ways(model, lambda s: request(model, "r", s, stopping=stopping))
    assert on.finish.reason is FinishReason.STOP_SEQUENCE and text(on) == text(off)
    assert "grey" not in text(on) and text(on).endswith("were a ")
    assert stats.accepted_draft_tokens_total > 0


@pytest.mark.parametrize("max_new_tokens", [1, 7, 23])
def test_max_new_tokens_is_never_exceeded(model, check_every_proposal, max_new_tokens):
    (off, _), (on, _) = both_ways(model, lambda s: request(model, "r", s, max_new_tokens=max_new_tokens))
    assert len(token_ids(on)) == on.finish.usage.completion_tokens == max_new_tokens
    assert token_ids(on) == token_ids(off)


def constrained_request(model, request_id: str, speculation: SpeculationParams) -> GenerationRequest:
    schema = ('{"type": "object", "properties": {"passage": {"type": "string"}, "words": {"type": "integer"}}, '
              '"required": ["passage", "words"], "additionalProperties": false}')
    compiled = ConstraintCompiler(model.constraint_tokenizer()).compile(ConstraintSpec("json_schema", schema))
    prompt = tuple(model.render_chat([ChatMessage("user", f'As JSON with "passage" and "words": {PASSAGE}')]))
    return request(model, request_id, speculation, prompt=prompt, stopping=StopParams(max_new_tokens=120),
                   constraint=compiled.spec)


def test_a_constraint_holds_on_accepted_tokens(model, check_every_proposal):
    (off, _), (on, stats) = both_ways(model, lambda s: constrained_request(model, "r", s))
    assert token_ids(on) == token_ids(off) and on.finish.reason is FinishReason.CONSTRAINT_COMPLETE
    assert on.finish.constraint_satisfied and stats.draft_tokens_total > 0


KEY_HEAVY = {"type": "array", "minItems": 3, "maxItems": 3, "items": {
    "type": "object", "additionalProperties": False,
    "required": ["customer_account_identifier", "customer_display_name", "renewal_is_automatic"],
    "properties": {"customer_account_identifier": {"type": "integer", "minimum": 0, "maximum": 99999},
                   "customer_display_name": {"type": "string", "maxLength": 12},
                   "renewal_is_automatic": {"type": "boolean"}}}}


def test_forced_tokens_among_proposals_are_taken_unsampled_as_plain_decoding_takes_them(model, check_every_proposal,
                                                                                         monkeypatch):
    """Keys repeat in each object, so proposals run through them; a key's forced tokens are not sampled, and
    the tokens are plain decoding's, forced and sampled ones alike (the same number of samples drawn)."""
    compiled = ConstraintCompiler(model.constraint_tokenizer()).compile(
        ConstraintSpec("json_schema", json.dumps(KEY_HEAVY)))
    prompt = tuple(model.render_chat([ChatMessage("user", "List three customers of a bakery as JSON.")]))
    picks = []
    pick = TokenPicker.pick
    monkeypatch.setattr(TokenPicker, "pick", lambda *args: (picks.append(1), pick(*args))[1])
    results = []
    for speculation in (OFF, NGRAM):
        core = make_core(model, context_length=512, max_batch_size=2, batch_tokens=128)
        picks.clear()
        try:
            recs = run(core, request(model, "r", speculation, prompt=prompt, stopping=StopParams(max_new_tokens=150),
                                     constraint=compiled.spec))
            results.append((recs["r"], len(picks), core.stats.steps))
        finally:
            core.close()
    (off, off_picks, off_steps), (on, on_picks, on_steps) = results
    assert token_ids(on) == token_ids(off) and on.finish.reason is FinishReason.CONSTRAINT_COMPLETE
    assert on_picks == off_picks < len(token_ids(on)) / 2  # most tokens are forced, in both
    assert on.finish.usage.accepted_draft_tokens > 30 and on_steps < off_steps / 2


def test_forced_tokens_go_at_once_beside_other_sequences_too(model):
    """A grammar's forced tokens are fed in the step after the sample whatever else runs, so a constrained
    sequence takes as many steps beside another as alone."""
    spans = []
    for beside in (False, True):
        core = make_core(model, context_length=512, max_batch_size=2, batch_tokens=128)
        try:
            others = [request(model, "other", OFF, max_new_tokens=200)] if beside else []
            recs = run(core, *others, constrained_request(model, "r", OFF))
            steps = [step for step, e in recs["r"].events if isinstance(e, TokenEvent) and e.tokens]
            spans.append((steps[-1] - steps[0], token_ids(recs["r"])))
        finally:
            core.close()
    (alone_span, alone_tokens), (beside_span, beside_tokens) = spans
    assert beside_tokens == alone_tokens and beside_span == alone_span


def test_cancelling_a_speculating_sequence_frees_every_cell(model, check_every_proposal):
    core = make_core(model, context_length=512, max_batch_size=2, batch_tokens=128)
    try:
        rec = Recorder(core)
        core.add(request(model, "r", NGRAM, max_new_tokens=200), rec)
        while core.stats.accepted_draft_tokens_total < 10:
            core.step()
            check_cells(core)
        core.cancel("r")
        check_cells(core)
        assert rec.finish.reason is FinishReason.CANCELLED and core.stats.cache_tokens_used == 0
    finally:
        core.close()


def test_a_preempted_speculating_sequence_comes_back_with_the_same_output(model, check_every_proposal):
    solo, preempted = (make_core(model, context_length=512, max_batch_size=1, batch_tokens=128) for _ in range(2))
    try:
        expected = token_ids(run(solo, request(model, "r", NGRAM, max_new_tokens=80))["r"])
        a, b = Recorder(preempted), Recorder(preempted)
        preempted.add(request(model, "r", NGRAM, max_new_tokens=80), a)
        while preempted.stats.accepted_draft_tokens_total < 5:
            preempted.step()
        preempted.pause("r")
        preempted.add(request(model, "b", NGRAM, max_new_tokens=8), b)
        while not b.events or b.finish is None:
            preempted.step()
            check_cells(preempted)
        assert preempted.stats.preempted_total == 1
        preempted.resume("r")
        while preempted.has_work():
            preempted.step()
            check_cells(preempted)
        assert token_ids(a) == expected
    finally:
        solo.close()
        preempted.close()


def test_prefix_reuse_after_speculation_gives_the_same_output(model, check_every_proposal):
    core = make_core(model, context_length=512, max_batch_size=2, batch_tokens=128, prefix_cache_exact=True)
    try:
        first = run(core, request(model, "first", NGRAM))["first"]
        again = run(core, request(model, "again", NGRAM))["again"]
        assert again.finish.usage.cached_tokens > 16 and token_ids(again) == token_ids(first)
    finally:
        core.close()


# -- through gRPC, on the shared server (the planner decides there: the output is the same either way)


def test_the_request_option_and_its_usage_through_grpc(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert set(info.speculation_modes) == {pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_NGRAM}
    assert info.default_speculation.max_draft_tokens > 0
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content=f"Copy this passage exactly:\n\n{PASSAGE}")])
    outputs = {}
    for mode in (pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_NGRAM):
        request = greedy("", max_new_tokens=48, ignore_eos=True)
        request.ClearField("prompt")
        request.chat.CopyFrom(chat)
        request.speculation.mode = mode
        messages = stream(stub, request)
        outputs[mode] = text_of(messages)
        usage = messages[-1].finish.usage
        assert usage.completion_tokens == 48 and usage.accepted_draft_tokens <= usage.draft_tokens
        if mode == pb.SPECULATION_MODE_OFF:
            assert usage.draft_tokens == 0
    assert outputs[pb.SPECULATION_MODE_OFF] == outputs[pb.SPECULATION_MODE_NGRAM]


def test_bad_speculation_options_are_invalid_argument(stub):
    request = greedy("Hello")
    request.speculation.max_draft_tokens = 1000
    request.speculation.mode = 7
    error = rpc_error(lambda: stream(stub, request))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    from tests.harness.helpers import bad_request_fields

    assert {"speculation.max_draft_tokens", "speculation.mode"} <= set(bad_request_fields(error))


def chi_square_bound(df: int, z: float = 3.09) -> float:
    """The chi-square statistic a test at p = 0.001 rejects above (Wilson-Hilferty's approximation)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def test_sampling_keeps_its_distribution_with_speculation(model, check_every_proposal):
    """Temperature 1, different seeds on and off: the token at a fixed place follows the same distribution
    (a two-sample chi-square test), while proposals were accepted before it in most samples."""
    position, samples = 8, 120
    counts = {}
    accepted_before = 0
    for speculation, seed_base in ((OFF, 0), (NGRAM, 10_000)):
        core = make_core(model, context_length=256, max_batch_size=8, batch_tokens=256, max_queued_requests=samples)
        try:
            requests = [request(model, f"s{i}", speculation, max_new_tokens=position + 1,
                                sampling=SamplingParams(temperature=1.0, seed=seed_base + i)) for i in range(samples)]
            recs = run(core, *requests)
        finally:
            core.close()
        assert all(len(token_ids(rec)) == position + 1 for rec in recs.values()), "every sample runs to its end"
        counts[speculation.mode] = collections.Counter(token_ids(rec)[position] for rec in recs.values())
        if speculation is NGRAM:
            accepted_before = sum(
                any(e.accepted_drafts for _, e in rec.events[:position] if isinstance(e, TokenEvent)) for rec in recs.values()
            )
    off, on = counts[SpeculationMode.OFF], counts[SpeculationMode.NGRAM]
    common = [t for t in off.keys() | on.keys() if off[t] + on[t] >= 10]
    rows = [(off[t], on[t]) for t in common] + [(
        samples - sum(off[t] for t in common), samples - sum(on[t] for t in common)
    )]
    rows = [row for row in rows if sum(row) > 0]
    statistic = sum((o - sum(row) / 2) ** 2 / (sum(row) / 2) for row in rows for o in row)
    assert len(rows) >= 3, rows  # a distribution with choices in it, or the test would prove nothing
    assert accepted_before > samples // 2
    assert statistic < chi_square_bound(len(rows) - 1), (statistic, rows)


def test_the_copy_cursor_follows_a_copy_across_an_added_and_a_left_out_token():
    cursor = CopyCursor()
    passage = [10, 11, 12, 13, 14, 15, 16, 17]
    tokens = [*passage, 99, 10, 11]  # a prompt, then a copy under way
    cursor.follow(tokens)
    cursor.sync(2)  # a 4-gram matched: what follows 10, 11 comes next
    tokens += [12, 50]  # the copy, then an added token (a comma)
    cursor.follow(tokens)
    assert cursor.propose(tokens, 3) == [13, 14, 15]  # goes on where it left off
    tokens += [13, 15]  # 14 left out
    cursor.follow(tokens)
    assert cursor.propose(tokens, 2) == [16, 17]
    tokens += [70, 71, 72]  # three that follow nothing: the copy is over
    cursor.follow(tokens)
    assert cursor.propose(tokens, 2) == []
