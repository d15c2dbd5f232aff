"""The Python client's tool helpers on the real server: typed tools in, calls assembled from the stream
(sync and asyncio), and the result sent back with Message.tool_result."""

from __future__ import annotations

import asyncio

import pydantic
import pytest

from tokenspout import AsyncClient, Client, Message, Tool, assemble_tool_calls


class Weather(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=40)
    unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")


TOOLS = [Tool("get_weather", "The current weather in a city.", Weather)]
ASK = [Message("user", "What is the weather in Paris?")]


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address) as running:
        yield running


def test_a_streamed_call_assembles_and_round_trips(client) -> None:
    with client.stream(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                       max_new_tokens=80, seed=5) as stream:
        chunks = list(stream)
        generation = stream.result()
    assert generation.finish.reason == "tool_calls"
    (call,) = generation.tool_calls
    assert stream.tool_calls == assemble_tool_calls(chunks) == [call]
    Weather.model_validate_json(call.arguments)
    answer = client.generate(
        messages=[*ASK, Message("assistant", tool_calls=[call]), Message.tool_result(call, {"sky": "clear", "c": 21})],
        tools=TOOLS, tool_choice="none", max_new_tokens=24, seed=5,
    )
    assert answer.text.strip() and not answer.tool_calls


def test_the_async_client_assembles_calls_too(server) -> None:
    async def run():
        async with AsyncClient(server.address) as client:
            stream = client.stream(messages=ASK, tools=TOOLS, tool_choice="get_weather", max_new_tokens=80, seed=6)
            async for _ in stream:
                pass
            return stream.tool_calls, (await stream.result()).tool_calls

    assembled, whole = asyncio.run(run())
    assert assembled == whole and whole and {c.name for c in whole} == {"get_weather"}  # parallel calls allowed
    for call in whole:
        Weather.model_validate_json(call.arguments)
