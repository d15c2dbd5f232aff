"""The constraint module on the real model's vocabulary, without a server."""

from __future__ import annotations

import json

import llguidance.numpy
import numpy as np
import pytest

from backend.constraints import ConstraintCompiler, ConstraintError, ConstraintSpec, ConstraintState, apply_bitmask
from backend.constraints.tokenizer import build_tokenizer
from backend.tools.formats import HERMES, THINK
from backend.tools.grammar import GrammarBuilder, ReasoningRule, ToolSchema
from tests.harness.fake_engine import BOS, EOS_TOKEN_IDS, SPECIALS, VOCAB_SIZE, encode, piece


@pytest.fixture(scope="module")
def compiler(model):
    return ConstraintCompiler(model.constraint_tokenizer(), cache_size=2)


def allowed_tokens(state: ConstraintState, vocab_size: int) -> np.ndarray:
    bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
    llguidance.numpy.fill_next_token_bitmask(state.matcher, bitmask, 0)
    logits = np.zeros(vocab_size, dtype=np.float32)
    apply_bitmask(logits, bitmask[0])
    return np.flatnonzero(np.isfinite(logits))


def test_apply_bitmask_keeps_exactly_the_allowed_bits():
    row = np.zeros(2, dtype=np.int32)
    row[0] = (1 << 0) | (1 << 5)
    row[1] = -(1 << 31)  # only the top bit: token 63
    logits = np.arange(50, dtype=np.float32)  # fewer logits than bits: the tail is ignored
    apply_bitmask(logits, row)
    assert list(np.flatnonzero(np.isfinite(logits))) == [0, 5]


def test_the_mask_follows_the_grammar(model, compiler):
    state = ConstraintState(compiler.compile(ConstraintSpec("choice", ("yes", "no"))))
    allowed = allowed_tokens(state, model.vocab_size)
    assert {model.tokenize(word, add_special=False)[0] for word in ("yes", "no")} <= set(allowed)
    assert all(model.pieces[t] and (b"yes".startswith(model.pieces[t]) or b"no".startswith(model.pieces[t])) for t in allowed)
    for token in model.tokenize("yes", add_special=False):
        assert state.consume(token)
    assert state.complete and state.satisfied


def test_special_tokens_are_never_produced_as_text(model, compiler):
    state = ConstraintState(compiler.compile(ConstraintSpec("regex", "[^\\n]{0,50}")))
    allowed = set(allowed_tokens(state, model.vocab_size))
    specials = set(model.special_token_ids) - set(model.eos_token_ids)
    assert specials and len(allowed) > 1000 and not allowed & specials


def test_eos_is_allowed_only_where_the_grammar_may_end(model, compiler):
    state = ConstraintState(compiler.compile(ConstraintSpec("regex", "[0-9]{2,3}")))
    for text, may_end in [("", False), ("1", False), ("12", True)]:
        fresh = ConstraintState(state.compiled)
        for token in model.tokenize(text, add_special=False):
            assert fresh.consume(token)
        eos_allowed = bool(set(allowed_tokens(fresh, model.vocab_size)) & set(model.eos_token_ids))
        assert eos_allowed == may_end, text


def test_forced_tokens_are_offered_and_not_consumed(model, compiler):
    schema = {"type": "object", "properties": {"weather_forecast": {"type": "boolean"}}, "required": ["weather_forecast"],
              "additionalProperties": False}
    state = ConstraintState(compiler.compile(ConstraintSpec("json_schema", json.dumps(schema))))
    forced = state.forced_tokens(limit=16)
    assert b"".join(model.pieces[t] for t in forced).startswith(b'{"weather')
    assert state.forced_tokens(limit=2) == forced[:2]  # nothing was consumed by asking
    for token in forced:
        assert state.consume(token)


