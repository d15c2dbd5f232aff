"""The tools-and-reasoning grammar, checked token by token with llguidance over the fake engine's byte vocabulary."""

from __future__ import annotations

import json

import llguidance
import pytest

from backend.constraints import ConstraintCompiler, ConstraintSpec
from backend.constraints.compiler import to_grammar
from backend.constraints.tokenizer import build_tokenizer
from backend.tools import THINK
from backend.tools.formats import HERMES, LLAMA3_JSON, MISTRAL, ToolFormat
from backend.tools.grammar import GrammarBuilder, ReasoningRule, ToolSchema
from tests.harness.fake_engine import BOS, EOS_TOKEN_IDS, SPECIALS, VOCAB_SIZE, encode, piece

TOOLS = [
    ToolSchema("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
    ToolSchema("add", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
]
BUILDER = GrammarBuilder(lambda marker: False)


@pytest.fixture(scope="module")
def compiler() -> ConstraintCompiler:
    pieces = [SPECIALS.get(t) or piece(t) for t in range(VOCAB_SIZE)]
    return ConstraintCompiler(build_tokenizer(pieces, list(SPECIALS), EOS_TOKEN_IDS, BOS, encode))


def run(compiler: ConstraintCompiler, grammar: str, text: str) -> llguidance.LLMatcher:
    """A matcher fed `text` byte by byte; it stops (in error) at the first byte the grammar refuses."""
    matcher = compiler.compile(ConstraintSpec("composed", grammar)).new_matcher()
    for token in encode(text.encode()):
        if not matcher.consume_token(token):
            break
    return matcher


def accepts(compiler, grammar: str, text: str) -> bool:
    matcher = run(compiler, grammar, text)
    return not matcher.is_error() and matcher.is_accepting()


def call(fmt: ToolFormat, name: str, arguments: str) -> str:
    body = f'{{"name":"{name}","{fmt.arguments_key}":{arguments}}}'
    if fmt.array:
        return f"{fmt.start}[{body}]"
    return f"{fmt.start}\n{body}\n{fmt.end}" if fmt.end else f"{fmt.start}{body}"


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL, LLAMA3_JSON], ids=lambda f: f.name)
def test_required_forces_a_known_tool_with_matching_arguments(compiler, fmt) -> None:
    grammar = BUILDER.compose(None, BUILDER.tool_answer(fmt, TOOLS, forced=True, parallel=False))
    assert accepts(compiler, grammar, call(fmt, "add", '{"a":1}'))
    assert not accepts(compiler, grammar, "Sure! " + call(fmt, "add", '{"a":1}'))  # no text before the call
    assert not accepts(compiler, grammar, call(fmt, "rm", "{}"))
    assert not accepts(compiler, grammar, call(fmt, "add", '{"a":"one"}'))
    assert not accepts(compiler, grammar, call(fmt, "add", '{"a":1,"extra":2}'))  # only the schema's properties


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL, LLAMA3_JSON], ids=lambda f: f.name)
def test_auto_allows_text_and_enforces_a_call_once_started(compiler, fmt) -> None:
    grammar = BUILDER.compose(None, BUILDER.tool_answer(fmt, TOOLS, forced=False, parallel=True))
    assert accepts(compiler, grammar, "Just text, no call.")
    assert accepts(compiler, grammar, "Let me check. " + call(fmt, "get_weather", '{"city":"Oslo"}'))
    assert not accepts(compiler, grammar, "Let me check. " + call(fmt, "get_weather", '{"town":"Oslo"}'))


def test_a_named_tool_is_the_only_one_allowed(compiler) -> None:
    grammar = BUILDER.compose(None, BUILDER.tool_answer(HERMES, TOOLS[1:], forced=True, parallel=False))
    assert accepts(compiler, grammar, call(HERMES, "add", '{"a":1}'))
    assert not accepts(compiler, grammar, call(HERMES, "get_weather", '{"city":"x"}'))


def test_a_constraint_applies_after_the_reasoning_only(compiler) -> None:
    schema = json.dumps({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})
    answer, subs = BUILDER.constraint_answer(to_grammar(ConstraintSpec("json_schema", schema)))
    grammar = BUILDER.compose(ReasoningRule(THINK, opened=False), answer, subs)
    assert accepts(compiler, grammar, '<think>not {json} at all</think>\n{"x":5}')
    assert not accepts(compiler, grammar, '<think>fine</think>\n{"y":5}')
    assert not accepts(compiler, grammar, '{"x":5}')  # reasoning on: the block comes first
    opened = BUILDER.compose(ReasoningRule(THINK, opened=True), answer, subs)
    assert accepts(compiler, opened, 'the template opened it</think>{"x":5}')


def test_the_budget_forces_the_end_marker(compiler) -> None:
    grammar = BUILDER.compose(ReasoningRule(THINK, opened=False, budget_tokens=5), BUILDER.free_answer())
    matcher = run(compiler, grammar, "<think>abcde")  # one token per byte: the budget is spent
    forced = bytes(b for token in matcher.compute_ff_tokens() for b in piece(token))
    assert forced.startswith(b"</think>")
    roomy = BUILDER.compose(ReasoningRule(THINK, opened=False, budget_tokens=12), BUILDER.free_answer())
    assert accepts(compiler, roomy, "<think>ab</think>done")  # ending within the budget is fine
