"""OpenTelemetry on servers of the fake engine (in process with in-memory exporters, and a `tokenspout serve`
process exporting over OTLP): spans per token batch, GenAI attributes, metrics, OTLP."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
import urllib.request

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.propagate import inject
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from backend.events import ErrorEvent, ErrorKind
from service.errors import from_engine
from service.telemetry import Telemetry, from_environment
from tests.harness.fake_engine import FAKE_MODEL_ID, FakeEngine
from tests.harness.helpers import error_reason, greedy, rpc_error
from tests.harness.inprocess_server import InProcessServer, serve_config
from tests.harness.otlp_collector import start_collector
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

RPC_SPAN = "/tokenspout.v1.GenerationService/GenerateStream"


class TracedServer(InProcessServer):
    """A tokenspout server in this process (its own event loop thread) with in-memory exporters."""

    def __init__(self, record_content: bool = False, attention_provider: str = "", env: dict[str, str] | None = None) -> None:
        self.spans = InMemorySpanExporter()
        self.metrics = InMemoryMetricReader()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.spans))
        telemetry = Telemetry(provider, MeterProvider(metric_readers=[self.metrics]), record_content)
        config = serve_config("--context-length", "512", "--max-batch-size", "2", env=env)
        engine = FakeEngine(config.engine)
        engine.info = dataclasses.replace(engine.info, attention_provider=attention_provider)
        super().__init__(engine, config, telemetry)

    def wait_for_span(self, name: str, count: int = 1, timeout: float = 10):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [s for s in self.spans.get_finished_spans() if s.name == name]
            if len(found) >= count:
                return found
            time.sleep(0.02)
        raise AssertionError(f"no {name} span among {[s.name for s in self.spans.get_finished_spans()]}")

    def metric_points(self, name: str) -> list:
        data = self.metrics.get_metrics_data()
        return [
            point
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == name
            for point in metric.data.data_points
        ]


@pytest.fixture
def traced():
    server = TracedServer()
    yield server
    server.close()


def caller_context():
    """A span on the caller's side, and the metadata that carries it (W3C traceparent)."""
    provider = TracerProvider()
    span = provider.get_tracer("caller").start_span("caller")
    carrier: dict[str, str] = {}
    inject(carrier, context=trace.set_span_in_context(span))
    return span, list(carrier.items())


def test_one_span_per_token_batch_under_the_rpc_span_in_the_callers_trace(traced):
    caller, metadata = caller_context()
    request = greedy("The sky is", max_new_tokens=20, ignore_eos=True)
    request.output.min_tokens_per_message = request.output.max_tokens_per_message = 3
    with grpc.insecure_channel(traced.address) as channel:
        messages = list(pb_grpc.GenerationServiceStub(channel).GenerateStream(request, metadata=metadata, timeout=60))
    assert len(messages) == math.ceil(20 / 3)
    assert [len(m.tokens) for m in messages] == [3, 3, 3, 3, 3, 3, 2]

    (rpc,) = traced.wait_for_span(RPC_SPAN)
    batches = sorted(traced.wait_for_span("token_batch", 7), key=lambda s: s.attributes["tokenspout.batch.index"])
    assert rpc.context.trace_id == caller.get_span_context().trace_id
    assert rpc.parent.span_id == caller.get_span_context().span_id
    assert rpc.kind is trace.SpanKind.SERVER
    for name in ("queue", "prefill"):
        (span,) = traced.wait_for_span(name)
        assert span.parent.span_id == rpc.context.span_id
    (prefill,) = traced.wait_for_span("prefill")  # how much of the prompt came from the prefix cache
    assert prefill.attributes["tokenspout.prefill.prompt_tokens"] == messages[-1].finish.usage.prompt_tokens
    assert prefill.attributes["tokenspout.prefill.cached_tokens"] == messages[-1].finish.usage.cached_tokens
    assert len(batches) == 7
    position = 0
    for index, (batch, message) in enumerate(zip(batches, messages)):
        assert batch.parent.span_id == rpc.context.span_id and batch.context.trace_id == rpc.context.trace_id
        attrs = batch.attributes
        assert attrs["tokenspout.batch.index"] == index and attrs["tokenspout.batch.tokens"] == len(message.tokens)
        assert attrs["tokenspout.batch.first_token_position"] == position
        assert attrs["tokenspout.batch.last_token_position"] == position + len(message.tokens) - 1
        assert attrs["tokenspout.batch.engine_steps"] >= 1 and attrs["tokenspout.batch.caller_wait_ms"] >= 0
        position += len(message.tokens)

    finish = messages[-1].finish
    attrs = rpc.attributes
    assert attrs["gen_ai.operation.name"] == "text_completion" and attrs["gen_ai.provider.name"] == "tokenspout"
    assert attrs["gen_ai.request.model"] == FAKE_MODEL_ID
    assert attrs["gen_ai.request.temperature"] == 0.0 and attrs["gen_ai.request.max_tokens"] == 20
    assert attrs["gen_ai.request.seed"] == finish.seed
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("max_tokens",)
    assert attrs["gen_ai.usage.input_tokens"] == finish.usage.prompt_tokens == messages[0].input_tokens
    assert attrs["gen_ai.usage.output_tokens"] == finish.usage.completion_tokens == 20
    assert attrs["gen_ai.response.time_to_first_chunk"] == pytest.approx(finish.timings.time_to_first_token_ms / 1000)
    assert "gen_ai.input.messages" not in attrs and "gen_ai.output.messages" not in attrs  # text is opt-in


