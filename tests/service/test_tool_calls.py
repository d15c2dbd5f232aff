"""Tool calls and reasoning on the real server and the embedded model (SmolLM2, whose ChatML template
knows no tools, so the fallback prompt and the hermes format run here)."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from tests.harness.helpers import bad_request_fields, rpc_error, stream
from tests.harness.servers import REPORT, SERVER_CONTEXT_LENGTH, start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [
    pb.Tool(name="get_weather", description="The current weather in a city.", parameters=json.dumps(WEATHER)),
    pb.Tool(name="add", description="Adds two integers.", parameters=json.dumps(ADD)),
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
RUNS = 20


def tool_request(messages: list[pb.ChatMessage], choice: pb.ToolChoice, seed: int, max_new_tokens: int = 96):
    return pb.GenerateStreamRequest(
        chat=pb.Chat(messages=messages, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False),
        sampling=pb.SamplingParams(temperature=0.8, seed=seed),
        stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens),
    )


def assembled(messages: list[pb.GenerateStreamResponse]) -> list[tuple[str, str, str]]:
    """The calls as a client assembles them from the deltas."""
    calls: dict[int, list[str]] = {}
    for message in messages:
        for delta in message.tool_call_deltas:
            call = calls.setdefault(delta.index, [delta.id, delta.name, ""])
            call[2] += delta.arguments_delta
    return [tuple(calls[i]) for i in sorted(calls)]


def round_trip(stub, choice: pb.ToolChoice, seed: int, must_call: str | None) -> None:
    user = pb.ChatMessage(role="user", content="What is the weather in Paris, and what is 2 + 3?")
    messages = stream(stub, tool_request([user], choice, seed))
    finish = messages[-1].finish
    calls = [call for message in messages for call in message.tool_calls]
    assert finish.reason == pb.FINISH_REASON_TOOL_CALLS, (seed, finish, messages)
    assert len(calls) == 1
    call = calls[0]
    assert call.name in SCHEMAS and (must_call is None or call.name == must_call)
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert assembled(messages) == [(call.id, call.name, call.arguments)]
    assert "<tool_call>" not in "".join(m.text for m in messages)
    # The result goes back, and the model answers in text.
    history = [user, pb.ChatMessage(role="assistant", tool_calls=[call]),
               pb.ChatMessage(role="tool", tool_call_id=call.id, content=json.dumps({"result": "sunny, 21"}))]
    answer = stream(stub, tool_request(history, pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE), seed, 32))
    assert answer[-1].finish.reason in (pb.FINISH_REASON_EOS_TOKEN, pb.FINISH_REASON_MAX_TOKENS)
    assert not any(m.tool_calls or m.tool_call_deltas for m in answer)
    assert "".join(m.text for m in answer).strip()


def test_required_tool_calls_parse_validate_and_round_trip_in_every_seeded_run(stub) -> None:
    for seed in range(RUNS):
        round_trip(stub, pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED), seed, None)
    REPORT.append(f"tool calls: required, {RUNS}/{RUNS} seeded runs parsed, validated and round-tripped")


def test_named_tool_calls_parse_validate_and_round_trip_in_every_seeded_run(stub) -> None:
    for seed in range(RUNS):
        round_trip(stub, pb.ToolChoice(name="add"), seed, "add")
    REPORT.append(f"tool calls: named, {RUNS}/{RUNS} seeded runs parsed, validated and round-tripped")


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def weather_call(parallel: bool | None, sampling: pb.SamplingParams) -> pb.GenerateRequest:
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="What is the weather in Paris?")],
                   tools=[pb.Tool(name="get_weather", description="The current weather in a city.", parameters=json.dumps(CITY))],
                   tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED), parallel_tool_calls=parallel)
    return pb.GenerateRequest(chat=chat, sampling=sampling, stopping=pb.StoppingCriteria(max_new_tokens=64))


def test_calls_hold_their_grammar_when_speculation_proposes_past_answers(tmp_path, model_path) -> None:
    """Parallel calls end with the end-of-generation token. Proposed again from the caller's past sequences
    to a call that cannot go on, llguidance took it without counting it, and checking the proposal rolled a
    real token back off the grammar: the key came out twice ({"citycity":"Paris"}, {"city":"":"Paris"}).
    A fresh server, so the past pool holds exactly this sequence's answers."""
    server = start_server(tmp_path, "--context-length", str(SERVER_CONTEXT_LENGTH), "--max-batch-size", "8")
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            requests = [weather_call(None, pb.SamplingParams(seed=seed)) for seed in range(6)]
            requests += [weather_call(False, pb.SamplingParams(temperature=0.0))] * 4
            for i, request in enumerate(requests):
                response = stub.Generate(request, timeout=120)
                finish = response.finish.reason
                # 64 tokens may cut a parallel call short: the whole calls before it must still comply.
                assert finish == pb.FINISH_REASON_TOOL_CALLS or (i < 6 and finish == pb.FINISH_REASON_MAX_TOKENS), (i, response)
                assert response.tool_calls and (i < 6 or len(response.tool_calls) == 1), (i, response)
                for call in response.tool_calls:
                    arguments = json.loads(call.arguments)
                    assert call.name == "get_weather" and set(arguments) == {"city"}, (i, call)
                    jsonschema.validate(arguments, CITY)
    finally:
        assert stop_server(server) == 0, server.log()


