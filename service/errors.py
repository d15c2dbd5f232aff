"""Errors the service answers with, and the one table that turns exceptions into gRPC status.

Every error carries google.rpc details (AIP-193): always an ErrorInfo with a
stable reason, plus BadRequest field violations or RetryInfo where they apply.
Whatever the input, a status stays small enough to deliver (`MAX_STATUS_BYTES`):
quoted input is clipped and long violation lists end with "... and N more".
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2  # type: ignore[import-untyped]  # no stubs, no py.typed
from grpc_status import rpc_status

from backend import ChatTemplateError, EngineGone, ErrorEvent, ErrorKind
from backend.constraints import ConstraintError

DOMAIN = "tokenspout.v1"

# The serialized google.rpc.Status (message and details) stays under this; clients refuse
# trailers past 16 kB, and an error must never read as RESOURCE_EXHAUSTED for its size.
MAX_STATUS_BYTES = 4096
_MAX_MESSAGE_BYTES = 768
_MAX_FIELD_BYTES = 96
_MAX_DESCRIPTION_BYTES = 256
_MAX_METADATA_BYTES = 128
_MAX_VIOLATIONS = 8
IMMEDIATE_HEALTH_CHECK_FAIL = "x-envoy-immediate-health-check-fail"

CURRENT_REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
"""The id of the request the current RPC serves, once known (named in INTERNAL errors)."""


def clip(text: str, limit: int) -> str:
    """`text` cut to at most `limit` UTF-8 bytes, on a character boundary, marked when cut."""
    data = text.encode("utf-8", errors="replace")
    if len(data) <= limit:
        return text
    return data[: limit - 3].decode("utf-8", errors="ignore") + "..."


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


@dataclass
class ServiceError(Exception):
    """An error to send to the caller as a gRPC status."""

    code: grpc.StatusCode
    reason: str
    message: str
    violations: list[FieldViolation] = field(default_factory=list)
    retry_after_s: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    replica_leaving: bool = False
    """This replica is going away (draining, engine down): proxies should stop sending it calls now."""

    def __str__(self) -> str:
        return self.message

    def to_status(self) -> grpc.Status:
        status = self._status_pb(self._bounded_violations(_MAX_VIOLATIONS))
        # Only a pathological mix of multi-byte input gets here; fewer violations always fit.
        for keep in range(_MAX_VIOLATIONS - 1, -1, -1):
            if status.ByteSize() <= MAX_STATUS_BYTES:
                break
            status = self._status_pb(self._bounded_violations(keep))
        grpc_status = rpc_status.to_status(status)
        # A namedtuple (grpc_status.rpc_status._Status); the stub declares only the grpc.Status ABC.
        advised: grpc.Status = grpc_status._replace(  # type: ignore[attr-defined]
            trailing_metadata=grpc_status.trailing_metadata + self._advice()
        )
        return advised

    def _advice(self) -> tuple[tuple[str, str], ...]:
        """Trailers beside the status that tell callers and proxies what to do next."""
        advice = []
        if self.code is grpc.StatusCode.RESOURCE_EXHAUSTED and self.retry_after_s is not None:
            # gRPC's own retry policy honours this (gRFC A6), so clients back off as advised.
            advice.append(("grpc-retry-pushback-ms", str(int(self.retry_after_s * 1000))))
        if self.replica_leaving:
            # Envoy takes the replica out of its balancing at this answer, not at its next health
            # check: until then a retry could be sent back here (a refused call answers in headers
            # only, where Envoy reads this).
            advice.append((IMMEDIATE_HEALTH_CHECK_FAIL, "true"))
        return tuple(advice)

    def _bounded_violations(self, keep: int) -> list[FieldViolation]:
        shown = [
            FieldViolation(clip(v.field, _MAX_FIELD_BYTES), clip(v.description, _MAX_DESCRIPTION_BYTES))
            for v in self.violations[:keep]
        ]
        hidden = len(self.violations) - len(shown)
        if hidden > 0:
            shown.append(FieldViolation("...", f"and {hidden} more"))
        return shown

    def _status_pb(self, violations: list[FieldViolation]) -> status_pb2.Status:
        metadata = {clip(k, _MAX_METADATA_BYTES): clip(v, _MAX_METADATA_BYTES) for k, v in self.metadata.items()}
        details = [error_details_pb2.ErrorInfo(reason=self.reason, domain=DOMAIN, metadata=metadata)]
        if violations:
            details.append(
                error_details_pb2.BadRequest(
                    field_violations=[
                        error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                        for v in violations
                    ]
                )
            )
        if self.retry_after_s is not None:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(int(self.retry_after_s * 1e9))
            details.append(error_details_pb2.RetryInfo(retry_delay=delay))
        packed = []
        for detail in details:
            any_detail = any_pb2.Any()
            any_detail.Pack(detail)
            packed.append(any_detail)
        return status_pb2.Status(
            code=getattr(code_pb2, self.code.name), message=clip(self.message, _MAX_MESSAGE_BYTES), details=packed
        )


def _summary(violations: list[FieldViolation]) -> str:
    shown = "; ".join(f"{clip(v.field, 64)}: {clip(v.description, 128)}" for v in violations[:_MAX_VIOLATIONS])
    hidden = len(violations) - _MAX_VIOLATIONS
    return shown + (f"; ... and {hidden} more" if hidden > 0 else "")


def invalid_argument(violations: list[FieldViolation]) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", f"invalid request: {_summary(violations)}", violations
    )


def malformed_request(message_name: str) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.INVALID_ARGUMENT,
        "MALFORMED_REQUEST",
        f"the request bytes are not a valid {message_name} protobuf message",
    )


def invalid_constraint(error: ConstraintError) -> ServiceError:
    where = f"constraint.{error.kind}" if error.kind else "constraint"
    return ServiceError(
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_REQUEST",
        f"invalid request: {where}: cannot be enforced: {clip(str(error), 512)}",
        [FieldViolation(where, f"cannot be enforced: {error}")],
    )


def constraint_failed(request_id: str, message: str) -> ServiceError:
    """A matcher failed mid-stream: the caller's constraint, not the engine, is at fault."""
    return ServiceError(
        grpc.StatusCode.INVALID_ARGUMENT,
        "CONSTRAINT_FAILED",
        f"request {request_id}: the constraint could not be enforced past this point: {message}",
        [FieldViolation("constraint", message)],
        metadata={"request_id": request_id},
    )


