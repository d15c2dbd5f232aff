"""Streaming assembly on the fake engine: each family's markup, one byte per token and so one message per
byte, comes out typed (reasoning, deltas, calls) and never in text; malformed markup comes back as text."""

from __future__ import annotations

import itertools
import json

import grpc
import pytest

from tests.harness.inprocess_server import start_fake
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

TOOLS = [pb.Tool(name="get_weather", parameters=json.dumps({"type": "object"})), pb.Tool(name="add")]
_ids = itertools.count()


def scripted(server, stub, output: str, **chat) -> list[pb.GenerateStreamResponse]:
    """Streams a chat whose reply is exactly `output`, then EOS."""
    prefix = f"scripted-{next(_ids)}"
    server.engine.plan(prefix, output=output.encode(), eos_after=len(output.encode()) + 1)
    request = pb.GenerateStreamRequest(
        request_id=prefix,
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="go")], **({"tools": TOOLS} | chat)),
        stopping=pb.StoppingCriteria(max_new_tokens=len(output.encode()) + 8),
        output=pb.OutputOptions(max_tokens_per_message=1),
    )
    return list(stub.GenerateStream(request, timeout=30))


@pytest.fixture(scope="module", params=["hermes", "mistral", "llama3_json"])
def family(request):
    server = start_fake("--tool-call-format", request.param)
    with grpc.insecure_channel(server.address) as channel:
        yield request.param, server, pb_grpc.GenerationServiceStub(channel)
    server.close()


# Compact JSON, as the auto grammar (which the fake engine enforces too) has the model write it.
CALLS = {
    "hermes": '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>',
    "mistral": '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Paris"}},{"name":"add","arguments":{"a":1,"b":2}}]',
    "llama3_json": '{"name":"get_weather","parameters":{"city":"Paris"}}; '
                   '<|python_tag|>{"name":"add","parameters":{"a":1,"b":2}}',
}


def test_calls_stream_typed_one_byte_per_message(family) -> None:
    name, server, stub = family
    messages = scripted(server, stub, "<think>plan it</think>" + CALLS[name])
    assert "".join(m.reasoning for m in messages) == "plan it"
    calls = [(c.name, c.arguments) for m in messages for c in m.tool_calls]
    assert calls == [("get_weather", '{"city":"Paris"}'), ("add", '{"a":1,"b":2}')]
    streamed: dict[int, str] = {}
    for message in messages:
        for delta in message.tool_call_deltas:
            streamed[delta.index] = streamed.get(delta.index, "") + delta.arguments_delta
    assert [streamed[0], streamed[1]] == [a for _, a in calls]
    assert len({c.id for m in messages for c in m.tool_calls}) == 2
    assert len(messages) >= len(CALLS[name]), "one message per token"
    assert all(m.text.strip(" ;") == "" for m in messages), "no markup in text"
    finish = messages[-1].finish
    assert finish.reason == pb.FINISH_REASON_TOOL_CALLS
    assert finish.usage.reasoning_tokens == len("<think>plan it</think>")


def test_a_call_cut_off_by_max_new_tokens_comes_back_as_text(family) -> None:
    """The grammar keeps a started call well-formed, so a cut is what leaves one unfinished."""
    name, server, stub = family
    prefix = f"cut-{next(_ids)}"
    server.engine.plan(prefix, output=CALLS[name].encode())
    cut = 30
    request = pb.GenerateStreamRequest(
        request_id=prefix, chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="go")], tools=TOOLS),
        stopping=pb.StoppingCriteria(max_new_tokens=cut))
    messages = list(stub.GenerateStream(request, timeout=30))
    assert "".join(m.text for m in messages) == CALLS[name][:cut]
    assert not any(m.tool_calls for m in messages)
    assert messages[-1].finish.reason == pb.FINISH_REASON_MAX_TOKENS


def test_tool_choice_none_leaves_markup_as_text(family) -> None:
    name, server, stub = family
    messages = scripted(server, stub, CALLS[name], tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE))
    assert "".join(m.text for m in messages) == CALLS[name]
    assert not any(m.tool_calls or m.tool_call_deltas for m in messages)


def test_unary_response_holds_the_whole_calls(family) -> None:
    name, server, stub = family
    prefix = f"unary-{next(_ids)}"
    output = ("<think>x</think>" + CALLS[name]).encode()
    server.engine.plan(prefix, output=output, eos_after=len(output) + 1)
    response = stub.Generate(pb.GenerateRequest(
        request_id=prefix, chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="go")], tools=TOOLS),
        stopping=pb.StoppingCriteria(max_new_tokens=len(output) + 8)), timeout=30)
    assert response.reasoning == "x"
    assert [c.name for c in response.tool_calls] == ["get_weather", "add"]
    assert response.finish.reason == pb.FINISH_REASON_TOOL_CALLS