def test_metrics_match_the_response(traced):
    request = greedy("Rain falls", max_new_tokens=12, ignore_eos=True)
    with grpc.insecure_channel(traced.address) as channel:
        messages = list(pb_grpc.GenerationServiceStub(channel).GenerateStream(request, timeout=60))
    finish = messages[-1].finish
    traced.wait_for_span(RPC_SPAN)
    (ttft,) = traced.metric_points("gen_ai.server.time_to_first_token")
    assert ttft.count == 1 and ttft.sum == pytest.approx(finish.timings.time_to_first_token_ms / 1000)
    assert list(ttft.explicit_bounds)[:3] == [0.001, 0.005, 0.01]
    (duration,) = traced.metric_points("gen_ai.server.request.duration")
    assert duration.sum == pytest.approx(finish.timings.total_ms / 1000)
    (per_token,) = traced.metric_points("gen_ai.server.time_per_output_token")
    assert per_token.sum == pytest.approx(finish.timings.decode_ms / 1000 / 11)
    usage = {p.attributes["gen_ai.token.type"]: p.sum for p in traced.metric_points("tokenspout.server.token.usage")}
    assert usage == {"input": finish.usage.prompt_tokens, "output": 12}
    durations = traced.metric_points("gen_ai.server.request.duration")
    assert all(p.attributes["gen_ai.operation.name"] == "text_completion" for p in durations)
    # The gauge reads the engine's published state, which follows the last event by at most one step.
    deadline = time.monotonic() + 5
    while traced.metric_points("tokenspout.server.running_sequences")[0].value and time.monotonic() < deadline:
        time.sleep(0.01)
    assert traced.metric_points("tokenspout.server.running_sequences")[0].value == 0


def test_a_cancelled_stream_records_the_cancellation(traced):
    traced.engine.pace(0.01)  # a small model's pace: the stream runs when the caller cancels
    with grpc.insecure_channel(traced.address) as channel:
        call = pb_grpc.GenerationServiceStub(channel).GenerateStream(greedy("Once", 400, ignore_eos=True), timeout=60)
        for _, _message in zip(range(3), call):
            pass
        call.cancel()
    (rpc,) = traced.wait_for_span(RPC_SPAN)
    assert tuple(rpc.attributes["gen_ai.response.finish_reasons"]) == ("cancelled",)
    (event,) = [e for e in rpc.events if e.name == "cancelled"]
    assert event.attributes["tokenspout.reason"] == "cancelled" and event.attributes["tokenspout.generated_tokens"] >= 3
    assert all(span.end_time for span in traced.wait_for_span("token_batch", 3))
    (cancelled,) = traced.metric_points("tokenspout.server.requests.cancelled")
    assert cancelled.value == 1


def test_prompt_and_output_text_only_with_the_opt_in():
    server = TracedServer(record_content=True)
    try:
        request = pb.GenerateStreamRequest(
            chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="Say hi")]),
            sampling=pb.SamplingParams(temperature=0), stopping=pb.StoppingCriteria(max_new_tokens=4),
        )
        with grpc.insecure_channel(server.address) as channel:
            text = "".join(m.text for m in pb_grpc.GenerationServiceStub(channel).GenerateStream(request, timeout=60))
        (rpc,) = server.wait_for_span(RPC_SPAN)
        (message,) = json.loads(rpc.attributes["gen_ai.input.messages"])
        assert message["role"] == "user" and message["parts"][0]["content"] == "Say hi"
        (output,) = json.loads(rpc.attributes["gen_ai.output.messages"])
        assert output["parts"][0]["content"] == text
    finally:
        server.close()


