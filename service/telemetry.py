"""OpenTelemetry set-up: tracer, meter and the instruments tokenspout records.

Configured by the standard OTEL_* environment variables. With no exporter
endpoint set (and no Prometheus port), telemetry is off: no interceptor, no
spans, no metric recording, nothing beyond a boolean check per request.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import grpc
from opentelemetry import metrics, trace
from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters
from opentelemetry.metrics import CallbackOptions, Observation

from backend import CallerTally, EngineStats, ModelInfo

if TYPE_CHECKING:  # the SDK is imported only when telemetry is on
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricReader
    from opentelemetry.sdk.trace.export import SpanExporter

EngineRead = Callable[[EngineStats], float]
"""One number read from the engine's stats."""
CallerRead = Callable[[CallerTally], int]
"""One number read from a caller's tally in them."""
Callback = Callable[[CallbackOptions], Iterable[Observation]]
"""An observable instrument's callback: its observations when the reader collects."""

# Bucket boundaries from the GenAI semantic conventions (gen-ai-metrics.md).
_DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
_TOKEN_BUCKETS = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864]
OTHER_CALLERS = "_other"


class MetricsListenError(OSError):
    """The Prometheus listener could not bind (a busy port, an address not on this host): one line, exit 2."""


class CallerLabels:
    """Per-caller metric labels, bounded: the first `limit` callers seen keep their own label for good (so a
    counter never moves between labels), the rest share OTHER_CALLERS."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._named: set[str] = set()

    def __call__(self, caller: str) -> str:
        if caller not in self._named and len(self._named) < self._limit:
            self._named.add(caller)
        return caller if caller in self._named else OTHER_CALLERS


class Telemetry:
    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
        record_content: bool = False,
        enabled: bool = True,
        caller_labels: int = 20,
    ) -> None:
        self.enabled = enabled
        self.caller_label = CallerLabels(caller_labels)
        self.record_content = record_content
        self.engine_attributes: dict[str, str] = {}
        """Attributes of the engine on every request's span and metrics (describe_engine)."""
        """Prompt and output text go into spans only when this opt-in flag is set."""
        self._tracer_provider = tracer_provider
        self.tracer = trace.get_tracer("tokenspout", tracer_provider=tracer_provider)
        meter = metrics.get_meter("tokenspout", meter_provider=meter_provider)
        self.meter = meter
        self.request_duration = meter.create_histogram(
            "gen_ai.server.request.duration", unit="s", explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
            description="Time from arrival to the last output token",
        )
        self.time_to_first_token = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s", explicit_bucket_boundaries_advisory=_TTFT_BUCKETS,
            description="Queue and prefill time until the first output token",
        )
        self.time_per_output_token = meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s", explicit_bucket_boundaries_advisory=_TPOT_BUCKETS,
            description="Decode time per output token after the first",
        )
        # The conventions define token usage for clients only; this is the server-side counterpart.
        self.token_usage = meter.create_histogram(
            "tokenspout.server.token.usage", unit="{token}", explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS,
            description="Input and output tokens per request (gen_ai.token.type)",
        )
        self.cancelled = meter.create_counter("tokenspout.server.requests.cancelled", unit="{request}")
        self.rejected = meter.create_counter("tokenspout.server.requests.rejected", unit="{request}")
        self.errors = meter.create_counter(
            "tokenspout.server.requests.errors", unit="{request}", description="Failed calls by rpc.grpc.status_code"
        )
        self.caller_tokens = meter.create_counter(
            "tokenspout.server.caller.tokens", unit="{token}",
            description="Prompt and generated tokens of finished requests, per caller (gen_ai.token.type)",
        )

    def count_rejection(self, caller: str, reason: str) -> None:
        """A request refused at the door or shed from the queue (ErrorInfo reason), per caller."""
        self.rejected.add(1, {"tokenspout.caller": self.caller_label(caller), "tokenspout.reason": reason})

    def count_error(self, code: grpc.StatusCode) -> None:
        if self.enabled:
            self.errors.add(1, {"rpc.grpc.status_code": code.name})

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """The RPC span for every call (health checks excepted), joined to the caller's trace."""
        if not self.enabled:
            return []
        # The instrumentation's functions carry no annotations.
        interceptor: grpc.aio.ServerInterceptor = aio_server_interceptor(  # type: ignore[no-untyped-call]
            self._tracer_provider, filter_=filters.negate(filters.health_check())
        )
        return [interceptor]

    def describe_engine(self, info: ModelInfo) -> None:
        """What every request's span and metrics say of the engine serving it."""
        self.engine_attributes = {"tokenspout.attention_provider": info.attention_provider} if info.attention_provider else {}

    def observe_engine(self, stats: Callable[[], EngineStats]) -> None:
        def observed(read: EngineRead) -> Callback:
            return lambda options: [Observation(read(stats()))]

        def per_caller_observed(read: CallerRead) -> Callback:
            return lambda options: self._per_caller(stats(), read)

        gauges: dict[str, tuple[str, EngineRead]] = {
            "tokenspout.server.running_sequences": ("{sequence}", lambda s: s.running_sequences),
            "tokenspout.server.paused_sequences": ("{sequence}", lambda s: s.paused_sequences),
            "tokenspout.server.queued_requests": ("{request}", lambda s: s.queued_requests),
            "tokenspout.server.cache.tokens_used": ("{token}", lambda s: s.cache_tokens_used),
        }
        # The Gateway API Inference Extension's model-server protocol (TotalQueuedRequests,
        # TotalRunningRequests, KVCacheUtilization): gauges named after vLLM's, so an endpoint
        # picker or a Prometheus adapter configured for vLLM needs only the prefix changed.
        gauges.update({
            "tokenspout.num_requests_waiting": ("", lambda s: s.queued_requests),
            "tokenspout.num_requests_running": ("", lambda s: s.running_sequences + s.paused_sequences),
            "tokenspout.kv_cache_usage_perc": ("", _cache_utilisation),
        })
        for name, (unit, read) in gauges.items():
            self.meter.create_observable_gauge(name, unit=unit, callbacks=[observed(read)])
        # Speculative decoding: proposed tokens checked, and accepted (their ratio is the acceptance rate).
        totals: dict[str, EngineRead] = {
            "tokenspout.server.draft_tokens": lambda s: s.draft_tokens_total,
            "tokenspout.server.accepted_draft_tokens": lambda s: s.accepted_draft_tokens_total,
        }
        for name, total in totals.items():
            self.meter.create_observable_counter(name, unit="{token}", callbacks=[observed(total)])
        self.meter.create_observable_counter(  # an engine process that died and was started again
            "tokenspout.server.engine_restarts", unit="{restart}", callbacks=[observed(lambda s: s.engine_restarts)]
        )
        per_caller: dict[str, tuple[str, CallerRead]] = {
            "tokenspout.server.caller.running_sequences": ("{sequence}", lambda t: t.running),
            "tokenspout.server.caller.queued_requests": ("{request}", lambda t: t.queued + t.preempted),
        }
        for name, (unit, read_caller) in per_caller.items():
            self.meter.create_observable_gauge(name, unit=unit, callbacks=[per_caller_observed(read_caller)])

    def _per_caller(self, stats: EngineStats, read: CallerRead) -> list[Observation]:
        """One observation per caller label (callers sharing OTHER_CALLERS summed)."""
        values: dict[str, int] = {}
        for tally in stats.callers:
            label = self.caller_label(tally.caller)
            values[label] = values.get(label, 0) + read(tally)
        return [Observation(value, {"tokenspout.caller": label}) for label, value in values.items()]


