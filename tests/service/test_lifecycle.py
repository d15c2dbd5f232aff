"""Cancellation, deadlines, backpressure, overload, drain and faults: on the fake engine (in process, or as
a `tokenspout serve` process where signals matter), paced like a small model where a stream must outlast
the checks; the storm of cancellations on the real model, whose cache it checks."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import signal
import threading
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from backend.config import EngineConfig
from service.config import ServeConfig
from service.errors import ServiceError
from service.generation import GenerationServicer
from service.lifecycle import HealthServicer, Lifecycle
from service.validate import RequestValidator
from tests.harness.fake_engine import FakeEngine
from tests.harness.faults import failing_requests
from tests.harness.helpers import SMALL_WINDOW, greedy, rpc_error, stream, text_of, token_ids_of, wait_for
from tests.harness.inprocess_server import start_fake
from tests.harness.servers import SERVER_CONTEXT_LENGTH, start_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

FINISH = pb.FinishReason
PROMPT = "The history of the printing press"
SMALL = ("--max-batch-size", "4", "--max-queued-requests", "2", "--stream-buffer-events", "8",
         "--context-length", "512")
MODEL_PACE_S = 0.01
"""The fake engine's seconds per step, so that streams outlast the checks as a model's would."""


@pytest.fixture(scope="module")
def small_server():
    """Four slots, a queue of two and small stream buffers, so limits are easy to reach."""
    server = start_fake(*SMALL, step_s=MODEL_PACE_S)
    failing_requests(server.engine, "fail-")
    yield server
    server.close()


@pytest.fixture(scope="module")
def small_stub(small_server):
    with grpc.insecure_channel(small_server.address) as channel:
        yield pb_grpc.GenerationServiceStub(channel)


def status(stub) -> pb.GetServerStatusResponse:
    return stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10)


def wait_until_idle(stub, timeout: float = 30) -> pb.GetServerStatusResponse:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = status(stub)
        if current.running_sequences == current.queued_requests == current.cache_tokens_used == 0:
            return current
        time.sleep(0.02)
    raise AssertionError(f"engine still busy: {current}")


def long_request(request_id: str = "", max_new_tokens: int = 200) -> pb.GenerateStreamRequest:
    request = greedy(PROMPT, max_new_tokens=max_new_tokens, ignore_eos=True)
    request.request_id = request_id
    return request


def test_a_hundred_streams_cancelled_at_random_points_leave_nothing_behind(server, stub):
    rng = random.Random(1234)
    plans = [(i, rng.choice(["cancel", "drop_channel", "deadline"]), rng.randint(1, 12)) for i in range(100)]

    def run(plan) -> str:
        index, how, after = plan
        request = long_request(f"storm-{index}", max_new_tokens=300)
        if how == "deadline":
            try:
                list(stub.GenerateStream(request, timeout=after * 0.02))
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            else:
                raise AssertionError(f"storm-{index} outlived its deadline")
            return how
        channel = grpc.insecure_channel(server.address)
        call = pb_grpc.GenerationServiceStub(channel).GenerateStream(request, timeout=60)
        for _, message in zip(range(after), call):
            assert not message.HasField("finish")
        if how == "cancel":
            call.cancel()
        channel.close()  # for drop_channel, this is the only signal the server gets
        return how

    start = status(stub)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        kinds = list(pool.map(run, plans))
    idle = wait_until_idle(stub)
    # Every stream that left before its end was cancelled in the engine (a deadline may pass in the queue).
    assert idle.cancelled_total - start.cancelled_total >= kinds.count("cancel") + kinds.count("drop_channel")
    # Every cell is free again: nothing leaked from the cancelled sequences.
    assert idle.paused_sequences == 0 and idle.cache_tokens_free == idle.max_batch_size * SERVER_CONTEXT_LENGTH
    # Each cancellation freed its sequence before the next engine step.
    assert idle.max_cancel_latency_steps <= 1
    # The next request runs alone: one step per token (the first comes with its prefill), but for the
    # proposed tokens accepted in another token's step (speculative decoding).
    before = status(stub).engine_steps
    messages = stream(stub, greedy(PROMPT, max_new_tokens=32, ignore_eos=True))
    assert messages[-1].generated_tokens == 32
    assert status(stub).engine_steps - before == 32 - messages[-1].finish.usage.accepted_draft_tokens


def test_cancel_rpc_ends_the_stream_with_cancelled(small_server, small_stub):
    small_server.engine.plan("cancel-me", hold_after=1)  # still running when the Cancel comes, however late
    call = small_stub.GenerateStream(long_request("cancel-me"), timeout=60)
    first = next(call)
    response = small_stub.Cancel(pb.CancelRequest(request_ids=["cancel-me", "never-seen"]))
    assert list(response.cancelled) == ["cancel-me"] and list(response.not_found) == ["never-seen"]
    rest = list(call)
    assert rest[-1].finish.reason == FINISH.FINISH_REASON_CANCELLED
    assert first.generated_tokens >= 1 and rest[-1].generated_tokens < 200
    assert rest[-1].finish.usage.completion_tokens == rest[-1].generated_tokens
    wait_until_idle(small_stub)


def test_a_request_id_in_use_is_refused(small_server, small_stub):
    small_server.engine.plan("twice", hold_after=1)  # still running when the second comes, however late
    call = small_stub.GenerateStream(long_request("twice"), timeout=60)
    next(call)
    error = rpc_error(lambda: small_stub.GenerateStream(long_request("twice"), timeout=10))
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    call.cancel()
    wait_until_idle(small_stub)


def fill_the_batch(server, stub, count: int = 4) -> list:
    """Streams that hold every slot until cancelled (held after their first token: none ends by itself)."""
    server.engine.plan("filler-", hold_after=1)
    calls = [stub.GenerateStream(long_request(f"filler-{i}-{time.monotonic_ns()}", 300), timeout=120) for i in range(count)]
    for call in calls:
        next(call)
    return calls


class _CallerContext:
    """What the servicer reads of a call: no metadata, and the caller's time left."""

    def __init__(self, time_remaining: float) -> None:
        self._time_remaining = time_remaining

    def invocation_metadata(self) -> tuple:
        return ()

    def time_remaining(self) -> float:
        return self._time_remaining


