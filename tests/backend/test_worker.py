"""The engine worker applies the commands queued while its thread was busy as one batch, then settles once
(admission, the published figures, the outputs in order) for the batch, not once per command."""

from __future__ import annotations

import queue
import threading
import time

from backend.common.stats import EngineStats
from backend.events import ErrorEvent, FinishReason
from backend.types import GenerationRequest, SamplingParams, Scheduling, StopParams
from backend.worker import EngineWorker
from tests.harness.exllamav2_fakes import fake_core


class RecordingCore:
    """An EngineCore that records what the worker asks of it; its first add waits until the test lets it go,
    so that the commands sent meanwhile queue behind it."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.outbox: list = []
        self.stats = EngineStats()
        self.first_add = threading.Event()
        self.release = threading.Event()

    def add(self, request, sink, constraint=None):
        if not self.first_add.is_set():
            self.first_add.set()
            assert self.release.wait(10)
        self.calls.append(f"add {request.request_id}")
        self.outbox.append((sink, f"added {request.request_id}"))

    def cancel(self, order):
        self.calls.append(f"cancel {order.request_id}")

    def pause(self, request_id):
        pass

    def resume(self, request_id):
        pass

    def settle(self):
        self.calls.append("settle")
        outputs, self.outbox = self.outbox, []
        return outputs

    def expire(self):
        pass

    def has_work(self):
        return False

    def holds_sequences(self):
        return False

    def close(self):
        pass


def request(request_id: str, caller: str = "a") -> GenerationRequest:
    return GenerationRequest(request_id, (1, 5, 6), SamplingParams(temperature=0.0), StopParams(max_new_tokens=3),
                             scheduling=Scheduling(caller, 1.0, 0))


def test_commands_queued_while_the_engine_thread_was_busy_are_settled_once_after_them():
    core = RecordingCore()
    worker = EngineWorker(core, name="recording")  # type: ignore[arg-type]
    delivered: list[str] = []
    try:
        worker.submit(request("r0"), delivered.append)
        assert core.first_add.wait(10)
        for i in range(1, 5):
            worker.submit(request(f"r{i}"), delivered.append)
        worker.cancel("r2")
        core.release.set()
        deadline = time.monotonic() + 10
        while "settle" not in core.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        worker.submit(request("r9"), delivered.append)  # a batch of its own
    finally:
        worker.close()
    first = ["add r0", *(f"add r{i}" for i in range(1, 5)), "cancel r2", "settle"]
    assert core.calls[: len(first) + 2] == [*first, "add r9", "settle"]
    assert delivered == [f"added r{i}" for i in (0, 1, 2, 3, 4, 9)]


def test_a_burst_on_a_full_batch_is_admitted_as_places_free_and_every_request_finishes():
    """The exllamav2 core (over the tests' fake generator) on a real worker: eight requests for two places,
    sent at once, each get their three tokens and finish; the core settles admission after each batch."""
    driven, generators = fake_core(vocab_size=16, max_batch_size=2, max_queued_requests=8)
    core = driven.core
    generators[0].samples.update({f"r{i}": [(10, b"x")] * 3 for i in range(8)})
    worker = EngineWorker(core, name="burst")
    streams = {f"r{i}": queue.Queue() for i in range(8)}
    try:
        for i, (request_id, events) in enumerate(streams.items()):
            worker.submit(request(request_id, caller=f"caller{i % 3}"), events.put)
        for request_id, events in streams.items():
            received = [events.get(timeout=10)]
            while not isinstance(received[-1], ErrorEvent) and received[-1].finish is None:
                received.append(events.get(timeout=10))
            assert not isinstance(received[-1], ErrorEvent), received[-1]
            assert received[-1].finish.reason is FinishReason.MAX_TOKENS, request_id
            assert sum(len(event.tokens) for event in received) == 3
    finally:
        worker.close()
    assert max(len(generator.enqueued) for generator in generators) == 8
    assert core.stats.running_sequences == 0 and core.stats.queued_requests == 0
