"""A stand-in OpenTelemetry Collector: the collector's own OTLP/gRPC services, keeping what arrives."""

from __future__ import annotations

from concurrent import futures

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Collector(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    """The OTLP collector's own gRPC services, keeping what they receive."""

    def __init__(self) -> None:
        self.spans: list = []
        self.metric_names: set[str] = set()
        self.resource_attributes: dict[str, str] = {}

    def Export(self, request, context):  # both services call their method Export
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            for resource_spans in request.resource_spans:
                self.resource_attributes.update(
                    {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                )
                self.spans += [s for scope in resource_spans.scope_spans for s in scope.spans]
            return trace_service_pb2.ExportTraceServiceResponse()
        for resource_metrics in request.resource_metrics:
            self.metric_names |= {m.name for scope in resource_metrics.scope_metrics for m in scope.metrics}
        return metrics_service_pb2.ExportMetricsServiceResponse()


def start_collector() -> tuple[Collector, grpc.Server, int]:
    collector = Collector()
    receiver = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, receiver)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(collector, receiver)
    port = receiver.add_insecure_port("127.0.0.1:0")
    receiver.start()
    return collector, receiver, port