def test_the_callers_deadline_fails_the_call_when_the_engine_ends_it():
    """Over the wire, gRPC's own deadline timers race the engine's deadline check, and a loaded
    caller once got an OK response past its deadline. In process, only the engine's check can end
    the call, and it must fail with DEADLINE_EXCEEDED just as gRPC's would."""
    config = ServeConfig(engine=EngineConfig(context_length=512, max_batch_size=2))
    engine = FakeEngine(config.engine, step_s=MODEL_PACE_S)
    servicer = GenerationServicer(engine, RequestValidator(engine.info), config, Lifecycle(HealthServicer()))

    async def generate(time_remaining: float, **stopping) -> pb.GenerateResponse:
        request = pb.GenerateRequest.FromString(greedy(PROMPT, ignore_eos=True, **stopping).SerializeToString())
        return await servicer.Generate(request, _CallerContext(time_remaining))

    async def both() -> tuple[ServiceError, pb.GenerateResponse]:
        with pytest.raises(ServiceError) as past_deadline:
            await generate(0.5, max_new_tokens=400)
        # A time limit of the request's own, shorter than the deadline, still ends it normally.
        return past_deadline.value, await generate(60, max_new_tokens=400, time_limit_ms=300)

    try:
        error, limited = asyncio.run(both())
    finally:
        engine.close()
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED and error.reason == "DEADLINE_EXCEEDED"
    assert "deadline passed after" in error.message
    assert limited.finish.reason == FINISH.FINISH_REASON_TIME_LIMIT and limited.generated_tokens < 400
    assert engine.stats.running_sequences == 0


def test_a_deadline_that_passes_in_the_queue_never_starts(small_server, small_stub):
    calls = fill_the_batch(small_server, small_stub)
    started = status(small_stub).started_total
    error = rpc_error(lambda: small_stub.GenerateStream(long_request("late"), timeout=0.3))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for call in calls:
        call.cancel()
    wait_until_idle(small_stub)
    assert status(small_stub).started_total == started  # "late" never entered the batch


def test_heartbeats_while_queued(small_server, small_stub):
    calls = fill_the_batch(small_server, small_stub)
    request = greedy(PROMPT, max_new_tokens=2)
    request.output.heartbeat_interval_ms = 50
    waiting = small_stub.GenerateStream(request, timeout=60)
    beats = [next(waiting) for _ in range(3)]
    assert all(m.heartbeat and not m.text and not m.HasField("finish") for m in beats)
    for call in calls:
        call.cancel()
    rest = [m for m in waiting if not m.heartbeat]
    assert rest[-1].finish.reason == FINISH.FINISH_REASON_MAX_TOKENS and rest[-1].generated_tokens == 2


