"""The asyncio client: `AsyncClient` and the `AsyncStream` its stream() returns.

    from tokenspout import AsyncClient

    async with AsyncClient("127.0.0.1:50051") as client:
        async with client.stream("Why is the sky blue?", max_new_tokens=64) as stream:
            async for chunk in stream:
                print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Unpack

import grpc
import grpc.aio

from tokenspout import requests as rq
from tokenspout import responses as rs
from tokenspout.affinity import with_affinity
from tokenspout.connection import Tls, channel_spec
from tokenspout.errors import CancelledError, TokenspoutError, from_rpc_error
from tokenspout.retry import RetryPolicy, deadline_of, remaining
from tokenspout.streams import StreamState, generation
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger("tokenspout.client")


class AsyncStream(StreamState, AsyncIterator[rs.Chunk]):
    """The chunks of one generation; see tokenspout.client.Stream, which this mirrors."""

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> rs.Chunk:
        while True:
            if self._call is None:
                self._call = self._start(remaining(self._deadline))
            try:
                response = await self._call.read()
            except asyncio.CancelledError:
                if not self._cancelled:
                    raise  # the task itself was cancelled
                raise CancelledError("the stream was cancelled", code=grpc.StatusCode.CANCELLED) from None
            except grpc.RpcError as rpc_error:
                error = from_rpc_error(rpc_error)
                wait = self._retry_delay(error)
                if wait is None:
                    raise error from None
                log.info("retrying the stream in %.2f s after %s", wait, error)
                await asyncio.sleep(wait)
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


class AsyncClient:
    """The asyncio twin of tokenspout.Client, with the same arguments and methods (awaitable)."""

    def __init__(
        self,
        address: str | Sequence[str] = "127.0.0.1:50051",
        *,
        api_key: str | None = None,
        tls: bool | Tls = False,
        timeout: float | None = None,
        retry: RetryPolicy | int = RetryPolicy(),
        round_robin: bool | None = None,
        options: Sequence[tuple[str, object]] = (),
        affinity: bool = True,
    ) -> None:
        spec = channel_spec(address, api_key=api_key, tls=tls, round_robin=round_robin, options=options)
        if spec.credentials is not None:
            self._channel = grpc.aio.secure_channel(spec.target, spec.credentials, spec.options)
        else:
            self._channel = grpc.aio.insecure_channel(spec.target, spec.options)
        self.stub = pb_grpc.GenerationServiceStub(self._channel)  # type: ignore[no-untyped-call]  # generated unannotated
        self._metadata = spec.metadata
        self.affinity = affinity
        self.timeout = timeout
        self.retry = RetryPolicy(max_retries=retry) if isinstance(retry, int) else retry

    def stream(self, prompt: str | None = None, /, **options: Unpack[rq.GenerateOptions]) -> AsyncStream:
        request = rq.generate_request(pb.GenerateStreamRequest, prompt, options)
        deadline = deadline_of(options.get("timeout", self.timeout))

        metadata = self._call_metadata(request, options)

        def start(timeout: float | None) -> Any:
            return self.stub.GenerateStream(request, timeout=timeout, metadata=metadata)

        return AsyncStream(start, self.retry, deadline)

    async def generate(self, prompt: str | None = None, /, **options: Unpack[rq.GenerateOptions]) -> rs.Generation:
        request = rq.generate_request(pb.GenerateRequest, prompt, options)
        metadata = self._call_metadata(request, options)
        response = await self._unary(self.stub.Generate, request, options.get("timeout"), metadata)
        return rs.from_proto(rs.Generation, response)

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
        request = rq.tokenize_request(text, messages, add_special_tokens, model, texts, return_offsets)
        return rs.from_proto(rs.Tokenized, await self._unary(self.stub.Tokenize, request, timeout))

    async def model_info(self, *, model: str = "", timeout: float | None = None) -> rs.ModelInfo:
        request = pb.GetModelInfoRequest(model=model)
        return rs.from_proto(rs.ModelInfo, await self._unary(self.stub.GetModelInfo, request, timeout))

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
        request = rq.compile_request(
            constraint, model, json_schema=json_schema, regex=regex, grammar=grammar, choices=choices
        )
        return rs.from_proto(rs.Compiled, await self._unary(self.stub.CompileConstraint, request, timeout))

    async def cancel(self, request_ids: str | Sequence[str], *, timeout: float | None = None) -> rs.Cancelled:
        request = rq.cancel_request(request_ids)
        return rs.from_proto(rs.Cancelled, await self._unary(self.stub.Cancel, request, timeout))

    async def status(self, *, timeout: float | None = None) -> rs.ServerStatus:
        response = await self._unary(self.stub.GetServerStatus, pb.GetServerStatusRequest(), timeout)
        return rs.from_proto(rs.ServerStatus, response)

    def _call_metadata(self, request: Any, options: rq.GenerateOptions) -> tuple[tuple[str, str], ...]:
        """The channel's metadata and, unless turned off, the affinity key (tokenspout.affinity)."""
        if not self.affinity:
            return self._metadata
        return with_affinity(self._metadata, request, options.get("session_id"))

    async def _unary(
        self, method: Any, request: Any, timeout: float | None, metadata: tuple[tuple[str, str], ...] | None = None
    ) -> Any:
        deadline = deadline_of(timeout if timeout is not None else self.timeout)
        retries = 0
        while True:
            try:
                return await method(request, timeout=remaining(deadline), metadata=metadata or self._metadata)
            except grpc.RpcError as rpc_error:
                error: TokenspoutError = from_rpc_error(rpc_error)
                wait = self.retry.delay(error, retries, deadline)
                if wait is None:
                    raise error from None
                log.info("retrying %s in %.2f s after %s", type(request).__name__, wait, error)
                await asyncio.sleep(wait)
                retries += 1

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
