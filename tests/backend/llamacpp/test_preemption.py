"""Slow readers never block the queue: a paused sequence gives up its slot to a waiting request and
comes back, by recomputing, when its caller reads again; the caller sees the same stream."""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest

from backend.events import ErrorEvent, ErrorKind, FinishReason
from tests.harness.core_driver import Recorder, make_core, request, run_until_idle, token_ids
from tests.harness.helpers import SMALL_WINDOW, greedy, rpc_error, stream, text_of
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

PROMPTS = ["Water boils at", "The moon is", "Cats are", "Rain falls", "Trees grow", "Rivers run", "Bread is",
           "Snow is"]


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["own-cells-cached", "recomputed-in-full"])
def test_a_paused_sequence_gives_its_slot_to_a_waiting_request_and_comes_back(model, prefix_cache):
    core = make_core(model, max_batch_size=2, prefix_cache=prefix_cache)
    try:
        solo = {}
        for prompt in PROMPTS[:3]:
            solo[prompt] = Recorder(core)
            core.add(request(model, f"solo-{prompt}", prompt, max_new_tokens=40), solo[prompt])
            run_until_idle(core)
        a, b, c = Recorder(core), Recorder(core), Recorder(core)
        core.add(request(model, "a", PROMPTS[0], max_new_tokens=40), a)
        core.add(request(model, "b", PROMPTS[1], max_new_tokens=40), b)
        for _ in range(20):  # past the 16 tokens worth keeping in the cache
            core.step()
        core.pause("a")  # its caller stopped reading
        core.pause("b")
        core.add(request(model, "c", PROMPTS[2], max_new_tokens=40), c)
        run_until_idle(core)
        # c ran to the end in a slot a paused sequence gave up; the other paused one kept its slot.
        assert c.finish.reason is FinishReason.MAX_TOKENS and token_ids(c) == token_ids(solo[PROMPTS[2]])
        assert core.stats.preempted_total == 1 and core.stats.preempted_sequences == 1
        assert a.finish is None and b.finish is None
        core.resume("a")
        core.resume("b")
        run_until_idle(core)
        for rec, prompt in ((a, PROMPTS[0]), (b, PROMPTS[1])):
            assert rec.finish.reason is FinishReason.MAX_TOKENS
            assert token_ids(rec) == token_ids(solo[prompt])  # the same stream, whether it was preempted or not
        assert core.stats.recomputed_tokens_total > 0 and not core.holds_sequences()
        if prefix_cache:  # its own cells were still cached: only the last two tokens were computed again
            assert core.stats.recomputed_tokens_total == 2
    finally:
        core.close()


def test_a_preempted_sequence_can_be_cancelled_and_time_out(model):
    # Long enough that a loaded machine never stalls that long between pause() and the next step.
    max_pause_s = 0.5
    core = make_core(model, max_batch_size=1, max_pause_s=max_pause_s)
    try:
        a, b = Recorder(core), Recorder(core)
        core.add(request(model, "a", PROMPTS[0], max_new_tokens=40), a)
        core.step()
        core.pause("a")
        core.add(request(model, "b", PROMPTS[1], max_new_tokens=200), b)
        core.step()  # "a" gives way
        assert core.stats.preempted_sequences == 1 and core.stats.running_sequences == 1
        time.sleep(max_pause_s)
        core.step()
        event = a.events[-1][1]
        assert isinstance(event, ErrorEvent) and event.kind is ErrorKind.PAUSED_TOO_LONG and "max_pause_s" in event.message
        assert core.stats.preempted_sequences == 0
        core.cancel("b")
        assert b.finish.reason is FinishReason.CANCELLED and not core.holds_sequences()
    finally:
        core.close()


# -- through gRPC: callers that stop reading


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = start_server(tmp_path_factory.mktemp("preempt"), "--max-batch-size", "8", "--context-length", "512",
                           "--stream-buffer-events", "8", "--max-queued-requests", "8")
    yield running
    assert stop_server(running) == 0, running.log()


def status(stub) -> pb.GetServerStatusResponse:
    return stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10)


def wait_for(condition, stub, timeout: float = 60) -> pb.GetServerStatusResponse:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = status(stub)
        if condition(current):
            return current
        time.sleep(0.05)
    raise AssertionError(f"not reached: {current}")


def test_eight_streams_that_stop_reading_never_block_a_normal_request(server):
    tokens = 96
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        solo = {p: text_of(stream(stub, greedy(p, max_new_tokens=tokens, ignore_eos=True))) for p in PROMPTS}
        # A small HTTP/2 window on each stalled caller's own channel, so the server feels it at once.
        channels = [grpc.insecure_channel(server.address, options=SMALL_WINDOW) for _ in PROMPTS]
        calls = [pb_grpc.GenerationServiceStub(ch).GenerateStream(greedy(p, max_new_tokens=tokens, ignore_eos=True),
                                                                  timeout=120)
                 for ch, p in zip(channels, PROMPTS)]
        firsts = [next(call) for call in calls]  # then nobody reads
        wait_for(lambda s: s.paused_sequences == 8, stub)
        before = status(stub).preempted_total
        normal = stream(stub, greedy("Paris is the capital of", max_new_tokens=4), timeout=30)
        assert normal[-1].finish.reason == pb.FinishReason.FINISH_REASON_MAX_TOKENS
        assert status(stub).preempted_total > before
        # The stalled callers read again: every stream carries on and ends as its solo run did.
        with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
            rests = list(pool.map(list, calls))
        for prompt, first, rest in zip(PROMPTS, firsts, rests):
            assert rest[-1].finish.reason == pb.FinishReason.FINISH_REASON_MAX_TOKENS
            assert first.text + text_of(rest) == solo[prompt], prompt
        for ch in channels:
            ch.close()
        idle = wait_for(lambda s: s.running_sequences == s.preempted_sequences == 0, stub)
        assert idle.recomputed_tokens_total >= 1


def test_a_caller_that_never_reads_again_ends_with_aborted(tmp_path, model_path):
    server = start_server(tmp_path, "--max-batch-size", "1", "--context-length", "512", "--stream-buffer-events", "4",
                          "--max-pause-s", "0.5")
    try:
        with grpc.insecure_channel(server.address, options=SMALL_WINDOW) as channel:
            call = pb_grpc.GenerationServiceStub(channel).GenerateStream(
                greedy(PROMPTS[0], max_new_tokens=400, ignore_eos=True), timeout=60
            )
            next(call)
            # Watched from another connection: this one's window is full. The sequence pauses,
            # and max_pause_s later it is failed and freed.
            with grpc.insecure_channel(server.address) as side:
                wait_for(lambda s: s.running_sequences == s.preempted_sequences == 0,
                         pb_grpc.GenerationServiceStub(side))
            error = rpc_error(lambda: list(call))
            assert error.code() == grpc.StatusCode.ABORTED and "max_pause_s" in error.details()
    finally:
        assert stop_server(server) == 0, server.log()