def test_overload_is_refused_at_once_with_retry_info(small_server, small_stub):
    barrier = threading.Barrier(12)
    # The admitted ones hold their places until every call has its answer: none ends early and lets another in.
    admitted = small_server.engine.plan("load-", hold_after=1)

    def run(index: int):
        barrier.wait()
        try:
            return stream(small_stub, long_request(f"load-{index}", 150), timeout=120)
        except grpc.RpcError as error:
            return error

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        calls = [pool.submit(run, index) for index in range(12)]
        wait_for(lambda: (status(small_stub).running_sequences, status(small_stub).queued_requests) == (4, 2),
                 what="4 running and 2 queued")
        wait_for(lambda: sum(call.done() for call in calls) == 12 - 6, what="the others to be refused")
        small_server.engine.let_go(admitted)
        results = [call.result() for call in calls]
    rejected = [r for r in results if isinstance(r, grpc.RpcError)]
    completed = [r for r in results if not isinstance(r, grpc.RpcError)]
    assert rejected and len(completed) >= 6  # 4 slots + 2 queued were admitted
    for error in rejected:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = rpc_status.from_call(error).details
        assert any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in details)
    for messages in completed:
        assert messages[-1].finish.reason == FINISH.FINISH_REASON_MAX_TOKENS and messages[-1].generated_tokens == 150
    assert status(small_stub).rejected_total >= len(rejected)
    wait_until_idle(small_stub)


def test_a_slow_reader_pauses_and_never_stalls_the_others(small_server, small_stub):
    fast = [greedy(p, max_new_tokens=96, ignore_eos=True) for p in ("Water boils at", "The moon is", "Cats are", "Rain falls")]
    slow_request = greedy("Mountains are", max_new_tokens=96, ignore_eos=True)
    solo_slow = text_of(stream(small_stub, slow_request))

    def steps_for_fast_streams(with_slow_reader: bool) -> tuple[int, list, int]:
        paused_seen = [0]
        slow_messages: list = []
        slow_thread = None
        watching = threading.Event()

        def watch_pauses():
            while not watching.wait(0.02):
                paused_seen[0] = max(paused_seen[0], status(small_stub).paused_sequences)

        watcher = threading.Thread(target=watch_pauses)
        watcher.start()
        if with_slow_reader:
            # A small HTTP/2 window, so the server feels the slow reader quickly.
            channel = grpc.insecure_channel(small_server.address, options=SMALL_WINDOW)
            slow_call = pb_grpc.GenerationServiceStub(channel).GenerateStream(slow_request, timeout=120)
            slow_messages.append(next(slow_call))

            def read_slowly():
                for message in slow_call:
                    slow_messages.append(message)
                    time.sleep(0.3)
                channel.close()

            slow_thread = threading.Thread(target=read_slowly)
            # Parked while the fast streams are counted: a burst of its own after a read, just
            # before or after them, would add steps that say nothing about its neighbours.
            wait_for(lambda: status(small_stub).paused_sequences == 1, what="the slow reader to be paused")
        # They start at the same step however the threads are scheduled: steps count what they need, not when they came.
        small_server.engine.hold_steps()
        before = status(small_stub).engine_steps
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            running = [pool.submit(stream, small_stub, r) for r in fast[:3]]
            wait_for(lambda: status(small_stub).queued_requests == 3, what="the fast streams to queue")
            small_server.engine.run_steps()
            results = [r.result() for r in running]
        steps = status(small_stub).engine_steps - before
        if slow_thread is not None:
            slow_thread.start()  # it reads slowly from here, resuming and pausing again
        for messages in results:
            assert messages[-1].generated_tokens == 96
        if slow_thread is not None:
            slow_thread.join(timeout=60)
        watching.set()
        watcher.join()
        return steps, slow_messages, paused_seen[0]

    baseline_steps, _, _ = steps_for_fast_streams(False)
    steps, slow_messages, paused_seen = steps_for_fast_streams(True)
    assert steps <= baseline_steps + 1  # one prefill step at most for the slow stream's neighbours
    assert paused_seen == 1  # the slow reader's sequence was parked, cache kept
    counts = [m.generated_tokens for m in slow_messages]
    assert counts == sorted(counts) and counts[-1] == 96
    assert len(slow_messages) < 96  # what queued while it slept came in larger messages
    assert text_of(slow_messages) == solo_slow  # everything, in order
    wait_until_idle(small_stub)


