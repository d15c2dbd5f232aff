"""Fair sharing through gRPC, on real servers and the real model, with two API keys: one caller's flood
never starves another, priority takes the next step, sheddable work goes first, a caller past its own
limit is refused while others are served, and queue_timeout_ms ends a queued request at its time.

Latency is counted in engine steps, never in seconds, and the steps do not depend on the machine's load:
the servers run behind a step gate (tests.harness.faults.StepGate), so while a test sends a request or
looks at the server, the engine waits for it instead of running on. A request's latency is the steps
from the one the engine waited at when the request reached it to the one that made its first token (the
gated server logs it)."""

from __future__ import annotations

import hashlib
import threading
import urllib.request

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from prometheus_client.parser import text_string_to_metric_families

from tests.harness.faults import StepGate, first_token_step
from tests.harness.helpers import error_reason, greedy, text_of, wait_for
from tests.harness.proxies import free_port
from tests.harness.servers import REPORT, RunningServer, start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

KEYS = {"a": "a-secret-key", "b": "b-secret-key", "c": "c-secret-key"}
PROMPTS = ["Water boils at", "The moon is", "Cats are", "Rain falls", "Trees grow", "Rivers run"]
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
# A request that arrives at a full batch starts at the next step; the rest is the prefill: a handful of
# steps. Without fair sharing B waits for A's queue (hundreds).
FEW_STEPS = 8
CAPACITY = 8 + 8
"""The server's places: --max-batch-size 8 and --max-queued-requests 8."""


def bearer(name: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS[name]}"),)


def api_keys() -> str:
    return ",".join(f"{name}:{hashlib.sha256(key.encode()).hexdigest()}" for name, key in KEYS.items())


def request(prompt: str, max_new_tokens: int, request_id: str = "", priority: int = 0,
            queue_timeout_ms: int = 0) -> pb.GenerateStreamRequest:
    message = greedy(prompt, max_new_tokens=max_new_tokens, ignore_eos=True)
    message.request_id, message.priority, message.queue_timeout_ms = request_id, priority, queue_timeout_ms
    return message


class Stream:
    """One call read to its end on its own thread: its messages, or the error it ended with."""

    def __init__(self, stub, message: pb.GenerateStreamRequest, caller: str, metadata=()) -> None:
        self.call = stub.GenerateStream(message, metadata=bearer(caller) + tuple(metadata), timeout=300)
        self.messages: list[pb.GenerateStreamResponse] = []
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self.call:
                self.messages.append(message)
        except grpc.RpcError as error:
            self.error = error

    @property
    def ended(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float = 300) -> Stream:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream did not end"
        return self

    @property
    def text(self) -> str:
        return text_of(self.messages)


def status(stub) -> pb.GetServerStatusResponse:
    return stub.GetServerStatus(pb.GetServerStatusRequest(), metadata=bearer("b"), timeout=10)


def wait_until(stub, condition, timeout: float = 120) -> pb.GetServerStatusResponse:
    """The first GetServerStatus that meets `condition`."""
    def reached():
        current = status(stub)
        return current if condition(current) else None

    return wait_for(reached, timeout, "a server status")


def callers(current: pb.GetServerStatusResponse) -> dict[str, pb.CallerStatus]:
    return {c.caller: c for c in current.callers}


def is_idle(current: pb.GetServerStatusResponse) -> bool:
    return current.running_sequences == current.queued_requests == current.preempted_sequences == 0


def hold_the_idle_engine(stub, gate: StepGate) -> None:
    """Holds the engine where it is once idle: from now on it runs only the steps the test lets it run."""
    gate.hold_at(wait_until(stub, is_idle).engine_steps)


def step_until(stub, gate: StepGate, reached, most: int = 200) -> pb.GetServerStatusResponse:
    """Lets the held engine run one step at a time until `reached(status)`; the status then."""
    current, start = status(stub), gate.limit
    while not reached(current):
        assert gate.limit < start + most, f"not reached in {most} steps: {current}"
        gate.run_to(gate.limit + 1)
        current = status(stub)
    return current


def has_first_token(server: RunningServer, request_id: str) -> bool:
    return first_token_step(server.log(), request_id) is not None


