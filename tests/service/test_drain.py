"""Visible drain and liveness on real `tokenspout serve` processes (on the fake engine): what a load
balancer and callers see; and, in process, when the drain moves on."""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.lifecycle import Phase
from tests.harness.helpers import SMALL_WINDOW, error_reason, greedy, rpc_error, wait_for
from tests.harness.inprocess_server import start_fake
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

FINISH = pb.FinishReason
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PROMPT = "The history of the printing press"
MODEL_PACE = ("--step-s", "0.01")
"""The fake engine's seconds per step where a stream must outlast the checks, as a model's would."""


def long_request(max_new_tokens: int, request_id: str = "") -> pb.GenerateStreamRequest:
    request = greedy(PROMPT, max_new_tokens=max_new_tokens, ignore_eos=True)
    request.request_id = request_id
    return request


def health_of(address: str) -> int:
    with grpc.insecure_channel(address) as channel:  # a fresh connection: the listener must still be open
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def wait_for_health(address: str, wanted: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while health_of(address) != wanted:
        assert time.monotonic() < deadline, f"health never became {wanted}"
        time.sleep(0.02)


def refused_on_a_fresh_connection(address: str) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        return rpc_error(lambda: pb_grpc.GenerationServiceStub(channel).GenerateStream(greedy("Hi"), timeout=10))


def test_drain_is_visible_while_running_streams_finish(tmp_path):
    server = start_server(tmp_path, "--max-batch-size", "4", "--context-length", "512", "--grace-period-s", "60",
                          faults=MODEL_PACE, fake_engine=True)
    with grpc.insecure_channel(server.address) as channel, \
            grpc.insecure_channel(server.address, options=SMALL_WINDOW) as unread:
        stub = pb_grpc.GenerationServiceStub(channel)
        # Unread on a small window, the streams pause and stay running however long the checks take.
        calls = [pb_grpc.GenerationServiceStub(unread).GenerateStream(long_request(250, f"running-{i}"), timeout=120)
                 for i in range(2)]
        for call in calls:
            next(call)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=120)
        assert next(watch).status == SERVING
        server.process.send_signal(signal.SIGTERM)
        wait_for_health(server.address, NOT_SERVING)
        # The listener is open: new calls get a status, not a refused connection.
        for error in (refused_on_a_fresh_connection(server.address),
                      rpc_error(lambda: stub.GenerateStream(greedy("Hi"), timeout=10)),
                      rpc_error(lambda: stub.Tokenize(pb.TokenizeRequest(text="Hi"), timeout=10))):
            assert error.code() == grpc.StatusCode.UNAVAILABLE and error_reason(error) == "DRAINING"
            # Envoy reads this and takes the replica out of its balancing at once (deploy/envoy).
            assert ("x-envoy-immediate-health-check-fail", "true") in error.trailing_metadata()
        status = stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10)
        assert status.draining and status.running_sequences == 2  # the streams were still running then
        for call in calls:
            rest = list(call)
            assert rest[-1].finish.reason == FINISH.FINISH_REASON_MAX_TOKENS and rest[-1].generated_tokens == 250
        # A watcher saw NOT_SERVING, and its stream ends cleanly when the server closes.
        assert [m.status for m in watch] == [NOT_SERVING]
    assert server.process.wait(timeout=60) == 0, server.log()
    assert "Traceback" not in server.log()


def test_streams_still_running_at_the_grace_end_get_unavailable(tmp_path):
    server = start_server(tmp_path, "--max-batch-size", "2", "--context-length", "1024", "--grace-period-s", "1",
                          faults=("--hold-requests-with-prefix", "too-long"), fake_engine=True)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        call = stub.GenerateStream(long_request(1000, "too-long"), timeout=120)
        first = next(call)
        server.process.send_signal(signal.SIGTERM)
        messages = []
        try:
            for message in call:
                messages.append(message)
            raise AssertionError("the stream was not cut")
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE and error_reason(error) == "DRAINING"
        assert not any(m.HasField("finish") for m in [first, *messages])
    assert server.process.wait(timeout=60) == 0, server.log()
    log = server.log()
    assert "grace period over: 1 requests end with UNAVAILABLE" in log
    assert "Traceback" not in log and "CancelledError" not in log, log


def test_a_dead_engine_thread_in_the_servers_process_flips_health_and_the_process_exits_non_zero(tmp_path):
    # One slot: the second request waits in the queue when the engine dies.
    server = start_server(tmp_path, "--max-batch-size", "1", "--context-length", "512", "--engine-process", "false",
                          faults=("--kill-engine-after-steps", "20", *MODEL_PACE), fake_engine=True)
    try:
        assert health_of(server.address) == SERVING
        with grpc.insecure_channel(server.address) as channel, concurrent.futures.ThreadPoolExecutor(2) as pool:
            stub = pb_grpc.GenerationServiceStub(channel)
            running = stub.GenerateStream(long_request(200, "running"), timeout=60)
            next(running)
            waiting = pool.submit(rpc_error, lambda: stub.GenerateStream(long_request(5, "waiting"), timeout=60))
            cut = rpc_error(lambda: list(running))
            for error in (cut, waiting.result(timeout=60)):
                assert error.code() == grpc.StatusCode.UNAVAILABLE and error_reason(error) == "ENGINE_DOWN", error
            assert health_of(server.address) == NOT_SERVING
            error = refused_on_a_fresh_connection(server.address)
            assert error.code() == grpc.StatusCode.UNAVAILABLE and error_reason(error) == "ENGINE_DOWN"
        assert server.process.wait(timeout=60) == 3, server.log()
        assert "the engine thread died" in server.log()
    finally:
        stop_server(server)


# Phase.STOPPED is set a few event-loop turns after the last call ends when the drain waits for that
# event; a drain that polled, or waited out the grace period, would still be DRAINING then.
_LOOP_TURNS = 10


def test_the_drain_moves_on_as_soon_as_the_last_stream_ends():
    server = start_fake("--max-batch-size", "4", "--context-length", "512", "--grace-period-s", "600")
    held = server.engine.plan("last-", hold_after=1)
    lifecycle, loop = server.server.lifecycle, server.loop
    phase_after_the_last_call: list[Phase] = []
    call_in_flight = lifecycle.call

    @contextlib.contextmanager
    def observed_call():
        with call_in_flight():
            yield
        if not lifecycle.in_flight:
            loop.call_soon(look_after, _LOOP_TURNS)

    def look_after(turns: int) -> None:
        if turns:
            loop.call_soon(look_after, turns - 1)
        else:
            phase_after_the_last_call.append(lifecycle.phase)

    lifecycle.call = observed_call
    try:
        with grpc.insecure_channel(server.address) as channel:
            call = pb_grpc.GenerationServiceStub(channel).GenerateStream(long_request(50, "last-1"), timeout=60)
            next(call)
            drained = server.drain()
            wait_for(lambda: server.on_loop(lambda: lifecycle.phase) is Phase.DRAINING, what="the drain to start")
            assert not drained.done()  # it waits for the running stream
            server.engine.let_go(held)
            rest = list(call)
        assert rest[-1].finish.reason == FINISH.FINISH_REASON_MAX_TOKENS and rest[-1].generated_tokens == 50
        drained.result(timeout=60)
    finally:
        server.close()
    assert phase_after_the_last_call == [Phase.STOPPED]
