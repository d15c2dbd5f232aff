"""The asyncio client: `AsyncClient` and the `AsyncStream` its stream() returns.

    from tokenspout import AsyncClient

    async with AsyncClient("127.0.0.1:50051") as client:
        async with client.stream("Why is the sky blue?", max_new_tokens=64) as stream:
            async for chunk in stream:
                print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TypeVar, Unpack

import grpc
import grpc.aio

from tokenspout import requests as rq
from tokenspout import responses as rs
from tokenspout.base import BaseClient, Unary
from tokenspout.connection import ChannelSpec
from tokenspout.errors import CancelledError
from tokenspout.streams import StreamState, generation

T = TypeVar("T")


class AsyncStream(StreamState, AsyncIterator[rs.Chunk]):
    """The chunks of one generation; see tokenspout.client.Stream, which this mirrors."""

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> rs.Chunk:
        while True:
            try:
                response = await self._started().read()
            except asyncio.CancelledError:
                if not self._cancelled:
                    raise  # the task itself was cancelled
                raise CancelledError("the stream was cancelled", code=grpc.StatusCode.CANCELLED) from None
            except grpc.RpcError as rpc_error:
                await asyncio.sleep(self._wait_after(rpc_error))
                continue
            if response is grpc.aio.EOF:
                raise StopAsyncIteration
            chunk = self._accept(response)
            if chunk is not None:
                return chunk

    async def result(self) -> rs.Generation:
        async for _ in self:
            pass
        return generation(self._chunks)

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.cancel()


class AsyncClient(BaseClient):
    """The asyncio twin of tokenspout.Client, with the same arguments and methods (awaitable)."""

    def _open(self, spec: ChannelSpec) -> grpc.aio.Channel:
        if spec.credentials is not None:
            return grpc.aio.secure_channel(spec.target, spec.credentials, spec.options)
        return grpc.aio.insecure_channel(spec.target, spec.options)

    def stream(self, prompt: str | None = None, /, **options: Unpack[rq.GenerateOptions]) -> AsyncStream:
        return AsyncStream(*self._stream_start(prompt, options))

    async def generate(self, prompt: str | None = None, /, **options: Unpack[rq.GenerateOptions]) -> rs.Generation:
        return await self._send(self._generate(prompt, options))

    async def tokenize(
        self,
        text: str | None = None,
        /,
        *,
        messages: Sequence[rq.Message | Mapping[str, str]] | None = None,
        texts: Sequence[str] | None = None,
        return_offsets: bool = False,
        add_special_tokens: bool | None = None,
        model: str = "",
        timeout: float | None = None,
    ) -> rs.Tokenized:
        """Token ids of a text, a chat, or several texts (`texts=`: answered in `results`); with
        `return_offsets`, where each token lies in its text."""
        return await self._send(self._tokenize(text, messages, texts, return_offsets, add_special_tokens, model, timeout))

    async def model_info(self, *, model: str = "", timeout: float | None = None) -> rs.ModelInfo:
        return await self._send(self._model_info(model, timeout))

    async def compile(
        self,
        constraint: rq.Constraint | None = None,
        /,
        *,
        json_schema: rq.JsonSchema | None = None,
        regex: str | None = None,
        grammar: str | None = None,
        choices: Sequence[str] | None = None,
        model: str = "",
        timeout: float | None = None,
    ) -> rs.Compiled:
        return await self._send(self._compile(constraint, model, timeout, json_schema=json_schema, regex=regex,
                                              grammar=grammar, choices=choices))

    async def cancel(self, request_ids: str | Sequence[str], *, timeout: float | None = None) -> rs.Cancelled:
        return await self._send(self._cancel(request_ids, timeout))

    async def status(self, *, timeout: float | None = None) -> rs.ServerStatus:
        return await self._send(self._status(timeout))

    async def _send(self, call: Unary[T]) -> T:
        """Sends a unary call, again after a wait while the retry policy allows, and reads its answer."""
        tries = self._tries(call)
        while True:
            try:
                response = await call.method(call.request, timeout=tries.timeout(), metadata=call.metadata or self._metadata)
            except grpc.RpcError as rpc_error:
                await asyncio.sleep(tries.wait_after(rpc_error, call.name))
                continue
            return call.read(response)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