def steps_to_first_token(stub, server: RunningServer, gate: StepGate, caller: str, message: pb.GenerateStreamRequest,
                         metadata=()) -> tuple[int, str]:
    """Engine steps from the step the held engine waited at when the request reached it to the step that made its
    first token, and its whole text. The engine takes one step at a time once the request is in, until it ends."""
    def held_by_caller(current: pb.GetServerStatusResponse) -> int:
        mine = callers(current).get(caller)
        return mine.running_sequences + mine.queued_requests + mine.preempted_sequences if mine else 0

    before, start = held_by_caller(status(stub)), gate.limit
    call = Stream(stub, message, caller, metadata)
    wait_until(stub, lambda s: held_by_caller(s) == before + 1)  # in the engine: no step has run since
    step_until(stub, gate, lambda s: call.ended)
    assert call.result().error is None, call.error
    assert call.messages[-1].finish.reason == pb.FinishReason.FINISH_REASON_MAX_TOKENS
    return first_token_step(server.log(), message.request_id) - start, call.text


def retry_delay_s(error: grpc.RpcError) -> float | None:
    for detail in rpc_status.from_call(error).details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return info.retry_delay.ToTimedelta().total_seconds()
    return None


@pytest.fixture(scope="module")
def step_gate(tmp_path_factory) -> StepGate:
    return StepGate(tmp_path_factory.mktemp("fair-gate") / "steps")


@pytest.fixture(scope="module")
def server(tmp_path_factory, step_gate):
    running = start_server(tmp_path_factory.mktemp("fair"), "--api-keys", api_keys(), "--max-batch-size", "8",
                           "--max-queued-requests", "8", "--context-length", "256", faults=("--step-gate", str(step_gate.path)))
    yield running
    assert stop_server(running) == 0, running.log()


@pytest.fixture
def gate(step_gate):
    """The server's step gate, open again after the test whatever it left."""
    yield step_gate
    step_gate.open()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GenerationServiceStub(channel)


def test_a_flood_of_30_long_streams_never_starves_another_caller(stub, server, gate):
    tokens = 96
    reference = {p: Stream(stub, request(p, tokens), "a") for p in PROMPTS}  # alone: batch-independent
    reference = {p: s.result().text for p, s in reference.items()}
    hold_the_idle_engine(stub, gate)
    flood = [Stream(stub, request(PROMPTS[i % len(PROMPTS)], tokens, f"flood-{i}"), "a") for i in range(30)]
    # A alone may take every place; the held engine ends none of them, so the door refuses the rest.
    wait_until(stub, lambda s: s.queued_requests == CAPACITY)
    wait_for(lambda: sum(s.ended for s in flood) == 30 - CAPACITY, 120, "the door to refuse the rest of the flood")
    started = step_until(stub, gate, lambda s: s.running_sequences == 8 and s.queued_requests == 8).engine_steps
    gate.run_to(started + 20)  # A's streams have run past a time slice, and are far from done
    delays = []
    for i in range(4):  # B's questions, one after another, each on a server A keeps full
        steps, text = steps_to_first_token(stub, server, gate, "b", request(PROMPTS[i], 4, f"b-{i}"))
        delays.append(steps)
        assert text
    REPORT.append(f"fair sharing: B's first token {delays} engine steps after it was sent, beside A's flood")
    assert max(delays) <= FEW_STEPS, delays
    gate.open()
    outcomes = [s.result() for s in flood]
    refused = [s for s in outcomes if s.error is not None]
    for s in refused:  # refused at the door (A held its whole share) or shed from the queue for B
        assert s.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and error_reason(s.error) in ("OVERLOADED", "SHED")
        assert retry_delay_s(s.error) is not None
    # B's first question found the server full and took a queued place of A's; the others found that place free.
    assert sum(error_reason(s.error) == "SHED" for s in refused) == 1
    served = [s for s in outcomes if s.error is None]
    assert len(served) == 30 - len(refused) >= 12
    for i, s in enumerate(outcomes):  # preempted or not, each stream is what it would be alone: nothing lost
        if s.error is None:
            assert s.text == reference[PROMPTS[i % len(PROMPTS)]], i
    idle = wait_until(stub, is_idle)
    assert idle.preempted_total >= 4  # each question of B took a slot from A
    a, b = callers(idle)["a"], callers(idle)["b"]
    assert a.shed_total == 1 and a.refused_total == len(refused) - 1 and a.preempted_total >= 4
    assert b.refused_total == b.shed_total == 0 and b.generated_tokens_total == 4 * 4
    # Preempted sequences kept their cells as cached prefixes: coming back cost a couple of tokens each.
    assert idle.recomputed_tokens_total <= 4 * idle.preempted_total


