"""A constraint never claims a success it did not earn, and a bad one is the caller's error.

Every case here was once answered wrongly: an empty language reported as
CONSTRAINT_COMPLETE, constraints past llguidance's limits failing mid-stream as
ENGINE_FAILURE, a failed matcher poisoning the cached constraint for every later
request, and post-validation dying on patterns llguidance accepts.
"""

from __future__ import annotations

import json

import grpc
import pytest

from backend.constraints import ConstraintCompiler, ConstraintError, ConstraintSpec, ConstraintState
from tests.harness.helpers import bad_request_fields, error_reason, rpc_error
from tokenspout.v1 import generation_pb2 as pb

INVALID = grpc.StatusCode.INVALID_ARGUMENT
COMPLETE = pb.FinishReason.FINISH_REASON_CONSTRAINT_COMPLETE

REFUSED_AT_COMPILE = {
    "empty-language": pb.Constraint(grammar="start: start"),
    "lone-backslash": pb.Constraint(regex="a\\"),
    "too-many-items": pb.Constraint(grammar='start: "a"{1000000}'),
    "20000-alternatives": pb.Constraint(grammar="start: " + " | ".join(f'"w{i}"' for i in range(20_000))),
    "deep-schema": pb.Constraint(json_schema='{"type": "array", "items": ' * 1500 + "{}" + "}" * 1500),
    "deep-json": pb.Constraint(json_schema="[" * 1200 + "]" * 1200),
}


def generate(stub, constraint: pb.Constraint, prompt: str = "Output:", max_new_tokens: int = 32) -> pb.GenerateResponse:
    request = pb.GenerateRequest(
        prompt=prompt, constraint=constraint,
        sampling=pb.SamplingParams(temperature=0.0), stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens),
    )
    return stub.Generate(request, timeout=60)


@pytest.mark.parametrize("name", REFUSED_AT_COMPILE)
def test_unenforceable_constraints_are_refused_before_any_token(stub, name):
    constraint = REFUSED_AT_COMPILE[name]
    kind = constraint.WhichOneof("kind")
    for call in (
        lambda: stub.CompileConstraint(pb.CompileConstraintRequest(constraint=constraint), timeout=60),
        lambda: generate(stub, constraint),
    ):
        error = rpc_error(call)
        assert error.code() == INVALID, error.details()
        assert f"constraint.{kind}" in bad_request_fields(error)


def test_a_huge_repetition_is_refused_or_fails_as_the_callers_constraint(stub):
    """`a{1000000}` may pass the first step; then it fails mid-stream, never as the engine's fault."""
    try:
        response = generate(stub, pb.Constraint(regex="a{1000000}"), max_new_tokens=64)
    except grpc.RpcError as error:
        assert error.code() == INVALID, error.details()
        assert error_reason(error) in ("INVALID_REQUEST", "CONSTRAINT_FAILED")
    else:  # it ran: it cannot have completed a million-character sentence in 64 tokens
        assert response.finish.reason != COMPLETE and not response.finish.constraint_satisfied
        assert set(response.text) <= {"a"}


def test_a_choice_with_odd_unicode_completes_exactly_or_is_refused(stub):
    choice = "_\U0004392e\uf3fd"
    try:
        response = generate(stub, pb.Constraint(choice=pb.Choices(values=[choice])))
    except grpc.RpcError as error:
        assert error.code() == INVALID, error.details()
    else:
        assert response.finish.reason == COMPLETE and response.finish.constraint_satisfied
        assert response.text == choice


@pytest.mark.parametrize("pattern", [r"^\p{L}+$", r"^[a-z]+\z"])
def test_non_strict_patterns_in_llguidance_dialect_are_post_validated(stub, pattern):
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": pattern, "maxLength": 12}},
              "required": ["name"], "additionalProperties": False, "not": {"required": ["x"]}}
    constraint = pb.Constraint(json_schema=json.dumps(schema), strict=False)
    response = generate(stub, constraint, prompt='A JSON object with a name: ', max_new_tokens=40)
    finish = response.finish
    assert finish.reason in (COMPLETE, pb.FinishReason.FINISH_REASON_MAX_TOKENS)
    if finish.reason == COMPLETE:
        assert finish.constraint_satisfied, finish.constraint_message
        assert json.loads(response.text)["name"]


def test_a_deeply_nested_json_object_output_is_reported_not_raised(model):
    from backend.constraints.validation import json_output_problem

    problem = json_output_problem(ConstraintSpec("json_object", "", strict=False), "[" * 5000 + "]" * 5000)
    assert "deeper" in problem


def test_post_validation_names_what_it_could_not_check(model):
    from backend.constraints.validation import json_output_problem

    spec = ConstraintSpec("json_schema", json.dumps({"type": "string", "pattern": "(?<a"}), strict=False)
    assert "could not be fully validated" in json_output_problem(spec, '"x"')
    spec = ConstraintSpec("json_schema", json.dumps({"$ref": "https://example.invalid/s.json"}), strict=False)
    assert "could not be fully validated" in json_output_problem(spec, '"x"')


# The schema from the report: feeding a 12-word value without computing masks exhausts
# llguidance's shared lexer budget, which every copy of the compiled matcher then inherits.
POISON_SCHEMA = json.dumps({
    "type": "object",
    "properties": {"text": {"type": "string", "pattern": r"^(?:\S+\s+){0,49}\S+$", "maxLength": 500}},
    "required": ["text"],
})
POISON_VALUE = json.dumps({"text": " ".join(f"word{i}" for i in range(12))}, separators=(",", ":"))


def test_a_failed_matcher_never_poisons_the_cached_constraint(model):
    compiler = ConstraintCompiler(model.constraint_tokenizer())
    spec = ConstraintSpec("json_schema", POISON_SCHEMA)
    tokens = model.tokenize(POISON_VALUE, add_special=False)
    first = compiler.compile(spec)
    state = ConstraintState(first)
    consumed = all(state.consume(token) for token in tokens)
    if consumed and state.satisfied:
        pytest.skip("this llguidance build no longer exhausts its lexer on the reported schema")
    assert state.failure(), "a rejected token leaves the matcher in error"
    assert compiler.cached(spec) is None, "the failed constraint must leave the cache"
    fresh = compiler.compile(spec)
    assert not fresh.cached and fresh.template is not first.template
    probe = ConstraintState(fresh)
    assert probe.consume(tokens[0]) and not probe.failure()


def test_an_errored_matcher_is_neither_complete_nor_satisfied(model):
    compiler = ConstraintCompiler(model.constraint_tokenizer())
    state = ConstraintState(compiler.compile(ConstraintSpec("regex", "[0-9]{3}")))
    letter = model.tokenize("x", add_special=False)[0]
    assert not state.consume(letter)
    assert state.matcher.is_stopped(), "llguidance reports an errored matcher as stopped"
    assert not state.complete and not state.satisfied
    assert state.failure()


def test_compile_errors_name_the_constraint_field(model):
    compiler = ConstraintCompiler(model.constraint_tokenizer())
    with pytest.raises(ConstraintError) as raised:
        compiler.compile(ConstraintSpec("grammar", "start: start"))
    assert raised.value.kind == "grammar"