def test_auto_lets_the_model_answer_in_text_or_call(stub) -> None:
    user = pb.ChatMessage(role="user", content="Say hello.")
    messages = stream(stub, tool_request([user], pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_AUTO), 3, 48))
    calls = [call for message in messages for call in message.tool_calls]
    for call in calls:  # a call, once started, was enforced
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert "<tool_call>" not in "".join(m.text for m in messages) or messages[-1].finish.reason == pb.FINISH_REASON_MAX_TOKENS


def test_a_json_constraint_with_reasoning_on_applies_only_after_the_end_marker(stub) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    for seed in range(5):
        request = pb.GenerateStreamRequest(
            chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="What is 2 + 3? Think, then answer in JSON.")],
                         reasoning=pb.Reasoning(mode=pb.REASONING_MODE_ON, budget_tokens=24)),
            constraint=pb.Constraint(json_schema=json.dumps(schema)),
            sampling=pb.SamplingParams(temperature=0.8, seed=seed),
            stopping=pb.StoppingCriteria(max_new_tokens=96),
        )
        messages = stream(stub, request)
        reasoning = "".join(m.reasoning for m in messages)
        text = "".join(m.text for m in messages)
        finish = messages[-1].finish
        assert reasoning.strip(), "the grammar opened the reasoning"
        assert "</think>" not in reasoning and "<think>" not in text
        jsonschema.validate(json.loads(text), schema)
        assert finish.constraint_satisfied
        # The budget forced the end marker: the reasoning took at most 24 tokens plus its markers.
        assert 0 < finish.usage.reasoning_tokens <= 24 + 8


def test_model_info_names_the_formats(stub) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.tool_call_format, info.template_renders_tools, info.reasoning_format) == ("hermes", False, "think")


def bad(stub, chat: pb.Chat, **fields) -> dict[str, str]:
    request = pb.GenerateRequest(chat=chat, stopping=pb.StoppingCriteria(max_new_tokens=4), **fields)
    error = rpc_error(lambda: stub.Generate(request))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    return bad_request_fields(error)


USER = pb.ChatMessage(role="user", content="hi")


def calling(name: str, arguments: str) -> pb.ChatMessage:
    return pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c1", name=name, arguments=arguments)])