def test_a_priority_5_request_starts_at_the_next_step_while_8_priority_0_streams_hold_every_slot(stub, server, gate):
    hold_the_idle_engine(stub, gate)
    holders = [Stream(stub, request(PROMPTS[i % len(PROMPTS)], 64, f"hold-{i}"), "a") for i in range(8)]
    wait_until(stub, lambda s: s.queued_requests == 8)
    step_until(stub, gate, lambda s: s.running_sequences == 8 and all(has_first_token(server, f"hold-{i}") for i in range(8)))
    # Every slot decoding. From the same caller, before any time slice has passed: only its priority can get it a slot.
    steps, _ = steps_to_first_token(stub, server, gate, "a", request(PROMPTS[0], 4, "urgent", priority=5))
    assert steps <= FEW_STEPS
    for s in holders:
        s.call.cancel()
    wait_until(stub, is_idle)


def test_under_overload_negative_priority_is_preempted_shed_and_refused_first(stub, server, gate):
    hold_the_idle_engine(stub, gate)
    streams = [Stream(stub, request(PROMPTS[0], 200, "low-running", priority=-1), "a")]
    step_until(stub, gate, lambda s: s.running_sequences == 1)
    streams += [Stream(stub, request(PROMPTS[i % 6], 200, f"run-{i}"), "a") for i in range(7)]
    wait_until(stub, lambda s: s.queued_requests == 7)
    started = step_until(stub, gate, lambda s: s.running_sequences == 8).engine_steps
    # A priority-0 request of the same caller takes the sheddable one's slot at once, no time slice waited.
    streams.append(Stream(stub, request(PROMPTS[1], 200, "run-7"), "a"))
    wait_until(stub, lambda s: s.queued_requests == 1)
    step_until(stub, gate, lambda s: s.preempted_sequences == 1)
    assert "preempted low-running (priority -1 < 0" in server.log()
    low_queued = Stream(stub, request(PROMPTS[1], 200, "low-queued", priority=-1), "a")
    wait_until(stub, lambda s: s.queued_requests == 1)
    streams += [low_queued, *(Stream(stub, request(PROMPTS[i % 6], 200, f"queued-{i}"), "a") for i in range(6))]
    full = wait_until(stub, lambda s: (s.running_sequences, s.preempted_sequences, s.queued_requests) == (8, 1, 7))
    assert full.engine_steps < started + 150  # A's streams are far from done
    gate.run_to(started + 20)  # past a time slice
    # The server is full (16 of 16). B is under its share, but a sheddable request is refused at once...
    sheddable = Stream(stub, request(PROMPTS[2], 4, "b-sheddable", priority=-1), "b").result()
    assert sheddable.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_reason(sheddable.error) == "OVERLOADED"
    # ... while a priority-0 one comes in, and A's sheddable queued request gives it its place, not A's newest.
    steps, _ = steps_to_first_token(stub, server, gate, "b", request(PROMPTS[2], 4, "b-normal"))
    assert steps <= FEW_STEPS
    assert error_reason(low_queued.result().error) == "SHED"
    assert all(s.error is None for s in streams if s is not low_queued)
    for s in streams:
        s.call.cancel()
    wait_until(stub, is_idle)


@pytest.fixture(scope="module")
def limited_step_gate(tmp_path_factory) -> StepGate:
    return StepGate(tmp_path_factory.mktemp("limited-gate") / "steps")


@pytest.fixture(scope="module")
def limited(tmp_path_factory, model_path, limited_step_gate):
    running = start_server(
        tmp_path_factory.mktemp("limited"), "--api-keys", api_keys(), "--max-batch-size", "4",
        "--context-length", "256",
        "--max-running-per-caller", "2", "--max-queued-per-caller", "1", "--priority-callers", "a",
        "--fairness-header", FAIRNESS_HEADER, faults=("--step-gate", str(limited_step_gate.path)),
    )
    yield running
    assert stop_server(running) == 0, running.log()


@pytest.fixture
def limited_gate(limited_step_gate):
    yield limited_step_gate
    limited_step_gate.open()