def test_a_proposal_is_split_as_plain_decoding_would_take_it(model, compiler):
    """After each sampled token the grammar's forced run is taken unsampled: a proposal marks those tokens,
    completes a run it stops inside, ends where it departs from one, and leaves the matcher untouched."""
    schema = {"type": "object", "properties": {"customer_account_identifier": {"type": "integer"},
                                               "is_active": {"type": "boolean"}},
              "required": ["customer_account_identifier", "is_active"], "additionalProperties": False}
    state = ConstraintState(compiler.compile(ConstraintSpec("json_schema", json.dumps(schema))))
    for token in state.forced_tokens(limit=16):  # as the engine does after its first sample
        state.consume(token)
    text = model.tokenize('":12,"is_active":true}', add_special=False)
    before = (state.forced_tokens(16), state.matcher.validate_tokens(text))

    tokens, forced = state.split_forced(text, max_forced=16)
    marked = [(model.pieces[t].decode(), f) for t, f in zip(tokens, forced)]
    assert tokens == text and marked[0] == ('":', False)  # the first is sampled
    assert ("1", False) in marked and ("true", False) in marked and ("active", True) in marked
    assert (state.forced_tokens(16), state.matcher.validate_tokens(text)) == before  # the matcher is as it was

    first_forced = forced.index(True)
    short, short_forced = state.split_forced(text[: first_forced + 1], max_forced=16)  # stops inside the key
    assert short == tokens[: len(short)] and len(short) > first_forced + 1 and all(short_forced[first_forced:])

    departing = [*text[:first_forced], model.tokenize("i", add_special=False)[0]]  # valid, but not what is forced
    assert state.split_forced(departing, max_forced=16) == (short, short_forced)  # the forced run replaces it

    assert state.split_forced(text, max_forced=0) == (text, [False] * len(text))  # nothing forced: all sampled
    assert state.split_forced(model.tokenize("true", add_special=False), 16) == ([], [])  # not allowed here


@pytest.fixture(scope="module")
def byte_compiler() -> ConstraintCompiler:
    """A compiler over the fake engine's byte vocabulary: no model needed."""
    pieces = [SPECIALS.get(t) or piece(t) for t in range(VOCAB_SIZE)]
    return ConstraintCompiler(build_tokenizer(pieces, list(SPECIALS), EOS_TOKEN_IDS, BOS, encode))


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
_TEXT_MARKERS = GrammarBuilder(lambda marker: False)
ENDS_AFTER = {  # a constraint whose grammar stops with its last character, and the output that ends it
    "tool call": (  # one required call, not parallel: nothing may follow it
        ConstraintSpec("composed", _TEXT_MARKERS.compose(
            None, _TEXT_MARKERS.tool_answer(HERMES, [ToolSchema("get_weather", CITY)], forced=True, parallel=False))),
        'Paris"}}\n</tool_call>',
    ),
    "json schema": (ConstraintSpec("json_schema", json.dumps(CITY)), 'Paris"}'),
}


@pytest.mark.parametrize("case", ENDS_AFTER)
@pytest.mark.parametrize("eos", EOS_TOKEN_IDS)
def test_a_proposal_running_past_the_grammars_end_leaves_the_matcher_as_it_was(byte_compiler, case, eos):
    """A proposal taken from an earlier answer carries that answer's end-of-generation token (and more). Once
    the grammar has stopped, llguidance takes that token without counting it for rollback: consuming it
    here rolled back one real token too many (the key then came out twice: {"citycity":"Paris"})."""
    spec, answer = ENDS_AFTER[case]
    state = ConstraintState(byte_compiler.compile(spec))
    for token in state.forced_tokens(limit=64):  # as the engine does: the call up to the city's value
        assert state.consume(token)
    before = (state.forced_tokens(16), state.matcher.validate_tokens(encode(answer.encode())))
    assert before[0] == [] and before[1] == len(answer)

    tokens, _ = state.split_forced([*encode(answer.encode()), eos, *encode(b"\n<tool_call>")], max_forced=16)
    assert (state.forced_tokens(16), state.matcher.validate_tokens(encode(answer.encode()))) == before
    assert tokens == encode(answer.encode())  # nothing after the token that completes the grammar: it ends there
    for token in tokens:
        assert state.consume(token)
    assert state.complete


def test_a_proposed_end_of_generation_where_the_grammar_may_end_is_kept(byte_compiler):
    """Where the grammar may go on or end, the end-of-generation token is a proposal like any other."""
    state = ConstraintState(byte_compiler.compile(ConstraintSpec("regex", "[0-9]{2,3}")))
    assert state.consume(encode(b"1")[0])
    proposal = [*encode(b"2"), EOS_TOKEN_IDS[0]]
    assert state.split_forced(proposal, max_forced=16) == (proposal, [False, False])
    assert state.matcher.validate_tokens(encode(b"234")) == 2  # still after "1"