def test_errors_are_counted_by_status_code(traced):
    with grpc.insecure_channel(traced.address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        for _ in range(2):
            with pytest.raises(grpc.RpcError):
                list(stub.GenerateStream(greedy(""), timeout=10))
        with pytest.raises(grpc.RpcError):
            stub.Tokenize(pb.TokenizeRequest(model="nope", text="x"), timeout=10)
    counts = {p.attributes["rpc.grpc.status_code"]: p.value for p in traced.metric_points("tokenspout.server.requests.errors")}
    assert counts == {"INVALID_ARGUMENT": 2, "NOT_FOUND": 1}


@pytest.mark.parametrize("kind", list(ErrorKind), ids=lambda kind: kind.value)
def test_each_engine_error_reaches_the_caller_and_the_span_as_service_errors_maps_it(traced, kind):
    traced.engine.plan("doomed-", fail_after=2, error=kind, message=f"scripted {kind.value}")
    request = greedy("Once", max_new_tokens=20, ignore_eos=True)
    request.request_id = f"doomed-{kind.value}"
    expected = from_engine(ErrorEvent("", kind), request.request_id)
    with grpc.insecure_channel(traced.address) as channel:
        error = rpc_error(lambda: pb_grpc.GenerationServiceStub(channel).GenerateStream(request, timeout=30))
    assert error.code() == expected.code and error_reason(error) == expected.reason
    assert f"scripted {kind.value}" in error.details()
    (rpc,) = traced.wait_for_span(RPC_SPAN)
    assert rpc.status.status_code is trace.StatusCode.ERROR
    assert rpc.attributes["error.type"] == expected.code.name
    assert rpc.attributes["tokenspout.error.reason"] == expected.reason


def test_telemetry_is_off_without_an_endpoint(monkeypatch):
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    telemetry = from_environment()
    assert not telemetry.enabled and telemetry.interceptors() == []


def test_spans_and_metrics_arrive_over_otlp_grpc_with_json_logs_and_prometheus(tmp_path):
    collector, receiver, port = start_collector()
    prometheus_port = _free_port()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_SERVICE_NAME": "tokenspout-test",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_METRIC_EXPORT_INTERVAL": "300",
    }
    server = start_server(tmp_path, "--max-batch-size", "2", "--context-length", "256", "--log-format", "json",
                          "--prometheus-port", str(prometheus_port), env=env, fake_engine=True)
    try:
        with grpc.insecure_channel(server.address) as channel:
            messages = list(pb_grpc.GenerationServiceStub(channel).GenerateStream(
                greedy("Hello", max_new_tokens=5, ignore_eos=True), metadata=[("x-request-id", "req-from-header")], timeout=60
            ))
        assert {m.request_id for m in messages} == {"req-from-header"}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (
            {"token_batch", RPC_SPAN} <= {s.name for s in collector.spans}
            and "gen_ai.server.time_to_first_token" in collector.metric_names
        ):
            time.sleep(0.1)
        names = [s.name for s in collector.spans]
        assert sum(len(m.tokens) for m in messages) == 5
        assert names.count("token_batch") == len(messages)  # one span per message
        assert RPC_SPAN in names and {"queue", "prefill"} <= set(names)
        assert collector.resource_attributes["service.name"] == "tokenspout-test"
        assert "gen_ai.server.time_to_first_token" in collector.metric_names
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{prometheus_port}/metrics", timeout=10).read().decode()
        assert "gen_ai_server_time_to_first_token" in scraped
    finally:
        assert stop_server(server) == 0
        receiver.stop(None)
    records = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    finished = [r for r in records if r.get("request_id") == "req-from-header"]
    assert finished and all(len(r["trace_id"]) == 32 for r in finished)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_engines_attention_provider_is_on_every_requests_span_and_metrics():
    traced = TracedServer(attention_provider="sdpa")
    try:
        with grpc.insecure_channel(traced.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            list(stub.GenerateStream(greedy("The sky is", max_new_tokens=3), timeout=60))
            assert stub.GetModelInfo(pb.GetModelInfoRequest()).attention_provider == "sdpa"
            assert stub.GetServerStatus(pb.GetServerStatusRequest()).attention_provider == "sdpa"
        (rpc,) = traced.wait_for_span(RPC_SPAN)
        assert rpc.attributes["tokenspout.attention_provider"] == "sdpa"
        (duration,) = traced.metric_points("gen_ai.server.request.duration")
        assert duration.attributes["tokenspout.attention_provider"] == "sdpa"
    finally:
        traced.close()


def test_two_callers_running_the_same_request_id_each_trace_the_id_they_sent():
    # The engine knows the second by another id (service.call.Calls.engine_id); its trace shows the caller's.
    keys = {"alice": "alice-secret-key", "bob": "bob-secret-key"}
    digests = ",".join(f"{name}:{hashlib.sha256(key.encode()).hexdigest()}" for name, key in keys.items())
    traced = TracedServer(env={"TOKENSPOUT_API_KEYS": digests})
    try:
        held = traced.engine.plan("shared-", hold_after=1)  # each keeps running, after its first token, until released
        request = greedy("The sky is", max_new_tokens=4, ignore_eos=True)
        request.request_id = "shared-id"
        with grpc.insecure_channel(traced.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            calls = {
                name: stub.GenerateStream(request, metadata=(("authorization", f"Bearer {key}"),), timeout=60)
                for name, key in keys.items()
            }
            firsts = [next(call) for call in calls.values()]  # both running at once
            traced.engine.let_go(held)
            lasts = [list(call)[-1] for call in calls.values()]
        assert [m.request_id for m in firsts + lasts] == ["shared-id"] * 4
        assert [m.finish.reason for m in lasts] == [pb.FinishReason.FINISH_REASON_MAX_TOKENS] * 2
        rpcs = {span.attributes["tokenspout.caller"]: span.attributes for span in traced.wait_for_span(RPC_SPAN, 2)}
        assert sorted(rpcs) == ["alice", "bob"]
        for attributes in rpcs.values():
            assert attributes["tokenspout.request_id"] == attributes["gen_ai.response.id"] == "shared-id"
    finally:
        traced.close()
