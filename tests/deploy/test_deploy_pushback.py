"""RESOURCE_EXHAUSTED carries grpc-retry-pushback-ms, and gRPC's own retry policy obeys it:
a client retrying with the shipped service config comes back when the server said, not at once."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest

from tests.harness.helpers import error_reason, greedy
from tests.harness.proxies import SERVICE_CONFIG
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc


@pytest.fixture
def one_slot(tmp_path):
    # The fake engine, paced like a small model: the blocker outlasts the checks.
    server = start_server(tmp_path, "--max-batch-size", "1", "--max-queued-requests", "0", "--context-length", "512",
                          faults=("--step-s", "0.01"), fake_engine=True)
    yield server
    assert stop_server(server) == 0, server.log()


def _status(stub) -> pb.GetServerStatusResponse:
    return stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10)


def test_a_full_server_sends_pushback(one_slot):
    with grpc.insecure_channel(one_slot.address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        blocker = stub.GenerateStream(greedy("Tell a long story.", max_new_tokens=400, ignore_eos=True), timeout=120)
        next(blocker)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.GenerateStream(greedy("Hi", max_new_tokens=2), timeout=30))
        blocker.cancel()
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_reason(refused.value) == "OVERLOADED"
    assert dict(refused.value.trailing_metadata())["grpc-retry-pushback-ms"] == "1000"


def test_the_retry_policy_waits_for_the_pushback(one_slot):
    """The policy's own backoff is 10 ms; the server asks for 1 s. The slot frees right after the
    refusal: a retry 10 ms later would be refused again, one after 1 s runs."""
    config = json.loads(SERVICE_CONFIG.read_text())
    (method,) = config["methodConfig"]
    method["retryPolicy"].update(maxAttempts=2, initialBackoff="0.01s", maxBackoff="0.01s")
    options = [("grpc.service_config", json.dumps({"methodConfig": [method]}))]
    with grpc.insecure_channel(one_slot.address, options=options) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        blocker = stub.GenerateStream(greedy("Tell a long story.", max_new_tokens=400, ignore_eos=True), timeout=120)
        next(blocker)
        outcome = {}

        def retried_call():
            try:
                outcome["messages"] = list(stub.GenerateStream(greedy("Hi", max_new_tokens=2), timeout=60))
            except grpc.RpcError as error:
                outcome["error"] = error

        caller = threading.Thread(target=retried_call)
        caller.start()
        deadline = time.monotonic() + 30
        while _status(stub).rejected_total < 1:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        blocker.cancel()
        caller.join(timeout=60)
        assert "error" not in outcome, outcome.get("error")
        assert outcome["messages"][-1].generated_tokens == 2
        assert _status(stub).rejected_total == 1, "the retry came before the pushback had passed"
