"""The engine in a process of its own, on real `tokenspout serve` processes (the fake engine): what callers,
probes and the orchestrator see when the engine's process or a front end dies, and when the server is
stopped under load. Every wait is for an event (a message, a log line, a health change), never a time."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import threading

import grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.startup import ENGINE_DOWN_EXIT_CODE
from tests.harness.helpers import _details, error_reason, greedy, rpc_error, wait_for
from tests.harness.servers import RunningServer, start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PACE = ("--step-s", "0.01")
"""Seconds a fake engine step takes, so that streams outlast what a test does meanwhile."""
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
"""Each channel its own TCP connection (front ends on one port each take whole connections)."""


def long_request(tokens: int, request_id: str = "") -> pb.GenerateStreamRequest:
    request = greedy("The history of the printing press", max_new_tokens=tokens, ignore_eos=True)
    request.request_id = request_id
    return request


def engine_pid(server: RunningServer, start: int = 0) -> int:
    """The pid of the latest engine process the server's log names (after character `start`)."""
    found = wait_for(lambda: re.findall(r"engine \(pid (\d+)\) serving", server.log()[start:]), what="an engine")
    return int(found[-1])


def front_end_pids(server: RunningServer, count: int) -> dict[int, int]:
    """Each front end's pid, as the engine logged it when the front end said hello."""
    def named() -> dict[int, int] | None:
        found = {int(i): int(pid) for i, pid in re.findall(r"front end (\d+) \(pid (\d+)\) connected", server.log())}
        return found if len(found) >= count else None

    return wait_for(named, what=f"{count} front ends")


