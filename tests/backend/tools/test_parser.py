"""The streaming parser: every family's calls and reasoning, split at every boundary, come out the same."""

from __future__ import annotations

import itertools
import json

import pytest

from backend.tools import THINK, OutputParser
from backend.tools.formats import HERMES, LLAMA3_JSON, MISTRAL, ToolFormat

NAMES = frozenset({"get_weather", "add"})


def parse(fmt: ToolFormat | None, pieces: list[str], in_reasoning: bool = False, reasoning: bool = True) -> dict:
    ids = itertools.count()
    parser = OutputParser(fmt, THINK if reasoning else None, NAMES, in_reasoning, call_id=lambda: f"call_{next(ids)}")
    outs = [parser.push(piece) for piece in pieces] + [parser.finish()]
    arguments: dict[int, str] = {}
    names: dict[int, str] = {}
    for out in outs:
        for delta in out.deltas:
            arguments[delta.index] = arguments.get(delta.index, "") + delta.arguments
            if delta.name:
                assert delta.index not in names, "a call's name comes once"
                names[delta.index] = delta.name
    calls = [call for out in outs for call in out.calls]
    return {
        "text": "".join(out.text for out in outs),
        "reasoning": "".join(out.reasoning for out in outs),
        "calls": [(c.id, c.name, c.arguments) for c in calls],
        "streamed": [(names.get(i), arguments.get(i)) for i in range(len(calls))],
    }


def splits(text: str) -> list[list[str]]:
    """The text whole, cut once at every boundary, and one character at a time."""
    return [[text]] + [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]


CASES = [
    (
        HERMES,
        'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>\n'
        '<tool_call>{"arguments": {"a": 1, "b": "}"}, "name": "add"}</tool_call>',
        "Let me look.",
        [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("add", '{"a": 1, "b": "}"}')],
    ),
    (
        MISTRAL,
        'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]',
        "Sure. ",
        [("add", '{"a": 1}'), ("get_weather", '{"city": "Oslo"}')],
    ),
    (LLAMA3_JSON, '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [("add", '{"a": 1, "b": 2}')]),
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Lima"}}', "", [("get_weather", '{"city": "Lima"}')]),
]


@pytest.mark.parametrize(("fmt", "output", "text", "calls"), CASES, ids=[c[0].name + str(i) for i, c in enumerate(CASES)])
def test_calls_come_out_the_same_however_the_output_is_cut(fmt, output, text, calls) -> None:
    for pieces in splits(output):
        result = parse(fmt, pieces)
        assert result["text"] == text, pieces
        assert [(name, args) for _, name, args in result["calls"]] == calls, pieces
        assert result["streamed"] == calls, "the deltas joined are the calls"
        assert [call_id for call_id, _, _ in result["calls"]] == [f"call_{i}" for i in range(len(calls))]
        for _, _, arguments in result["calls"]:
            json.loads(arguments)


def test_reasoning_is_apart_from_text_and_calls_however_cut() -> None:
    output = '<think>The user wants <b>weather</b>.</think>\n\nChecking.<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    for pieces in splits(output):
        result = parse(HERMES, pieces)
        assert result["reasoning"] == "The user wants <b>weather</b>."
        assert result["text"] == "Checking."
        assert result["calls"] == [("call_0", "add", "{}")]


def test_reasoning_opened_by_the_prompt_ends_at_the_end_marker() -> None:
    for pieces in splits("step one</think>answer"):
        assert parse(None, pieces, in_reasoning=True)[("reasoning")] == "step one"
        assert parse(None, pieces, in_reasoning=True)["text"] == "answer"


def test_unfinished_reasoning_stays_reasoning() -> None:
    result = parse(None, ["<think>still thinking</thi"])
    assert result == {"text": "", "reasoning": "still thinking</thi", "calls": [], "streamed": []}


@pytest.mark.parametrize(
    "output",
    [
        "<tool_call>hello</tool_call> and more",  # not JSON
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # no such tool
        '<tool_call>{"name": "add", "arguments": {"a": 1}} trailing</tool_call>',  # no end marker after the object
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "add", "arguments": {"a": 1}',  # cut off
        "a < b and <tool_ca",  # a marker's prefix at the end
        '{"answer": 42}',  # a JSON answer is no Hermes call
    ],
)
def test_malformed_markup_stays_text_never_a_half_call(output: str) -> None:
    for pieces in splits(output):
        result = parse(HERMES, pieces, reasoning=False)
        assert result["text"] == output, pieces
        assert result["calls"] == []


def test_bare_json_is_a_call_only_at_the_turns_start() -> None:
    output = 'The JSON is {"name": "add", "parameters": {}}'
    assert parse(LLAMA3_JSON, [output])["calls"] == []
    assert parse(LLAMA3_JSON, ['{"answer": 1}'])["text"] == '{"answer": 1}'


def test_without_a_format_markup_is_plain_text() -> None:
    output = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    assert parse(None, [output], reasoning=False)["text"] == output


def test_arguments_stream_as_they_form() -> None:
    ids = itertools.count()
    parser = OutputParser(HERMES, None, NAMES, call_id=lambda: f"c{next(ids)}")
    first = parser.push('<tool_call>{"name": "get_weather", "arguments": {"city": "Par')
    assert [(d.id, d.name) for d in first.deltas][0] == ("c0", "get_weather")
    assert "".join(d.arguments for d in first.deltas) == '{"city": "Par'
    assert first.calls == []
    rest = parser.push('is"}}</tool_call>')
    assert "".join(d.arguments for d in rest.deltas) == 'is"}'
    assert [c.arguments for c in rest.calls] == ['{"city": "Paris"}']
