"""The synchronous client: `Client` and the `Stream` its stream() returns.

    from tokenspout import Client

    with Client("127.0.0.1:50051") as client:
        with client.stream("Why is the sky blue?", max_new_tokens=64) as stream:
            for chunk in stream:
                print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Unpack

import grpc

from tokenspout import requests as rq
from tokenspout import responses as rs
from tokenspout.affinity import with_affinity
from tokenspout.connection import Tls, channel_spec
from tokenspout.errors import TokenspoutError, from_rpc_error
from tokenspout.retry import RetryPolicy, deadline_of, remaining
from tokenspout.streams import StreamState, generation
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger("tokenspout.client")


class Stream(StreamState, Iterator[rs.Chunk]):
    """The chunks of one generation, as they arrive (heartbeats are skipped).

    As a context manager, leaving the block cancels the RPC if it is still running, which frees
    its slot on the server at once. A call that has received nothing yet is retried per the policy.
    """

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> rs.Chunk:
        while True:
            if self._call is None:
                self._call = self._start(remaining(self._deadline))
            try:
                response = next(self._call)
            except grpc.RpcError as rpc_error:
                error = from_rpc_error(rpc_error)
                wait = self._retry_delay(error)
                if wait is None:
                    raise error from None
                log.info("retrying the stream in %.2f s after %s", wait, error)
                time.sleep(wait)
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


class Client:
    """A connection to one tokenspout server, or several with round_robin.

    address: "host:port", or a list of IP "host:port" (round_robin by default then).
    api_key: sent as `authorization: Bearer <key>`; defaults to $TOKENSPOUT_API_KEY.
    tls: True for the system roots, or Tls(...) for custom roots, mutual TLS or a name override.
    timeout: each call's deadline in seconds (retries included) unless the call gives its own.
    retry: a RetryPolicy, or how many retries with the default backoff (0 disables them).
    affinity: send each generation's affinity key (tokenspout.affinity, header x-tokenspout-affinity),
      which Envoy and HAProxy in deploy/ route on so a chat's turns reuse one replica's prefix cache.
    """

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
            self._channel = grpc.secure_channel(spec.target, spec.credentials, spec.options)
        else:
            self._channel = grpc.insecure_channel(spec.target, spec.options)
        self.stub = pb_grpc.GenerationServiceStub(self._channel)  # type: ignore[no-untyped-call]  # generated unannotated
        """The generated stub on the same channel, for anything this client does not cover."""
        self._metadata = spec.metadata
        self.affinity = affinity
        self.timeout = timeout
        self.retry = RetryPolicy(max_retries=retry) if isinstance(retry, int) else retry

    def stream(self, prompt: str | None = None, /, **options: Unpack[rq.GenerateOptions]) -> Stream:
        """Starts a generation and returns its chunks as they arrive; see GenerateOptions."""
        request = rq.generate_request(pb.GenerateStreamRequest, prompt, options)
        deadline = deadline_of(options.get("timeout", self.timeout))

        metadata = self._call_metadata(request, options)

        def start(timeout: float | None) -> Any:
            return self.stub.GenerateStream(request, timeout=timeout, metadata=metadata)

        return Stream(start, self.retry, deadline)

    def generate(self, prompt: str | None = None, /, **options: Unpack[rq.GenerateOptions]) -> rs.Generation:
        """Generates the whole text and returns it at once; see GenerateOptions."""
        request = rq.generate_request(pb.GenerateRequest, prompt, options)
        metadata = self._call_metadata(request, options)
        response = self._unary(self.stub.Generate, request, options.get("timeout"), metadata)
        return rs.from_proto(rs.Generation, response)

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
        request = rq.tokenize_request(text, messages, add_special_tokens, model, texts, return_offsets)
        return rs.from_proto(rs.Tokenized, self._unary(self.stub.Tokenize, request, timeout))

    def model_info(self, *, model: str = "", timeout: float | None = None) -> rs.ModelInfo:
        request = pb.GetModelInfoRequest(model=model)
        return rs.from_proto(rs.ModelInfo, self._unary(self.stub.GetModelInfo, request, timeout))

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
        request = rq.compile_request(
            constraint, model, json_schema=json_schema, regex=regex, grammar=grammar, choices=choices
        )
        return rs.from_proto(rs.Compiled, self._unary(self.stub.CompileConstraint, request, timeout))

    def cancel(self, request_ids: str | Sequence[str], *, timeout: float | None = None) -> rs.Cancelled:
        """Cancels running or queued requests by id (for instance from another process)."""
        request = rq.cancel_request(request_ids)
        return rs.from_proto(rs.Cancelled, self._unary(self.stub.Cancel, request, timeout))

    def status(self, *, timeout: float | None = None) -> rs.ServerStatus:
        response = self._unary(self.stub.GetServerStatus, pb.GetServerStatusRequest(), timeout)
        return rs.from_proto(rs.ServerStatus, response)

    def _call_metadata(self, request: Any, options: rq.GenerateOptions) -> tuple[tuple[str, str], ...]:
        """The channel's metadata and, unless turned off, the affinity key (tokenspout.affinity)."""
        if not self.affinity:
            return self._metadata
        return with_affinity(self._metadata, request, options.get("session_id"))

    def _unary(
        self, method: Any, request: Any, timeout: float | None, metadata: tuple[tuple[str, str], ...] | None = None
    ) -> Any:
        deadline = deadline_of(timeout if timeout is not None else self.timeout)
        retries = 0
        while True:
            try:
                return method(request, timeout=remaining(deadline), metadata=metadata or self._metadata)
            except grpc.RpcError as rpc_error:
                error: TokenspoutError = from_rpc_error(rpc_error)
                wait = self.retry.delay(error, retries, deadline)
                if wait is None:
                    raise error from None
                log.info("retrying %s in %.2f s after %s", type(request).__name__, wait, error)
                time.sleep(wait)
                retries += 1

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
