"""The asyncio client (tokenspout.AsyncClient) against the real server."""

from __future__ import annotations

import asyncio
import inspect
import uuid

import pydantic
import pytest

import tokenspout
from tokenspout import AsyncClient, Client, Sampling, Stopping


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false

    name: str
    country: str


def test_the_asyncio_client_takes_the_same_arguments_as_the_sync_one():
    """Both build their requests in tokenspout.base.BaseClient; their own methods (the transports) must stay twins."""

    def methods(cls: type) -> dict[str, list[inspect.Parameter]]:
        return {name: list(inspect.signature(value).parameters.values())
                for name, value in vars(cls).items() if callable(value) and not name.startswith("_")}

    assert methods(Client) == methods(AsyncClient)
    assert set(methods(Client)) == {"stream", "generate", "tokenize", "model_info", "compile", "cancel", "status", "close"}


async def test_every_rpc(server):
    async with AsyncClient(server.address, timeout=120) as client:
        info = await client.model_info()
        assert info.engine == "llama.cpp" and info.limits.max_batch_size == 8
        assert (await client.status()).max_batch_size == 8
        tokens = await client.tokenize("Hello world")
        assert tokens.count == len(tokens.token_ids) >= 2
        assert (await client.compile(choices=["yes", "no"])).warnings == []
        generation = await client.generate("The capital of France is", max_new_tokens=6, temperature=0)
        async with client.stream("The capital of France is", max_new_tokens=6, temperature=0) as stream:
            chunks = [chunk async for chunk in stream]
        assert stream.text == generation.text and chunks[-1].finish == stream.finish
        assert (await client.cancel(["gone"])).not_found == ["gone"]


async def test_json_schema_stream_through_a_pydantic_model(server):
    async with AsyncClient(server.address, timeout=120) as client:
        stream = client.stream(
            messages=[{"role": "user", "content": "Name a city and its country as JSON."}],
            json_schema=City, temperature=0, max_new_tokens=48,
        )
        city = (await stream.result()).parse(City)
        assert isinstance(city, City) and city.name and stream.finish.reason == "constraint_complete"


async def test_eight_concurrent_streams(server):
    """Eight streams at once share the batch (the server runs them together, max_batch_size 8)."""
    async with AsyncClient(server.address, timeout=120) as client:
        most_running = 0
        done = asyncio.Event()

        async def watch() -> None:
            nonlocal most_running
            while not done.is_set():
                most_running = max(most_running, (await client.status()).running_sequences)
                await asyncio.sleep(0.01)

        async def one(index: int) -> tokenspout.Generation:
            prompt = f"Write a numbered list of {index + 3} fruits:"
            async with client.stream(prompt, stopping=Stopping(max_new_tokens=48, ignore_eos=True)) as stream:
                return await stream.result()

        watcher = asyncio.create_task(watch())
        generations = await asyncio.gather(*(one(i) for i in range(8)))
        done.set()
        await watcher
    assert [g.generated_tokens for g in generations] == [48] * 8
    assert all(g.finish.reason == "max_tokens" for g in generations)
    assert len({g.request_id for g in generations}) == 8
    assert most_running == 8


async def test_leaving_the_block_cancels_and_a_deadline_ends_the_call(server):
    async with AsyncClient(server.address, timeout=120) as client:
        request_id = f"async-leave-{uuid.uuid4()}"
        before = (await client.status()).cancelled_total
        long = Stopping(max_new_tokens=900, ignore_eos=True)
        async with client.stream("Once upon a time", request_id=request_id, stopping=long) as stream:
            async for _ in stream:
                break
        for _ in range(500):
            if (await client.status()).cancelled_total > before:
                break
            await asyncio.sleep(0.02)
        assert (await client.cancel(request_id)).not_found == [request_id]

        with pytest.raises(tokenspout.DeadlineExceededError):
            async for _ in client.stream("Once upon a time", stopping=long, timeout=0.5):
                pass


async def test_errors_are_decoded(server):
    async with AsyncClient(server.address, timeout=60) as client:
        with pytest.raises(tokenspout.InvalidRequestError) as caught:
            async for _ in client.stream("Hi", sampling=Sampling(min_p=3.0)):
                pass
        assert [v.field for v in caught.value.field_violations] == ["sampling.min_p"]
        with pytest.raises(tokenspout.NotFoundError):
            await client.generate("Hi", model="no-such-model")