def out_of_range(field_name: str, description: str) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.OUT_OF_RANGE,
        "OUT_OF_RANGE",
        f"{field_name}: {description}",
        [FieldViolation(field_name, description)],
    )


def not_found_model(model: str) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.NOT_FOUND,
        "MODEL_NOT_FOUND",
        f"model {clip(model, 128)!r} is not served here; see GetModelInfo",
        [FieldViolation("model", "unknown model")],
        metadata={"model": model},
    )


def unimplemented(violations: list[FieldViolation]) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.UNIMPLEMENTED, "NOT_SUPPORTED", f"not supported here: {_summary(violations)}", violations
    )


def already_exists(request_id: str) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.ALREADY_EXISTS,
        "REQUEST_ID_IN_USE",
        f"request id {request_id!r} belongs to a request still running; ids must be unique while active",
        [FieldViolation("request_id", "already in use")],
    )


def overloaded(request_id: str, message: str) -> ServiceError:
    """The engine's door: the server is full (backend.common.door)."""
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED", message, retry_after_s=1.0)


def caller_over_limit(request_id: str, message: str) -> ServiceError:
    """The engine's door: one caller holds as many requests as it may (max_running_per_caller +
    max_queued_per_caller)."""
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "CALLER_OVER_LIMIT", message, retry_after_s=1.0)


def shed(request_id: str, message: str) -> ServiceError:
    """A queued request gave its place to a caller under its share, or to a more urgent request."""
    return ServiceError(
        grpc.StatusCode.RESOURCE_EXHAUSTED, "SHED", f"request {request_id}: {message}", retry_after_s=1.0,
        metadata={"request_id": request_id},
    )


