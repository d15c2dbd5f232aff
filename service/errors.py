"""Errors the service answers with, and their one mapping to gRPC status.

Every error carries google.rpc details (AIP-193): always an ErrorInfo with a
stable reason, plus BadRequest field violations or RetryInfo where they apply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "tokenspout.v1"


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

    def __str__(self) -> str:
        return self.message

    def to_status(self) -> grpc.Status:
        details = [error_details_pb2.ErrorInfo(reason=self.reason, domain=DOMAIN, metadata=self.metadata)]
        if self.violations:
            details.append(
                error_details_pb2.BadRequest(
                    field_violations=[
                        error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                        for v in self.violations
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
        status = status_pb2.Status(code=getattr(code_pb2, self.code.name), message=self.message, details=packed)
        return rpc_status.to_status(status)


def _summary(violations: list[FieldViolation]) -> str:
    return "; ".join(f"{v.field}: {v.description}" for v in violations)


def invalid_argument(violations: list[FieldViolation]) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", f"invalid request: {_summary(violations)}", violations
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
        f"model {model!r} is not served here; see GetModelInfo",
        [FieldViolation("model", "unknown model")],
        metadata={"model": model[:256]},
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


def overloaded(in_flight: int, capacity: int, retry_after_s: float = 1.0) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "OVERLOADED",
        f"the server is full ({in_flight} of {capacity} requests running or queued); retry later",
        retry_after_s=retry_after_s,
    )


def unavailable(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, "DRAINING", message, retry_after_s=0.0)


def internal(request_id: str, message: str) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.INTERNAL,
        "ENGINE_FAILURE",
        f"request {request_id} failed in the engine: {message}",
        metadata={"request_id": request_id},
    )
