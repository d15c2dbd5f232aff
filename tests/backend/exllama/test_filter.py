"""The exllama grammar filter's core on CPU, with llguidance and the real model's vocabulary; and constrained
jobs through the shared core for both generations (their filter shells built by the real bindings)."""

from __future__ import annotations

import numpy as np
import pytest

from backend.constraints import ConstraintCompiler, ConstraintSpec
from backend.events import ErrorEvent, FinishReason
from backend.exllama.grammar_filter import GrammarFilterCore
from backend.types import GenerationRequest, SamplingParams, StopParams
from tests.harness.exllama_fakes import GENERATIONS, eos, fake_core, filter_core_of, streaming


@pytest.fixture(scope="module")
def compiler(model):
    return ConstraintCompiler(model.constraint_tokenizer())


def allowed(core: GrammarFilterCore, padded: int) -> set[int]:
    logits = np.zeros(padded, dtype=np.float32)
    assert core.prepare_mask() is True
    return set(np.flatnonzero(np.isfinite(core.mask_logits(logits))).tolist())


def test_the_mask_follows_the_grammar_and_pads_past_the_vocabulary(model, compiler):
    padded = model.vocab_size + 64  # exllamav2's logits can be wider than the vocabulary
    core = GrammarFilterCore(compiler.compile(ConstraintSpec("regex", "[0-9]{3}")), model.eos_token_ids, model.vocab_size)
    core.begin()
    first = allowed(core, padded)
    assert first and all(model.pieces[t].decode().isdigit() for t in first)
    assert max(first) < model.vocab_size
    for token in model.tokenize("123", add_special=False):
        core.feed(token)
    assert core.complete
    assert allowed(core, padded) == set(model.eos_token_ids)  # complete: only EOS


def test_a_rejected_token_never_raises_and_leaves_only_eos(model, compiler):
    padded = model.vocab_size
    core = GrammarFilterCore(compiler.compile(ConstraintSpec("regex", "[0-9]+")), model.eos_token_ids, padded)
    core.begin()
    core.feed(model.tokenize("abc", add_special=False)[0])
    assert core.error
    assert allowed(core, padded) == set(model.eos_token_ids)
    core.feed(5)  # still no exception in the error state
    pass_tokens, end_tokens = core.allowed_tokens()
    assert set(pass_tokens) == set(model.eos_token_ids) and end_tokens == []


def test_begin_resets_for_the_first_sampling_step(model, compiler):
    core = GrammarFilterCore(compiler.compile(ConstraintSpec("choice", ("yes", "no"))), model.eos_token_ids,
                             model.vocab_size)
    core.feed(model.tokenize("x", add_special=False)[0])
    assert core.error
    core.begin()
    assert not core.error and allowed(core, model.vocab_size) - set(model.eos_token_ids)


# -- a constrained job's finish, through the owner-thread core (the generator is a fake; the filter core is real)


@pytest.fixture(params=GENERATIONS)
def constrained(request, model, compiler):
    core, generators = fake_core(request.param, model.vocab_size, model.pieces.__getitem__, model.eos_token_ids)

    def add(request_id: str, pattern: str, events: list, max_new_tokens: int = 16) -> GrammarFilterCore:
        compiled = compiler.compile(ConstraintSpec("regex", pattern))
        constrained = GenerationRequest(request_id, (1, 2), SamplingParams(temperature=0.0), StopParams(max_new_tokens),
                                        constraint=compiled.spec)
        core.add(constrained, events.append, compiled)
        return filter_core_of(generators, request_id)  # the core the binding's filter shell carries

    return core, generators, add


def feed_text(filter_core: GrammarFilterCore, model, text: str) -> list[int]:
    """What exllamav2 does with each sampled token: compute the mask, then feed the token."""
    tokens = model.tokenize(text, add_special=False)
    for token in tokens:
        filter_core.prepare_mask()
        filter_core.feed(token)
    return tokens


def test_a_finished_grammar_ends_as_constraint_complete(model, constrained):
    core, generators, add = constrained
    events: list = []
    filter_core = add("c", "[0-9]{3}", events)
    tokens = feed_text(filter_core, model, "123")
    assert allowed(filter_core, model.vocab_size) == set(model.eos_token_ids)  # then EOS is forced and sampled
    end_id = model.eos_token_ids[0]
    # As 0.3.2 ends it (and 1.6.5 where the grammar may go on): the digits stream, then the EOS comes alone,
    # only in `held`.
    generators[0].samples["c"] = [(t, model.pieces[t]) for t in tokens] + [(end_id, b"")]
    while core.has_work():
        core.step()
    finish = events[-1].finish
    assert finish.reason is FinishReason.CONSTRAINT_COMPLETE and finish.constraint_satisfied is True
    assert "".join(e.text for e in events) == "123"
    assert [t.token_id for e in events for t in e.tokens] == [*tokens, end_id]
    assert finish.usage.completion_tokens == len(tokens) + 1
    assert finish.timings.constraint_mask_s > 0
    assert sum(e.mask_s for e in events) == pytest.approx(finish.timings.constraint_mask_s)


def test_a_grammar_cut_short_by_max_tokens_is_reported_unsatisfied(model, constrained):
    core, generators, add = constrained
    events: list = []
    filter_core = add("m", "[0-9]{3}", events, max_new_tokens=1)
    tokens = feed_text(filter_core, model, "1")
    generators[0].script = [[eos("m", "max_new_tokens", 1, token_ids=[tokens], text="1")]]
    core.step()
    finish = events[-1].finish
    assert finish.reason is FinishReason.MAX_TOKENS and finish.constraint_satisfied is False


def test_a_constraint_error_fails_that_stream_only(model, constrained):
    core, generators, add = constrained
    broken: list = []
    fine: list = []
    bad = add("bad", "[0-9]+", broken)
    add("ok", "[a-z]+", fine)
    bad.feed(model.tokenize("abc", add_special=False)[0])  # a token the grammar rejects
    generators[0].script = [[streaming("bad", [5], "x"), eos("ok", "max_new_tokens", 1, token_ids=[[6]], text="y")]]
    core.step()
    assert isinstance(broken[-1], ErrorEvent) and "constraint failed" in broken[-1].message
    assert [job.identifier for job in generators[0].cancelled] == ["bad"]
    assert fine[-1].finish.reason is FinishReason.MAX_TOKENS