def _cache_utilisation(stats: EngineStats) -> float:
    """A fraction from 0 to 1, as vLLM's kv_cache_usage_perc despite its name."""
    return stats.cache_tokens_used / stats.cache_tokens_total if stats.cache_tokens_total else 0.0


def from_environment(
    record_content: bool = False, prometheus_port: int = 0, caller_labels: int = 20, prometheus_host: str = "127.0.0.1",
) -> Telemetry:
    """Exporters from the standard OTEL_* variables; off unless an endpoint (or Prometheus) is set."""
    endpoint_set = any(
        os.environ.get(name)
        for name in (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
        )
    )
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true" or not (endpoint_set or prometheus_port):
        return Telemetry(enabled=False)

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "tokenspout")})
    tracer_provider = TracerProvider(resource=resource)
    readers: list[MetricReader] = []
    if endpoint_set:
        span_exporter, metric_exporter = _otlp_exporters()
        tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
        readers.append(PeriodicExportingMetricReader(metric_exporter))
    if prometheus_port:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server

        try:
            start_http_server(prometheus_port, addr=prometheus_host)
        except OSError as exc:
            where = f"{prometheus_host}:{prometheus_port}"
            raise MetricsListenError(f"cannot serve metrics on {where}: {exc.strerror or exc}") from None
        readers.append(PrometheusMetricReader())
    return Telemetry(tracer_provider, MeterProvider(metric_readers=readers, resource=resource), record_content,
                     caller_labels=caller_labels)


def _otlp_exporters() -> tuple[SpanExporter, MetricExporter]:
    """OTLP over gRPC, or over HTTP when OTEL_EXPORTER_OTLP_PROTOCOL says http/protobuf."""
    if os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc").startswith("http"):
        from opentelemetry.exporter.otlp.proto.http import metric_exporter as http_metrics
        from opentelemetry.exporter.otlp.proto.http import trace_exporter as http_traces

        return http_traces.OTLPSpanExporter(), http_metrics.OTLPMetricExporter()
    from opentelemetry.exporter.otlp.proto.grpc import metric_exporter as grpc_metrics
    from opentelemetry.exporter.otlp.proto.grpc import trace_exporter as grpc_traces

    return grpc_traces.OTLPSpanExporter(), grpc_metrics.OTLPMetricExporter()
