"""Typed exceptions decoded from the gRPC status and its google.rpc details.

The server sends an ErrorInfo with every error, a BadRequest with field violations for bad
input, and a RetryInfo when a retry may succeed later (see service/errors.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]  # no stubs, no py.typed

_STATUS_DETAILS_KEY = "grpc-status-details-bin"
# gRPC's own retry hint; read when a server sends it without a RetryInfo.
_PUSHBACK_KEY = "grpc-retry-pushback-ms"


class Reason(enum.StrEnum):
    """Every ErrorInfo.reason the server sends, under the status it comes with."""

    INVALID_REQUEST = "INVALID_REQUEST"
    """INVALID_ARGUMENT: a field is wrong; see field_violations (every one at once)."""
    MALFORMED_REQUEST = "MALFORMED_REQUEST"
    """INVALID_ARGUMENT: the request bytes are not a valid message."""
    CONSTRAINT_FAILED = "CONSTRAINT_FAILED"
    """INVALID_ARGUMENT: the constraint could not be enforced past some point mid-stream."""
    OUT_OF_RANGE = "OUT_OF_RANGE"
    """OUT_OF_RANGE: the prompt does not fit the context."""
    MODEL_NOT_FOUND = "MODEL_NOT_FOUND"
    """NOT_FOUND: `model` names a model this server does not serve."""
    NOT_SUPPORTED = "NOT_SUPPORTED"
    """UNIMPLEMENTED: this engine lacks a sampler or feature the request asks for."""
    REQUEST_ID_IN_USE = "REQUEST_ID_IN_USE"
    """ALREADY_EXISTS: the caller's request with this request_id is still running."""
    OVERLOADED = "OVERLOADED"
    """RESOURCE_EXHAUSTED: every batch place and queue place is taken; retry after retry_after."""
    CALLER_OVER_LIMIT = "CALLER_OVER_LIMIT"
    """RESOURCE_EXHAUSTED: you hold as many requests as one caller may; others are still served."""
    SHED = "SHED"
    """RESOURCE_EXHAUSTED: your queued request gave its place to a caller under its share (or a more urgent one)."""
    TOO_MANY_COMPILES = "TOO_MANY_COMPILES"
    """RESOURCE_EXHAUSTED: too many large constraints are compiling; retry shortly."""
    COMPILE_BUDGET_EXCEEDED = "COMPILE_BUDGET_EXCEEDED"
    """RESOURCE_EXHAUSTED: the constraint is still compiling; a retry once it is cached starts at once."""
    UNAUTHENTICATED = "UNAUTHENTICATED"
    """UNAUTHENTICATED: no valid API key."""
    PRIORITY_NOT_ALLOWED = "PRIORITY_NOT_ALLOWED"
    """PERMISSION_DENIED: a priority above 0, which the server's priority_callers does not allow you."""
    PAUSED_TOO_LONG = "PAUSED_TOO_LONG"
    """ABORTED: the caller read nothing for the server's max_pause_s, so its stream was ended."""
    DRAINING = "DRAINING"
    """UNAVAILABLE: the server is shutting down; retry on another replica."""
    ENGINE_DOWN = "ENGINE_DOWN"
    """UNAVAILABLE: the server's engine stopped; retry on another replica."""
    QUEUE_TIMEOUT = "QUEUE_TIMEOUT"
    """UNAVAILABLE: the request did not start within its queue_timeout_ms; retry on another replica."""
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    """DEADLINE_EXCEEDED: the caller's deadline passed; what streamed before stays delivered."""
    ENGINE_FAILURE = "ENGINE_FAILURE"
    """INTERNAL: the engine failed this one request; metadata["request_id"] names it."""
    INTERNAL = "INTERNAL"
    """INTERNAL: a server bug, logged under metadata["request_id"]."""


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


class TokenspoutError(Exception):
    """Any error a call ended with. `reason` is the server's ErrorInfo.reason ("" when absent)."""

    retryable = False

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode = grpc.StatusCode.UNKNOWN,
        reason: str = "",
        metadata: dict[str, str] | None = None,
        field_violations: list[FieldViolation] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.reason = reason
        self.metadata = metadata or {}
        self.field_violations = field_violations or []
        self.retry_after = retry_after
        """Seconds the server asked the caller to wait (RetryInfo.retry_delay), when it sent one."""

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidRequestError(TokenspoutError):
    """INVALID_ARGUMENT, OUT_OF_RANGE or FAILED_PRECONDITION; see field_violations."""


class OverloadedError(TokenspoutError):
    """RESOURCE_EXHAUSTED: the server is full; retry after `retry_after` seconds."""

    retryable = True


class UnavailableError(TokenspoutError):
    """UNAVAILABLE: the server is unreachable, draining or its engine is down."""

    retryable = True


class NotFoundError(TokenspoutError):
    pass


class ConflictError(TokenspoutError):
    """ALREADY_EXISTS: a request with this request_id is still running."""


class UnauthenticatedError(TokenspoutError):
    pass


class PermissionDeniedError(TokenspoutError):
    pass


class DeadlineExceededError(TokenspoutError):
    pass


class AbortedError(TokenspoutError):
    """ABORTED: the server ended the stream because its caller stopped reading (PAUSED_TOO_LONG)."""


class CancelledError(TokenspoutError):
    pass


class UnimplementedError(TokenspoutError):
    pass


class InternalError(TokenspoutError):
    pass


_CLASSES: dict[grpc.StatusCode, type[TokenspoutError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequestError,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidRequestError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: ConflictError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.ABORTED: AbortedError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    grpc.StatusCode.INTERNAL: InternalError,
}


def _trailer(trailing_metadata: Any, wanted: str) -> Any:
    for key, value in trailing_metadata or ():
        if key == wanted:
            return value
    return None


def _pushback_s(trailing_metadata: Any) -> float | None:
    value = _trailer(trailing_metadata, _PUSHBACK_KEY)
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    return int(value) / 1000 if value is not None and value.isdigit() else None


def from_rpc_error(error: grpc.RpcError) -> TokenspoutError:
    """The typed exception for a failed call (sync or asyncio)."""
    code: grpc.StatusCode = error.code()
    message: str = error.details() or code.name
    fields: dict[str, Any] = {}
    trailers = error.trailing_metadata()
    details = _trailer(trailers, _STATUS_DETAILS_KEY)
    status = status_pb2.Status.FromString(details) if details is not None else None
    violations: list[FieldViolation] = []
    for detail in status.details if status else ():
        info, bad_request, retry = (
            error_details_pb2.ErrorInfo(),
            error_details_pb2.BadRequest(),
            error_details_pb2.RetryInfo(),
        )
        if detail.Unpack(info):
            fields.update(reason=info.reason, metadata=dict(info.metadata))
        elif detail.Unpack(bad_request):
            violations += [FieldViolation(v.field, v.description) for v in bad_request.field_violations]
        elif detail.Unpack(retry):
            fields["retry_after"] = retry.retry_delay.ToNanoseconds() / 1e9
    if "retry_after" not in fields:
        fields["retry_after"] = _pushback_s(trailers)
    error_class = _CLASSES.get(code, TokenspoutError)
    return error_class(message, code=code, field_violations=violations, **fields)
