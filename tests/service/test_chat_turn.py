"""A chat's turn (service.chat.ChatTurn) on its own: made by the checks, completed by the prompt, then asked for
its constraint (compiled by the real constraint engine, the fake engine's llguidance) and its output parser.
The whole path on a server is tests/service/test_tool_calls.py and test_tool_stream.py."""

from __future__ import annotations

import json

import grpc
import pytest

from backend import TokenEvent
from service.chat import ChatFormats, ChatTurn
from service.compiles import CompileGate
from service.errors import ServiceError
from service.limits import Limits
from service.validate import RequestValidator
from tests.harness.fake_engine import FakeEngine
from tokenspout.v1 import generation_pb2 as pb

USER = pb.ChatMessage(role="user", content="go")
WEATHER = pb.Tool(name="get_weather", parameters=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}))
JSON = pb.Constraint(json_schema=json.dumps({"type": "object"}))
OPENED = b"<|im_start|>assistant\n<think>\n"
"""A prompt's last bytes when its template opened the reasoning for the model."""


@pytest.fixture(scope="module")
def engine():
    engine = FakeEngine()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def validator(engine):
    return RequestValidator(engine.info)


def turn(validator, chat: pb.Chat, constraint: pb.Constraint | None = None) -> ChatTurn:
    """The turn a GenerateStream request of this chat is checked into."""
    request = pb.GenerateStreamRequest(chat=chat)
    if constraint is not None:
        request.constraint.CopyFrom(constraint)
    params = validator.params(request)
    assert params.chat is not None
    return params.chat


def parsed(chat: ChatTurn, text: str) -> pb.GenerateStreamResponse:
    """One sample's whole output, in one message that ends its turn, through the turn's parser."""
    make = chat.output_parser()
    assert make is not None
    message = pb.GenerateStreamResponse(text=text, finish=pb.Finish(reason=pb.FINISH_REASON_EOS_TOKEN))
    make().rewrite(message, [TokenEvent((), text, len(text))])
    return message


def test_the_checks_make_the_turn_and_the_prompt_completes_it(validator) -> None:
    checked = turn(validator, pb.Chat(messages=[USER], tools=[WEATHER]))
    assert checked.formats == validator.formats
    assert [tool.name for tool in checked.plan.tools] == ["get_weather"] and checked.plan.choice == "auto"
    assert checked.reasoning_opened is None, "unknown until the prompt is rendered"
    opened = checked.prompted(OPENED)
    assert opened.reasoning_opened is True and opened.plan is checked.plan
    assert checked.reasoning_opened is None, "a value: the prompt's fact comes back as a new turn"
    assert checked.prompted(b"<|im_start|>assistant\n").reasoning_opened is False


async def test_constraint_and_parser_need_the_prompt_first(validator, engine) -> None:
    checked = turn(validator, pb.Chat(messages=[USER]))
    with pytest.raises(AssertionError, match="prompt comes first"):
        await checked.constraint(CompileGate(engine, 10.0))
    with pytest.raises(AssertionError, match="prompt comes first"):
        checked.output_parser()


async def test_a_plain_chat_generates_under_the_callers_constraint_as_is(validator, engine) -> None:
    chat = turn(validator, pb.Chat(messages=[USER]), JSON).prompted(b"assistant\n")
    spec = await chat.constraint(CompileGate(engine, 10.0))
    assert spec == chat.caller_constraint and spec is not None and spec.kind == "json_schema"
    assert await turn(validator, pb.Chat(messages=[USER])).prompted(b"").constraint(CompileGate(engine, 10.0)) is None


async def test_tools_make_one_grammar_and_their_calls_are_parsed(validator, engine) -> None:
    chat = turn(validator, pb.Chat(messages=[USER], tools=[WEATHER])).prompted(b"assistant\n")
    spec = await chat.constraint(CompileGate(engine, 10.0))
    assert spec is not None and spec.kind == "composed"
    message = parsed(chat, '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>')
    assert [(c.name, c.arguments) for c in message.tool_calls] == [("get_weather", '{"city":"Paris"}')]
    assert message.text == "" and message.finish.reason == pb.FINISH_REASON_TOOL_CALLS


async def test_reasoning_the_template_opened_is_enforced_and_parsed_unless_turned_off(validator, engine) -> None:
    chat = turn(validator, pb.Chat(messages=[USER])).prompted(OPENED)
    spec = await chat.constraint(CompileGate(engine, 10.0))
    assert spec is not None and spec.kind == "composed", "the grammar closes the opened block"
    message = parsed(chat, "plan it</think>The answer.")
    assert (message.reasoning, message.text) == ("plan it", "The answer.")
    off = turn(validator, pb.Chat(messages=[USER], reasoning=pb.Reasoning(mode=pb.REASONING_MODE_OFF))).prompted(OPENED)
    assert await off.constraint(CompileGate(engine, 10.0)) is None
    message = parsed(off, "plan it</think>The answer.")
    assert message.text == "plan it</think>The answer." and message.reasoning == ""


async def test_a_tool_schema_the_engine_cannot_enforce_is_named_by_its_field(validator, engine) -> None:
    unique = pb.Tool(name="tag", parameters=json.dumps(
        {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}))
    chat = turn(validator, pb.Chat(messages=[USER], tools=[WEATHER, unique])).prompted(b"")
    with pytest.raises(ServiceError) as refused:
        await chat.constraint(CompileGate(engine, 10.0))
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in refused.value.violations] == ["chat.tools[1].parameters"]


def test_calls_and_a_callers_constraint_are_refused_together(validator) -> None:
    request = pb.GenerateStreamRequest(chat=pb.Chat(messages=[USER], tools=[WEATHER]), constraint=JSON)
    with pytest.raises(ServiceError) as refused:
        validator.params(request)
    assert [v.field for v in refused.value.violations] == ["constraint"]


def test_one_limit_bounds_a_chats_schemas_for_generation_and_tokenize(engine) -> None:
    """A tool's schema is bounded as a constraint is (Limits.max_constraint_chars), for Generate and Tokenize alike."""
    validator = RequestValidator(engine.info, Limits(max_constraint_chars=40))
    chat = pb.Chat(messages=[USER], tools=[WEATHER])  # its schema is longer than 40 characters
    refusals = []
    for check in (lambda: validator.params(pb.GenerateStreamRequest(chat=chat)),
                  lambda: validator.check_tokenize(pb.TokenizeRequest(chat=chat))):
        with pytest.raises(ServiceError) as refused:
            check()
        refusals.append([(v.field, v.description) for v in refused.value.violations])
    assert refusals[0] == refusals[1] == [("chat.tools", f"{len(WEATHER.parameters)} characters of schemas; at most 40 together")]
    assert RequestValidator(engine.info).check_tokenize(pb.TokenizeRequest(chat=chat)) is not None


def test_the_formats_default_to_the_models_own(engine) -> None:
    """"auto" is resolved in one place (ChatFormats.resolve); a validator given no formats takes it."""
    assert RequestValidator(engine.info).formats == ChatFormats.resolve(engine.info, "auto", "auto")
    assert ChatFormats.resolve(engine.info, "none", "none") == ChatFormats(None, False, None)