class HealthWatch:
    """A health Watch stream, read on a thread: every status the server sent, in order."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self.statuses: list[int] = []
        self._call = health_pb2_grpc.HealthStub(self._channel).Watch(health_pb2.HealthCheckRequest(), timeout=120)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for response in self._call:
                self.statuses.append(response.status)
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self._call.cancel()
        self._channel.close()


def test_a_killed_engine_ends_every_call_at_once_then_comes_back_and_serves(tmp_path):
    # One batch place: the second request waits in the queue when the engine dies.
    server = start_server(tmp_path, "--max-batch-size", "1", "--context-length", "512", faults=PACE, fake_engine=True)
    watch = HealthWatch(server.address)
    try:
        with grpc.insecure_channel(server.address) as channel, concurrent.futures.ThreadPoolExecutor(2) as pool:
            stub = pb_grpc.GenerationServiceStub(channel)
            wait_for(lambda: watch.statuses == [SERVING], what="health SERVING")
            running = stub.GenerateStream(long_request(500, "running"), timeout=60)
            next(running)
            waiting = pool.submit(rpc_error, lambda: stub.GenerateStream(long_request(5, "waiting"), timeout=60))
            wait_for(lambda: stub.GetServerStatus(pb.GetServerStatusRequest()).queued_requests == 1, what="a queued call")
            log_before = len(server.log())
            os.kill(engine_pid(server), signal.SIGKILL)
            for error in (rpc_error(lambda: list(running)), waiting.result(timeout=60)):
                assert error.code() == grpc.StatusCode.UNAVAILABLE and error_reason(error) == "ENGINE_DOWN", error
                (retry,) = _details(error, error_details_pb2.RetryInfo)
                assert retry.retry_delay.ToTimedelta().total_seconds() == 0  # at once: another replica, or here later
            wait_for(lambda: watch.statuses[-1:] == [SERVING] and NOT_SERVING in watch.statuses, 60, "health back")
            assert watch.statuses == [SERVING, NOT_SERVING, SERVING]
            assert engine_pid(server, log_before)  # a new engine process
            done = list(stub.GenerateStream(long_request(5, "after"), timeout=60))
            assert done[-1].finish.reason == pb.FinishReason.FINISH_REASON_MAX_TOKENS
            status = stub.GetServerStatus(pb.GetServerStatusRequest())
            assert status.engine_restarts == 1 and status.running_sequences == status.queued_requests == 0
        log = server.log()
        assert "exited with -9" in log and "starting the engine again (restart 1)" in log
    finally:
        watch.close()
        assert stop_server(server) == 0, server.log()


def test_an_engine_that_keeps_dying_ends_the_server_non_zero_for_a_restart(tmp_path):
    server = start_server(tmp_path, "--max-engine-restarts", "1", "--context-length", "512",
                          faults=("--kill-engine-after-steps", "3"), fake_engine=True)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            error = rpc_error(lambda: stub.GenerateStream(long_request(50), timeout=60))  # the engine dies at step 4
            assert error.code() == grpc.StatusCode.UNAVAILABLE and error_reason(error) == "ENGINE_DOWN", error
            server.wait_for_log("the engine is back", 60)  # this front end serves again
            error = rpc_error(lambda: stub.GenerateStream(long_request(50), timeout=60))  # and again: given up
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert server.process.wait(timeout=60) == ENGINE_DOWN_EXIT_CODE, server.log()
        assert "the engine died 2 times in a row: giving up" in server.log()
    finally:
        stop_server(server)


def test_a_front_end_that_dies_leaves_the_others_serving_and_the_engine_drops_its_requests(tmp_path):
    server = start_server(tmp_path, "--front-ends", "2", "--max-batch-size", "16", "--context-length", "512",
                          faults=PACE, fake_engine=True)
    channels = [grpc.insecure_channel(server.address, options=OWN_CONNECTION) for _ in range(16)]
    try:
        pids = front_end_pids(server, 2)
        calls = [pb_grpc.GenerationServiceStub(c).GenerateStream(long_request(400, f"s{i}"), timeout=120)
                 for i, c in enumerate(channels)]
        for call in calls:
            next(call)  # every stream running: the kernel spread the 16 connections over the two front ends
        os.kill(pids[1], signal.SIGKILL)
        outcomes = []
        for call in calls:
            try:
                outcomes.append(list(call)[-1].finish.reason)
            except grpc.RpcError as error:
                outcomes.append(error.code())
        finished = outcomes.count(pb.FinishReason.FINISH_REASON_MAX_TOKENS)
        cut = outcomes.count(grpc.StatusCode.UNAVAILABLE)
        assert finished + cut == 16 and finished >= 1 and cut >= 1, outcomes
        server.wait_for_log(f"front end 1 (pid {pids[1]}) gone: {cut} requests cancelled")
        server.wait_for_log("starting front end 1 again")
        with grpc.insecure_channel(server.address) as channel:  # no ghost: the dead front end's sequences are gone
            stub = pb_grpc.GenerationServiceStub(channel)
            status = stub.GetServerStatus(pb.GetServerStatusRequest())
            assert status.running_sequences == status.queued_requests == 0 and status.cancelled_total == cut
    finally:
        for channel in channels:
            channel.close()
        assert stop_server(server) == 0, server.log()


def test_sigterm_under_load_lets_every_admitted_stream_finish_then_stops_the_engine(tmp_path):
    server = start_server(tmp_path, "--front-ends", "2", "--max-batch-size", "8", "--context-length", "512",
                          "--grace-period-s", "60", faults=PACE, fake_engine=True)
    channels = [grpc.insecure_channel(server.address, options=OWN_CONNECTION) for _ in range(6)]
    try:
        calls = [pb_grpc.GenerationServiceStub(c).GenerateStream(long_request(150, f"s{i}"), timeout=120)
                 for i, c in enumerate(channels)]
        for call in calls:
            next(call)
        server.process.send_signal(signal.SIGTERM)
        for call in calls:
            assert list(call)[-1].finish.reason == pb.FinishReason.FINISH_REASON_MAX_TOKENS
        assert server.process.wait(timeout=60) == 0, server.log()
        log = server.log()
        assert log.index("draining") < log.index("engine stopping") and "Traceback" not in log, log
    finally:
        for channel in channels:
            channel.close()
        stop_server(server)


def test_one_callers_flood_through_two_front_ends_is_one_caller_at_the_door(tmp_path):
    # A caller holds at most 2 running + 1 queued; held requests keep their places while the test counts.
    server = start_server(tmp_path, "--front-ends", "2", "--max-batch-size", "2", "--max-queued-requests", "8",
                          "--max-queued-per-caller", "1", "--context-length", "512",
                          faults=("--hold-requests-with-prefix", "held"), fake_engine=True)
    channels = [grpc.insecure_channel(server.address, options=OWN_CONNECTION) for _ in range(6)]
    calls = [pb_grpc.GenerationServiceStub(c).GenerateStream(long_request(50, f"held-{i}"), timeout=60)
             for i, c in enumerate(channels)]

    def first(call) -> str:
        try:
            next(call)
            return "streaming"
        except grpc.RpcError as error:
            return error_reason(error) if error.code() != grpc.StatusCode.CANCELLED else "cancelled"

    try:
        with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
            outcomes = [pool.submit(first, call) for call in calls]
            refused = wait_for(lambda: [f.result() for f in outcomes if f.done()] if sum(f.done() for f in outcomes) >= 5
                               else None, 60, "two streams running and three refused")
            with grpc.insecure_channel(server.address) as channel:
                status = pb_grpc.GenerationServiceStub(channel).GetServerStatus(pb.GetServerStatusRequest())
            assert sorted(refused) == ["CALLER_OVER_LIMIT"] * 3 + ["streaming"] * 2, refused
            assert status.running_sequences == 2 and status.queued_requests == 1 and status.rejected_total == 3, status
            for call in calls:
                call.cancel()
    finally:
        for channel in channels:
            channel.close()
        assert stop_server(server) == 0, server.log()


def test_a_front_end_started_again_finds_the_constraints_the_engine_compiled(tmp_path):
    server = start_server(tmp_path, "--context-length", "512", fake_engine=True)
    constraint = pb.Constraint(json_schema='{"type": "object", "properties": {"n": {"type": "integer"}}}')
    try:
        with grpc.insecure_channel(server.address) as channel:
            first = pb_grpc.GenerationServiceStub(channel).CompileConstraint(
                pb.CompileConstraintRequest(constraint=constraint), timeout=30)
        assert not first.cached
        (old,) = front_end_pids(server, 1).values()
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: old != front_end_pids(server, 1)[0], 60, "a new front end")
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            again = wait_for(lambda: _compiled(stub, constraint), 60, "the new front end serving")
        assert again.cached and again.compile_ms == 0
    finally:
        assert stop_server(server) == 0, server.log()


def _compiled(stub, constraint: pb.Constraint) -> pb.CompileConstraintResponse | None:
    try:
        return stub.CompileConstraint(pb.CompileConstraintRequest(constraint=constraint), timeout=30)
    except grpc.RpcError as error:  # the port is closed until the new front end listens
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        return None


def test_killing_the_supervisor_takes_the_engine_and_the_front_ends_with_it(tmp_path):
    """kill -9 (or an OOM kill) of `tokenspout serve` leaves no orphan holding the port or the model."""
    server = start_server(tmp_path, "--front-ends", "2", "--context-length", "512", fake_engine=True)
    children = [engine_pid(server), *front_end_pids(server, 2).values()]
    server.process.kill()
    server.process.wait(timeout=30)
    wait_for(lambda: not any(_alive(pid) for pid in children), 30, "the children to end")
    error = rpc_error(lambda: pb_grpc.GenerationServiceStub(grpc.insecure_channel(server.address)).GetServerStatus(
        pb.GetServerStatusRequest(), timeout=5))
    assert error.code() == grpc.StatusCode.UNAVAILABLE  # nobody listens on the port any more


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_an_id_sent_again_right_after_a_cancel_gets_its_own_events_not_the_cancelled_calls(tmp_path):
    """The engine process routes events to a front end by request id. A caller that cancels a call and sends its id
    again at once must get its new request's events: the cancelled one's CANCELLED finish, still on its way, used to
    reach the new call, which ended with it while its own sequence ran on as a ghost. The id now stays the old
    request's until the engine's last event for it arrives (the new call runs under another engine id meanwhile)."""
    server = start_server(tmp_path, "--max-batch-size", "4", "--context-length", "512", faults=PACE, fake_engine=True)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            for round_ in range(5):
                call = stub.GenerateStream(long_request(200, "again"), timeout=30)
                next(call)
                call.cancel()
                messages = list(stub.GenerateStream(long_request(6, "again"), timeout=30))
                finish = messages[-1].finish
                assert finish.reason == pb.FINISH_REASON_MAX_TOKENS and messages[-1].generated_tokens == 6, (round_, finish)
        wait_for(lambda: not pb_grpc.GenerationServiceStub(grpc.insecure_channel(server.address)).GetServerStatus(
            pb.GetServerStatusRequest(), timeout=10).running_sequences, what="no sequence left running")
        assert "still ran: ended" not in server.log()
    finally:
        assert stop_server(server) == 0, server.log()
