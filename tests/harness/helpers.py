"""Small helpers the end-to-end tests share."""

from __future__ import annotations

import time

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from tokenspout.v1 import generation_pb2 as pb

SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 256), ("grpc.http2.bdp_probe", 0)]
"""Channel options for a caller that stops reading: the server feels it after a few messages."""


def greedy(prompt: str, max_new_tokens: int = 24, **stopping) -> pb.GenerateStreamRequest:
    return pb.GenerateStreamRequest(
        prompt=prompt,
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, **stopping),
        output=pb.OutputOptions(return_token_ids=True),
    )


def stream(stub, request: pb.GenerateStreamRequest, timeout: float = 120) -> list[pb.GenerateStreamResponse]:
    return list(stub.GenerateStream(request, timeout=timeout))


def text_of(messages: list[pb.GenerateStreamResponse]) -> str:
    return "".join(m.text for m in messages)


def token_ids_of(messages: list[pb.GenerateStreamResponse]) -> list[int]:
    return [t.id for m in messages for t in m.tokens]


def rpc_error(call) -> grpc.RpcError:
    """Runs `call` (which must fail) and returns its RpcError."""
    try:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "ListFields"):
            list(result)
    except grpc.RpcError as error:
        return error
    raise AssertionError("the call succeeded")


def _details(error: grpc.RpcError, kind):
    status = rpc_status.from_call(error)
    assert status is not None, "no google.rpc.Status details"
    found = []
    for detail in status.details:
        if detail.Is(kind.DESCRIPTOR):
            found.append(kind())
            detail.Unpack(found[-1])
    return found


def error_reason(error: grpc.RpcError) -> str:
    """The ErrorInfo reason every error carries."""
    (info,) = _details(error, error_details_pb2.ErrorInfo)
    return info.reason


def bad_request_fields(error: grpc.RpcError) -> dict[str, str]:
    """The BadRequest field violations of an error, field -> description."""
    assert error_reason(error), "every error carries an ErrorInfo"
    return {v.field: v.description for bad in _details(error, error_details_pb2.BadRequest) for v in bad.field_violations}


def wait_for(condition, timeout_s: float = 30.0, what: str = "condition"):
    """Polls `condition` until it returns something true, and returns that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")