@pytest.mark.parametrize(
    ("chat", "field"),
    [
        (pb.Chat(messages=[USER], tools=[TOOLS[0], TOOLS[0]]), "chat.tools[1].name"),
        (pb.Chat(messages=[USER], tools=[pb.Tool(name="bad name")]), "chat.tools[0].name"),
        (pb.Chat(messages=[USER], tools=[pb.Tool(name="t", parameters="{not json")]), "chat.tools[0].parameters"),
        (pb.Chat(messages=[USER], tools=[pb.Tool(name="t", parameters="[" * 200 + "]" * 200)]), "chat.tools[0].parameters"),
        (pb.Chat(messages=[USER], tools=TOOLS, tool_choice=pb.ToolChoice(name="nope")), "chat.tool_choice.name"),
        (pb.Chat(messages=[USER], tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)), "chat.tool_choice"),
        (pb.Chat(messages=[USER, calling("rm", "{}")], tools=TOOLS), "chat.messages[1].tool_calls[0].name"),
        (pb.Chat(messages=[USER, calling("add", "[1]")], tools=TOOLS), "chat.messages[1].tool_calls[0].arguments"),
        (pb.Chat(messages=[USER, pb.ChatMessage(role="tool", tool_call_id="c9", content="42")], tools=TOOLS),
         "chat.messages[1].tool_call_id"),
        (pb.Chat(messages=[USER], reasoning=pb.Reasoning(mode=pb.REASONING_MODE_OFF, budget_tokens=5)),
         "chat.reasoning.budget_tokens"),
    ],
)
def test_bad_tools_and_history_are_invalid_argument_naming_the_field(stub, chat: pb.Chat, field: str) -> None:
    assert field in bad(stub, chat)


def test_a_schema_llguidance_cannot_enforce_names_the_tool(stub) -> None:
    unenforceable = json.dumps({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)a"}}})
    chat = pb.Chat(messages=[USER], tools=[TOOLS[1], pb.Tool(name="t", parameters=unenforceable)])
    assert "chat.tools[1].parameters" in bad(stub, chat)


def test_a_constraint_cannot_be_combined_with_tool_calls(stub) -> None:
    chat = pb.Chat(messages=[USER], tools=TOOLS)
    assert "constraint" in bad(stub, chat, constraint=pb.Constraint(json_object=True))


def test_a_bad_constraint_with_reasoning_on_names_the_constraint(stub) -> None:
    chat = pb.Chat(messages=[USER], reasoning=pb.Reasoning(mode=pb.REASONING_MODE_ON))
    fields = bad(stub, chat, constraint=pb.Constraint(json_schema=json.dumps({"type": "string", "pattern": "(?<=x)a"})))
    assert "constraint.json_schema" in fields


@pytest.mark.parametrize("budget", [16, 64])
def test_the_reasoning_budget_counts_the_thinking_and_usage_adds_the_markers(stub, budget) -> None:
    """docs/api.md: `budget_tokens` bounds the tokens between `<think>` and `</think>`; `usage.reasoning_tokens`
    counts those and the markers' own (a budget of 64 reports 70 on the embedded model, whose markers are 3
    tokens each). Greedy, so the model is still thinking when either budget runs out."""
    markers = stub.Tokenize(pb.TokenizeRequest(texts=["<think>", "</think>"], add_special_tokens=False)).results
    marker_tokens = sum(result.count for result in markers)
    request = pb.GenerateStreamRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="What is 2 + 3? Answer in JSON.")],
                     reasoning=pb.Reasoning(mode=pb.REASONING_MODE_ON, budget_tokens=budget)),
        constraint=pb.Constraint(json_schema='{"type": "object", "properties": {"answer": {"type": "integer"}}, '
                                            '"required": ["answer"], "additionalProperties": false}'),
        sampling=pb.SamplingParams(temperature=0), stopping=pb.StoppingCriteria(max_new_tokens=128),
        output=pb.OutputOptions(return_token_ids=True),
    )
    messages = stream(stub, request)
    pieces = [token.text for message in messages for token in message.tokens]
    starts = [sum(len(piece) for piece in pieces[:i]) for i in range(len(pieces))]
    text = "".join(pieces)
    assert text.startswith("<think>") and "</think>" in text, text
    # The tokens that start after the opener and before the end marker: the thinking.
    thinking = [s for s in starts if len("<think>") <= s < text.index("</think>")]
    assert text.index("</think>") in starts, "the end marker starts a token of its own"
    assert len(thinking) == budget
    assert messages[-1].finish.usage.reasoning_tokens == budget + marker_tokens == budget + 6