def queue_timeout(request_id: str, message: str) -> ServiceError:
    """Not started within its queue_timeout_ms: another replica may start it at once."""
    return ServiceError(
        grpc.StatusCode.UNAVAILABLE, "QUEUE_TIMEOUT", f"request {request_id}: {message}", retry_after_s=0.0,
        metadata={"request_id": request_id},
    )


def priority_not_allowed(priority: int) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.PERMISSION_DENIED,
        "PRIORITY_NOT_ALLOWED",
        f"priority {priority} is above 0, which this server's priority_callers setting does not allow you",
        [FieldViolation("priority", "above 0 is for the callers priority_callers names")],
    )


def too_many_compiles(running: int) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "TOO_MANY_COMPILES",
        f"{running} large constraint compiles are under way, the most this server allows; retry shortly",
        retry_after_s=1.0,
    )


def compile_budget_exceeded(budget_s: float) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "COMPILE_BUDGET_EXCEEDED",
        f"the constraint took more than {budget_s:g} s to compile; it is still compiling and is cached "
        "when done, so a retry after it finishes starts at once",
        retry_after_s=budget_s,
    )


def unauthenticated(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED", message)


def engine_down(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, "ENGINE_DOWN", message, retry_after_s=0.0, replica_leaving=True)


def engine_gone(request_id: str, message: str) -> ServiceError:
    """The engine's process exited with the request in it (it is being started again)."""
    return engine_down(f"request {request_id}: {message}; retry")


def paused_too_long(request_id: str, message: str) -> ServiceError:
    """The caller stopped reading for too long: its slot went to others (not an engine fault)."""
    return ServiceError(
        grpc.StatusCode.ABORTED, "PAUSED_TOO_LONG", f"request {request_id}: {message}", metadata={"request_id": request_id}
    )


def deadline_exceeded(request_id: str, generated_tokens: int) -> ServiceError:
    """The caller's deadline ended the request; what streamed before stays delivered."""
    return ServiceError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "DEADLINE_EXCEEDED",
        f"request {request_id}: the caller's deadline passed after {generated_tokens} generated tokens",
        metadata={"request_id": request_id},
    )


def draining(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, "DRAINING", message, retry_after_s=0.0, replica_leaving=True)


def internal(request_id: str, message: str) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.INTERNAL,
        "ENGINE_FAILURE",
        f"request {request_id} failed in the engine: {message}",
        metadata={"request_id": request_id},
    )


def unexpected(request_id: str) -> ServiceError:
    """A bug: the caller learns only the request id to report; the log has the traceback."""
    return ServiceError(
        grpc.StatusCode.INTERNAL,
        "INTERNAL",
        f"request {request_id} failed on an unexpected server error; it is logged under this id",
        metadata={"request_id": request_id},
    )


_ENGINE_ERRORS = {
    ErrorKind.ENGINE_FAILURE: internal,
    ErrorKind.CONSTRAINT_FAILED: constraint_failed,
    ErrorKind.PAUSED_TOO_LONG: paused_too_long,
    ErrorKind.SHED: shed,
    ErrorKind.QUEUE_TIMEOUT: queue_timeout,
    ErrorKind.OVERLOADED: overloaded,
    ErrorKind.CALLER_OVER_LIMIT: caller_over_limit,
    ErrorKind.ENGINE_DOWN: engine_gone,
}
"""Each kind's ServiceError, from the request id and the engine's message."""


def from_engine(event: ErrorEvent, request_id: str) -> ServiceError:
    """The one table from an engine's error kind to the status the caller gets."""
    return _ENGINE_ERRORS[event.kind](request_id, event.message)


def from_exception(exc: BaseException, request_id: str) -> ServiceError:
    """The one table from an exception a handler let escape to the status the caller gets."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, ConstraintError):
        return invalid_constraint(exc)
    if isinstance(exc, EngineGone):
        return engine_gone(request_id, str(exc))
    if isinstance(exc, ChatTemplateError):
        return invalid_argument([FieldViolation("chat", f"the chat template refused it: {exc}")])
    return unexpected(request_id)
