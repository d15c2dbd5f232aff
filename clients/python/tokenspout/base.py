"""What the sync and asyncio clients share, as httpx's BaseClient: the connection's settings, each call's
request, metadata and tries (tokenspout.retry.Tries: when to retry), and reading the answers. `Client` and
`AsyncClient` are the two transports over it: how they open a channel, and whether they wait by blocking
or by awaiting.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from tokenspout import requests as rq
from tokenspout import responses as rs
from tokenspout.affinity import with_affinity
from tokenspout.connection import ChannelSpec, Tls, channel_spec
from tokenspout.retry import RetryPolicy, Tries
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

T = TypeVar("T")
Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Unary(Generic[T]):
    """One unary call, ready to send: the stub's method, its request, the caller's timeout (None: the client's),
    the type its answer is read into, and its metadata (None: the channel's)."""

    method: Callable[..., Any]
    request: Any
    timeout: float | None
    answer: type[T]
    metadata: Metadata | None = None

    def read(self, response: Any) -> T:
        return rs.from_proto(self.answer, response)

    @property
    def name(self) -> str:
        """What the log calls it: its request's message name."""
        return type(self.request).__name__


class BaseClient:
    """The settings and the calls of a client; see tokenspout.Client for the arguments."""

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
        self._channel = self._open(spec)
        self.stub = pb_grpc.GenerationServiceStub(self._channel)  # type: ignore[no-untyped-call]  # generated unannotated
        """The generated stub on the same channel, for anything this client does not cover."""
        self._metadata = spec.metadata
        self.affinity = affinity
        self.timeout = timeout
        self.retry = RetryPolicy(max_retries=retry) if isinstance(retry, int) else retry

    def _open(self, spec: ChannelSpec) -> Any:
        """The channel (grpc's or grpc.aio's)."""
        raise NotImplementedError

    def _stream_start(
        self, prompt: str | None, options: rq.GenerateOptions,
    ) -> tuple[Callable[[float | None], Any], Tries]:
        """How to start (and start again) a stream of this generation, and its tries."""
        request = rq.generate_request(pb.GenerateStreamRequest, prompt, options)
        metadata = self._call_metadata(request, options)

        def start(timeout: float | None) -> Any:
            return self.stub.GenerateStream(request, timeout=timeout, metadata=metadata)

        return start, Tries(self.retry, options.get("timeout", self.timeout))

    def _generate(self, prompt: str | None, options: rq.GenerateOptions) -> Unary[rs.Generation]:
        request = rq.generate_request(pb.GenerateRequest, prompt, options)
        metadata = self._call_metadata(request, options)
        return Unary(self.stub.Generate, request, options.get("timeout"), rs.Generation, metadata)

    def _tokenize(
        self, text: str | None, messages: Sequence[rq.Message | Mapping[str, str]] | None, texts: Sequence[str] | None,
        return_offsets: bool, add_special_tokens: bool | None, model: str, timeout: float | None,
    ) -> Unary[rs.Tokenized]:
        request = rq.tokenize_request(text, messages, add_special_tokens, model, texts, return_offsets)
        return Unary(self.stub.Tokenize, request, timeout, rs.Tokenized)

    def _model_info(self, model: str, timeout: float | None) -> Unary[rs.ModelInfo]:
        return Unary(self.stub.GetModelInfo, pb.GetModelInfoRequest(model=model), timeout, rs.ModelInfo)

    def _compile(
        self, constraint: rq.Constraint | None, model: str, timeout: float | None, **shortcuts: Any,
    ) -> Unary[rs.Compiled]:
        request = rq.compile_request(constraint, model, **shortcuts)
        return Unary(self.stub.CompileConstraint, request, timeout, rs.Compiled)

    def _cancel(self, request_ids: str | Sequence[str], timeout: float | None) -> Unary[rs.Cancelled]:
        return Unary(self.stub.Cancel, rq.cancel_request(request_ids), timeout, rs.Cancelled)

    def _status(self, timeout: float | None) -> Unary[rs.ServerStatus]:
        return Unary(self.stub.GetServerStatus, pb.GetServerStatusRequest(), timeout, rs.ServerStatus)

    def _call_metadata(self, request: Any, options: rq.GenerateOptions) -> Metadata:
        """The channel's metadata and, unless turned off, the affinity key (tokenspout.affinity)."""
        if not self.affinity:
            return self._metadata
        return with_affinity(self._metadata, request, options.get("session_id"))

    def _tries(self, call: Unary[Any]) -> Tries:
        """The call's tries under its deadline (its own timeout, else the client's) and the client's retry policy."""
        return Tries(self.retry, call.timeout if call.timeout is not None else self.timeout)
