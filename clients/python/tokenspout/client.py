"""The synchronous client: `Client` and the `Stream` its stream() returns.

    from tokenspout import Client

    with Client("127.0.0.1:50051") as client:
        with client.stream("Why is the sky blue?", max_new_tokens=64) as stream:
            for chunk in stream:
                print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TypeVar, Unpack

import grpc

from tokenspout import requests as rq
from tokenspout import responses as rs
from tokenspout.base import BaseClient, Unary
from tokenspout.connection import ChannelSpec
from tokenspout.streams import StreamState, generation

T = TypeVar("T")


class Stream(StreamState, Iterator[rs.Chunk]):
    """The chunks of one generation, as they arrive (heartbeats are skipped).

    As a context manager, leaving the block cancels the RPC if it is still running, which frees
    its slot on the server at once. A call that has received nothing yet is retried per the policy.
    """

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> rs.Chunk:
        while True:
            try:
                response = next(self._started())
            except grpc.RpcError as rpc_error:
                time.sleep(self._wait_after(rpc_error))
                continue
            chunk = self._accept(response)
            if chunk is not None:
                return chunk

    def result(self) -> rs.Generation:
        """Reads the rest of the stream and returns the whole generation."""
        for _ in self:
            pass
        return generation(self._chunks)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cancel()


class Client(BaseClient):
    """A connection to one tokenspout server, or several with round_robin.

    address: "host:port", or a list of IP "host:port" (round_robin by default then).
    api_key: sent as `authorization: Bearer <key>`; defaults to $TOKENSPOUT_API_KEY.
    tls: True for the system roots, or Tls(...) for custom roots, mutual TLS or a name override.
    timeout: each call's deadline in seconds (retries included) unless the call gives its own.
    retry: a RetryPolicy, or how many retries with the default backoff (0 disables them).
    affinity: send each generation's affinity key (tokenspout.affinity, header x-tokenspout-affinity),
      which Envoy and HAProxy in deploy/ route on so a chat's turns reuse one replica's prefix cache.
    """

    def _open(self, spec: ChannelSpec) -> grpc.Channel:
        if spec.credentials is not None:
            return grpc.secure_channel(spec.target, spec.credentials, spec.options)
        return grpc.insecure_channel(spec.target, spec.options)

    def stream(self, prompt: str | None = None, /, **options: Unpack[rq.GenerateOptions]) -> Stream:
        """Starts a generation and returns its chunks as they arrive; see GenerateOptions."""
        return Stream(*self._stream_start(prompt, options))

    def generate(self, prompt: str | None = None, /, **options: Unpack[rq.GenerateOptions]) -> rs.Generation:
        """Generates the whole text and returns it at once; see GenerateOptions."""
        return self._send(self._generate(prompt, options))

    def tokenize(
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
        return self._send(self._tokenize(text, messages, texts, return_offsets, add_special_tokens, model, timeout))

    def model_info(self, *, model: str = "", timeout: float | None = None) -> rs.ModelInfo:
        return self._send(self._model_info(model, timeout))

    def compile(
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
        """Compiles a constraint into the server's cache; a bad one raises InvalidRequestError."""
        return self._send(self._compile(constraint, model, timeout, json_schema=json_schema, regex=regex,
                                        grammar=grammar, choices=choices))

    def cancel(self, request_ids: str | Sequence[str], *, timeout: float | None = None) -> rs.Cancelled:
        """Cancels running or queued requests by id (for instance from another process)."""
        return self._send(self._cancel(request_ids, timeout))

    def status(self, *, timeout: float | None = None) -> rs.ServerStatus:
        return self._send(self._status(timeout))

    def _send(self, call: Unary[T]) -> T:
        """Sends a unary call, again after a wait while the retry policy allows, and reads its answer."""
        tries = self._tries(call)
        while True:
            try:
                response = call.method(call.request, timeout=tries.timeout(), metadata=call.metadata or self._metadata)
            except grpc.RpcError as rpc_error:
                time.sleep(tries.wait_after(rpc_error, call.name))
                continue
            return call.read(response)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