def test_an_engine_fault_is_internal_and_leaves_others_running(small_server, small_stub):
    healthy = greedy(PROMPT, max_new_tokens=48, ignore_eos=True)
    solo = token_ids_of(stream(small_stub, healthy))
    call = small_stub.GenerateStream(healthy, timeout=60)
    messages = [next(call)]  # the healthy stream is running when the other one fails
    error = rpc_error(lambda: small_stub.GenerateStream(long_request("fail-on-purpose"), timeout=60))
    messages += list(call)
    assert error.code() == grpc.StatusCode.INTERNAL and "fail-on-purpose" in error.details()
    assert token_ids_of(messages) == solo
    with grpc.insecure_channel(small_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING


def test_sigterm_drains_running_streams_and_exits_zero(tmp_path):
    server = start_server(tmp_path, "--max-batch-size", "4", "--context-length", "512", "--grace-period-s", "60",
                          faults=("--step-s", str(MODEL_PACE_S)), fake_engine=True)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        calls = [stub.GenerateStream(greedy(PROMPT, max_new_tokens=120, ignore_eos=True), timeout=120) for _ in range(4)]
        firsts = [next(call) for call in calls]
        server.process.send_signal(signal.SIGTERM)
        server.wait_until_draining()
        with grpc.insecure_channel(server.address) as fresh:
            refused = rpc_error(lambda: pb_grpc.GenerationServiceStub(fresh).GenerateStream(greedy(PROMPT), timeout=5))
        assert refused.code() == grpc.StatusCode.UNAVAILABLE
        for first, call in zip(firsts, calls):
            rest = list(call)
            assert rest[-1].finish.reason == FINISH.FINISH_REASON_MAX_TOKENS and rest[-1].generated_tokens == 120
            assert rest[0].generated_tokens > first.generated_tokens  # the same stream, carried on
    assert server.process.wait(timeout=60) == 0, server.log()


def test_a_second_signal_exits_at_once(tmp_path):
    # Held after its first token, the stream keeps the drain waiting however long the test takes to signal again.
    server = start_server(tmp_path, "--max-batch-size", "2", "--context-length", "1024", "--grace-period-s", "120",
                          faults=("--step-s", str(MODEL_PACE_S), "--hold-requests-with-prefix", "endless"), fake_engine=True)
    with grpc.insecure_channel(server.address) as channel:
        call = pb_grpc.GenerationServiceStub(channel).GenerateStream(long_request("endless", 1000), timeout=120)
        next(call)
        server.process.send_signal(signal.SIGTERM)
        server.wait_until_draining()
        assert server.process.poll() is None  # draining: the stream still runs
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=30) == 1
        with pytest.raises(grpc.RpcError):
            list(call)


def test_cancelling_streams_whose_writes_wait_on_flow_control_logs_one_line_each():
    """A caller that stopped reading resets its streams while the server's writes wait on HTTP/2 flow
    control: each ends as any cancelled stream does, in one INFO line (gRPC used to log each write
    that failed so as a crash: ExecuteBatchError, with a traceback)."""
    server = start_fake("--max-batch-size", "8", "--context-length", "4096", "--stream-buffer-events", "4")
    channels = [grpc.insecure_channel(server.address, options=SMALL_WINDOW) for _ in range(8)]
    try:
        calls = [pb_grpc.GenerationServiceStub(channel).GenerateStream(long_request(f"blocked-{i}", 4000), timeout=60)
                 for i, channel in enumerate(channels)]
        # Generated as fast as asked, each stream fills its window; its write then waits, its events pile up
        # and its sequence pauses, and it stays paused while the write waits: the engine stops stepping.
        wait_for(lambda: every_sequence_stays_paused(server.engine, 8), what="every stream's write to wait")
        for call in calls:
            call.cancel()
        wait_for(lambda: server.engine.stats.running_sequences == 0, what="the cancelled streams to end")
        wait_for(lambda: server.log().count("ended by the caller") == 8, what="a line for each stream")
    finally:
        for channel in channels:
            channel.close()
        server.close()
    log = server.log()
    for i in range(8):
        assert log.count(f"INFO service.generation: request blocked-{i} ended by the caller: cancelled") == 1, log
    assert "Traceback" not in log and "ExecuteBatchError" not in log, log


def every_sequence_stays_paused(engine: FakeEngine, count: int, looks: int = 5) -> bool:
    """`count` sequences are paused and the engine takes no step while we look a few times."""
    steps = engine.stats.steps
    for _ in range(looks):
        if engine.stats.paused_sequences != count or engine.stats.steps != steps:
            return False
        time.sleep(0.02)
    return True


def test_a_cancelled_request_logs_the_tokens_it_was_sent():
    """docs/operations.md: each request's end is one line with its token count, a cancelled one's too."""
    server = start_fake("--max-batch-size", "2", "--context-length", "512")
    server.engine.plan("held-", hold_after=3)  # three tokens, then the sequence waits for the cancel
    try:
        with grpc.insecure_channel(server.address) as channel:
            call = pb_grpc.GenerationServiceStub(channel).GenerateStream(long_request("held-1", 100), timeout=60)
            for message in call:
                if message.generated_tokens == 3:
                    break
            call.cancel()
            wait_for(lambda: "request held-1 ended by the caller" in server.log(), what="the cancelled request's line")
    finally:
        server.close()
    assert "INFO service.generation: request held-1 ended by the caller: cancelled, 3 tokens" in server.log()