def test_a_caller_past_its_own_limit_is_refused_while_another_is_admitted_and_a_queued_request_times_out(
        limited, limited_gate):
    gate = limited_gate
    with grpc.insecure_channel(limited.address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        hold_the_idle_engine(stub, gate)
        running = [Stream(stub, request(PROMPTS[i], 48, f"a-run-{i}"), "a") for i in range(2)]
        wait_until(stub, lambda s: s.queued_requests == 2)
        step_until(stub, gate, lambda s: s.running_sequences == 2)
        # Its queue timeout may not pass before the test has looked: the held engine checks no time meanwhile.
        gate.freeze_at(gate.limit)
        queued = Stream(stub, request(PROMPTS[2], 4, "a-queued", queue_timeout_ms=500), "a")
        wait_until(stub, lambda s: s.queued_requests == 1)
        view = callers(status(stub))["a"]
        assert (view.running_sequences, view.queued_requests) == (2, 1)
        over = Stream(stub, request(PROMPTS[3], 4, "a-over"), "a").result()
        assert over.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error_reason(over.error) == "CALLER_OVER_LIMIT" and retry_delay_s(over.error) is not None
        # B is admitted at once: the free slots are not A's to take.
        steps, _ = steps_to_first_token(stub, limited, gate, "b", request(PROMPTS[4], 4, "b-0"))
        assert steps <= FEW_STEPS
        queued.result()  # the held engine checks the time again, and runs no step: A's streams run on
        assert queued.error.code() == grpc.StatusCode.UNAVAILABLE and error_reason(queued.error) == "QUEUE_TIMEOUT"
        assert retry_delay_s(queued.error) == 0.0  # try another replica now
        assert not queued.messages and all(s.call.running() or not s.messages[-1].HasField("finish") for s in running)
        gate.open()
        for s in running:
            assert s.result().messages[-1].finish.reason == pb.FinishReason.FINISH_REASON_MAX_TOKENS
        view = callers(status(stub))["a"]
        assert (view.queue_timeouts_total, view.refused_total) == (1, 1)


def test_priority_above_0_only_for_the_named_callers_and_a_trusted_fairness_id(limited):
    with grpc.insecure_channel(limited.address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        denied = Stream(stub, request(PROMPTS[0], 4, priority=5), "b").result()
        assert denied.error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert error_reason(denied.error) == "PRIORITY_NOT_ALLOWED"
        assert Stream(stub, request(PROMPTS[0], 4, priority=5), "a").result().error is None
        tenant = Stream(stub, request(PROMPTS[1], 4), "b", metadata=((FAIRNESS_HEADER, "tenant-7"),)).result()
        assert tenant.error is None
        assert callers(status(stub))["tenant-7"].generated_tokens_total == 4


def test_first_come_first_served_takes_only_priority_0(tmp_path, model_path):
    server = start_server(tmp_path, "--scheduling", "fifo", "--max-batch-size", "2", "--context-length", "256")
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            error = Stream(stub, request(PROMPTS[0], 4, priority=1), "a").result().error
            assert error.code() == grpc.StatusCode.UNIMPLEMENTED and error_reason(error) == "NOT_SUPPORTED"
    finally:
        assert stop_server(server) == 0, server.log()


def test_per_caller_metrics_keep_a_bounded_label_set(tmp_path, model_path):
    port = free_port()
    server = start_server(tmp_path, "--api-keys", api_keys(), "--max-batch-size", "2", "--context-length", "256",
                          "--prometheus-port", str(port), "--caller-metric-labels", "1")
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            for caller in ("a", "b", "c"):
                assert Stream(stub, request(PROMPTS[0], 4), caller).result().error is None
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        samples = [sample for family in text_string_to_metric_families(text)
                   if family.name.startswith("tokenspout_server_caller_tokens") for sample in family.samples
                   if sample.name.endswith("_total")]
        output = {s.labels["tokenspout_caller"]: s.value for s in samples if s.labels["gen_ai_token_type"] == "output"}
        assert output == {"a": 4, "_other": 8}  # the first caller seen keeps its label; b and c share one
    finally:
        assert stop_server(server) == 0, server.log()


def test_spans_record_the_caller_priority_and_queue_time():
    from tests.service.test_telemetry import RPC_SPAN, TracedServer

    traced = TracedServer()
    try:
        with grpc.insecure_channel(traced.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            list(stub.GenerateStream(request(PROMPTS[0], 4, priority=2), timeout=60))
        (span,) = traced.wait_for_span(RPC_SPAN)
        attributes = span.attributes
        assert (attributes["tokenspout.caller"], attributes["tokenspout.request.priority"]) == ("", 2)
        assert 0 <= attributes["tokenspout.queue_ms"] < 60_000
    finally:
        traced.close()
