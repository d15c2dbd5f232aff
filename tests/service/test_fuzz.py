"""Property-based fuzzing of the real server: whatever a caller sends, only documented codes come back.

Random GenerateStreamRequests across every field (tests/harness/hostile_requests.py) and
random bytes in place of any request: never UNKNOWN, never INTERNAL, every error
small enough to deliver, health SERVING throughout, and no traceback in the log.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings

from tests.harness.hostile_requests import ALLOWED_CODES, MAX_ERROR_BYTES, generate_requests, raw_bytes, tokenize_requests
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

FUZZ = settings(
    max_examples=300, deadline=None, database=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
METHODS = [
    f"/tokenspout.v1.GenerationService/{name}"
    for name in ("GenerateStream", "Generate", "Tokenize", "GetModelInfo", "CompileConstraint", "Cancel", "GetServerStatus")
] + ["/grpc.health.v1.Health/Check"]
STREAMING = {"/tokenspout.v1.GenerationService/GenerateStream"}


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory, model_path):
    server = start_server(tmp_path_factory.mktemp("fuzz"), "--context-length", "512", "--max-batch-size", "4")
    yield server
    assert stop_server(server) == 0, server.log()
    assert "Traceback" not in server.log(), server.log()[-4000:]


@pytest.fixture(scope="module")
def fuzz_channel(fuzzed_server):
    with grpc.insecure_channel(fuzzed_server.address) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        yield channel


def check_error(error: grpc.RpcError) -> None:
    assert error.code() in ALLOWED_CODES, (error.code(), error.details())
    if error.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
        status = rpc_status.from_call(error)
        assert status is not None, "an error without google.rpc details"
        assert status.ByteSize() <= MAX_ERROR_BYTES, (status.ByteSize(), error.details()[:200])


def consume(call, max_messages: int = 4) -> None:
    """Reads a few messages of a stream; a long generation is then cancelled."""
    try:
        for count, _ in enumerate(call, 1):
            if count >= max_messages:
                call.cancel()
                break
    except grpc.RpcError as error:
        check_error(error)


def assert_serving(channel) -> None:
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_fuzzed_requests_get_only_documented_codes(fuzz_channel):
    stub = pb_grpc.GenerationServiceStub(fuzz_channel)

    @FUZZ
    @given(request=generate_requests())
    def property_(request):
        consume(stub.GenerateStream(request, timeout=20))

    property_()
    assert_serving(fuzz_channel)


def test_fuzzed_tokenize_calls_get_only_documented_codes(fuzz_channel):
    stub = pb_grpc.GenerationServiceStub(fuzz_channel)

    @settings(FUZZ, max_examples=150)
    @given(request=tokenize_requests())
    def property_(request):
        try:
            response = stub.Tokenize(request, timeout=20)
        except grpc.RpcError as error:
            check_error(error)
            return
        if request.return_offsets and request.texts:
            assert all(len(r.offsets.byte_ends) == r.count for r in response.results)

    property_()
    assert_serving(fuzz_channel)


def test_random_bytes_in_place_of_any_request_get_only_documented_codes(fuzz_channel):
    @FUZZ
    @given(data=raw_bytes)
    def property_(data):
        for method in METHODS:
            if method in STREAMING:
                consume(fuzz_channel.unary_stream(method)(data, timeout=10))
                continue
            try:
                fuzz_channel.unary_unary(method)(data, timeout=10)
            except grpc.RpcError as error:
                check_error(error)

    property_()
    assert_serving(fuzz_channel)