ROLLBACK = {  # a constraint, an output it allows, and whether its matcher can take that output back
    "stop=": (ConstraintSpec("grammar", 'start: foo "!"\nfoo[stop="zzz"]: /[a-z ,.]*/'), "the cat", False),
    "max_tokens=": (ConstraintSpec("grammar", 'start: foo "!"\nfoo[max_tokens=30]: /[a-z ,.]*/'), "the cat", False),
    "stop= after the start": (
        ConstraintSpec("grammar", 'start: "say: " foo "!"\nfoo[stop="zzz"]: /[a-z ,.]*/'), "say: the", False),
    "reasoning": (ConstraintSpec("composed", _TEXT_MARKERS.compose(
        ReasoningRule(THINK, opened=False), _TEXT_MARKERS.free_answer())), "<think>hm", False),
    "reasoning with a budget": (ConstraintSpec("composed", _TEXT_MARKERS.compose(
        ReasoningRule(THINK, opened=True, budget_tokens=8), _TEXT_MARKERS.free_answer())), "hm", False),
    "suffix=": (ConstraintSpec("grammar", 'start: foo "!"\nfoo[suffix="zzz"]: /[a-z ,.]*/'), "the cat", True),
    "lark": (ConstraintSpec("grammar", 'start: /[a-z ,.]*/ "!"'), "the cat", True),
    "regex": (ConstraintSpec("regex", "[0-9]{2,3}"), "12", True),
    "json schema": (ConstraintSpec("json_schema", json.dumps(CITY)), '{"city":"Par', True),
    "tool calls in free text": (ConstraintSpec("composed", _TEXT_MARKERS.compose(
        None, _TEXT_MARKERS.tool_answer(HERMES, [ToolSchema("get_weather", CITY)], forced=False, parallel=True))),
        "Sure", True),
}


@pytest.mark.parametrize("case", ROLLBACK)
def test_a_compiled_constraint_knows_whether_its_matcher_rolls_back(byte_compiler, case):
    """Checking proposed tokens takes them back; llguidance refuses that, erring, in a grammar with stop= or
    max_tokens= anywhere, so such a constraint is never speculated on. The property matches what a matcher
    then does with a longer output, even one that has not reached the rule."""
    spec, output, rolls_back = ROLLBACK[case]
    compiled = byte_compiler.compile(spec)
    assert compiled.rolls_back is rolls_back
    matcher = compiled.new_matcher()
    tokens = encode(output.encode())
    assert matcher.consume_tokens(tokens)
    assert matcher.rollback(len(tokens)) is rolls_back and matcher.is_error() is not rolls_back
    assert byte_compiler.compile(spec).rolls_back is rolls_back  # cached with the compiled grammar


def test_a_rejected_token_puts_the_state_in_error(model, compiler):
    state = ConstraintState(compiler.compile(ConstraintSpec("regex", "[0-9]+")))
    assert not state.consume(model.tokenize("abc", add_special=False)[0])
    assert state.failure()


def test_the_cache_is_a_bounded_lru(compiler):
    specs = [ConstraintSpec("regex", f"[a-z]{{{n}}}") for n in (1, 2, 3)]
    for spec in specs[:2]:
        compiler.compile(spec)
    assert compiler.compile(specs[0]).cached  # touch: specs[1] is now the oldest
    compiler.compile(specs[2])
    assert compiler.cached(specs[1]) is None
    assert compiler.cached(specs[0]) is not None and compiler.cached(specs[2]) is not None


@pytest.mark.parametrize(
    "spec, message",
    [
        (ConstraintSpec("json_schema", "[1, 2]"), "must be a JSON object"),
        (ConstraintSpec("json_schema", json.dumps({"type": "object", "if": {}, "then": {}})), "Unimplemented keys"),
        (ConstraintSpec("regex", "(?=lookahead)"), "look"),
    ],
)
def test_unenforceable_constraints_raise(compiler, spec, message):
    with pytest.raises(ConstraintError, match=message):
        compiler.compile(spec)


def test_whitespace_policy(model, compiler):
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})

    def accepts(spec: ConstraintSpec, text: str) -> bool:
        state = ConstraintState(compiler.compile(spec))
        tokens = model.tokenize(text, add_special=False)
        return state.matcher.try_consume_tokens(tokens) == len(tokens) and state.satisfied

    compact = ConstraintSpec("json_schema", schema)
    assert accepts(compact, '{"a":1}') and not accepts(compact, '{"a": 1}')
    flexible = ConstraintSpec("json_schema", schema, whitespace_flexible=True)
    assert accepts(flexible, '{\n  "a": 1\n}')
    capped = ConstraintSpec("json_schema", schema, max_whitespace=2)
    assert accepts(capped, '{"a":  1}') and not accepts(capped, '{"a":   1}')
