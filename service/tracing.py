"""Spans and metrics for one generation request.

Under the RPC span (from the gRPC interceptor): a `queue` span, a `prefill`
span, and one `token_batch` span per streamed message. GenAI semantic
convention attributes go on the RPC span; metrics are recorded at the end.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from opentelemetry.util.types import AttributeValue

from backend import Finish, GenerationRequest, TokenEvent
from service.errors import ServiceError
from service.telemetry import Telemetry
from tokenspout.v1 import generation_pb2 as pb

PROVIDER = "tokenspout"
# monotonic -> epoch nanoseconds, for spans placed after the fact from engine timings.
_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def _epoch_ns(monotonic_s: float) -> int:
    return int(monotonic_s * 1e9) + _EPOCH_OFFSET_NS


class RequestTrace:
    def __init__(self, telemetry: Telemetry, request: pb.GenerateStreamRequest, request_id: str,
                 generation: GenerationRequest, model_id: str, streaming: bool) -> None:
        """`request_id` is the id the caller knows the request by (the engine's own may differ: see
        service.call.Calls.engine_id); the trace shows the caller's."""
        self._telemetry = telemetry
        self._generation = generation
        self._span = trace.get_current_span()
        self._context = trace.set_span_in_context(self._span)
        self._batches = 0
        self._position = 0
        self._operation = "chat" if request.HasField("chat") else "text_completion"
        self._metric_attributes: dict[str, AttributeValue] = {
            "gen_ai.operation.name": self._operation,
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": model_id,
            **telemetry.engine_attributes,  # tokenspout.attention_provider
        }
        sampling, stopping = generation.sampling, generation.stopping
        attributes: dict[str, AttributeValue] = {
            **self._metric_attributes,
            "gen_ai.request.stream": streaming,
            "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.request.top_p": sampling.top_p,
            "gen_ai.request.top_k": float(sampling.top_k),
            "gen_ai.request.max_tokens": stopping.max_new_tokens,
            "gen_ai.request.seed": sampling.seed,
            "gen_ai.request.frequency_penalty": sampling.frequency_penalty,
            "gen_ai.request.presence_penalty": sampling.presence_penalty,
            "gen_ai.response.id": request_id,
            "gen_ai.response.model": model_id,
            "tokenspout.request_id": request_id,
            "tokenspout.caller": generation.scheduling.caller,
            "tokenspout.request.priority": generation.scheduling.priority,
        }
        if stopping.stop_sequences:
            attributes["gen_ai.request.stop_sequences"] = list(stopping.stop_sequences)
        if generation.constraint is not None:
            attributes["tokenspout.constraint.kind"] = generation.constraint.kind
        if telemetry.record_content:
            if request.HasField("chat"):
                messages = [{"role": m.role, "parts": [{"type": "text", "content": m.content}]} for m in request.chat.messages]
            else:
                messages = [{"role": "user", "parts": [{"type": "text", "content": request.prompt}]}]
            attributes["gen_ai.input.messages"] = json.dumps(messages, ensure_ascii=False)
        self._span.set_attributes(attributes)
        self._text: list[str] = []

    @contextlib.contextmanager
    def batch(self, events: list[TokenEvent]) -> Iterator[None]:
        """One span per streamed message; its body is the write, so it also measures waiting on the caller."""
        tokens = sum(len(event.tokens) for event in events)
        first = self._position
        self._position += tokens
        if self._telemetry.record_content:
            self._text.extend(event.text for event in events)
        attributes: dict[str, AttributeValue] = {
            "tokenspout.batch.index": self._batches,
            "tokenspout.batch.tokens": tokens,
            "tokenspout.batch.first_token_position": first,
            "tokenspout.batch.last_token_position": max(first, self._position - 1),
            "tokenspout.batch.engine_steps": len({event.step for event in events}),
            "tokenspout.batch.constraint_mask_ms": sum(event.mask_s for event in events) * 1000,
            "tokenspout.batch.accepted_draft_tokens": sum(event.accepted_drafts for event in events),
        }
        finish = events[-1].finish
        if finish is not None:  # the last batch also carries how the request ended
            attributes["gen_ai.response.finish_reasons"] = [finish.reason.value]
            attributes["gen_ai.usage.output_tokens"] = finish.usage.completion_tokens
        self._batches += 1
        # Not made current: the handler is an async generator, and a context attached across a
        # yield cannot be detached safely if the caller goes away mid-write.
        span = self._telemetry.tracer.start_span("token_batch", context=self._context, attributes=attributes)
        start = time.perf_counter()
        try:
            yield
        finally:
            span.set_attribute("tokenspout.batch.caller_wait_ms", (time.perf_counter() - start) * 1000)
            span.end()

    def finished(self, finish: Finish) -> None:
        usage, timings = finish.usage, finish.timings
        arrival = self._generation.arrival_time
        tracer = self._telemetry.tracer
        admitted = arrival + timings.queue_s
        prefill_attributes: dict[str, AttributeValue] = {
            "tokenspout.prefill.prompt_tokens": usage.prompt_tokens,
            "tokenspout.prefill.cached_tokens": usage.cached_tokens,  # taken from the prefix cache
        }
        for name, start, end, span_attributes in (
            ("queue", arrival, admitted, {}),
            ("prefill", admitted, admitted + timings.prefill_s, prefill_attributes),
        ):
            span = tracer.start_span(name, context=self._context, start_time=_epoch_ns(start), attributes=span_attributes)
            span.end(end_time=_epoch_ns(end))
        attributes: dict[str, AttributeValue] = {
            "gen_ai.response.finish_reasons": [finish.reason.value],
            "gen_ai.usage.input_tokens": usage.prompt_tokens,
            "gen_ai.usage.output_tokens": usage.completion_tokens,
            "gen_ai.response.time_to_first_chunk": timings.time_to_first_token_s,
            "tokenspout.queue_ms": timings.queue_s * 1000,
            "tokenspout.batches": self._batches,
            "tokenspout.usage.draft_tokens": usage.draft_tokens,
            "tokenspout.usage.accepted_draft_tokens": usage.accepted_draft_tokens,
        }
        if finish.constraint_satisfied is not None:
            attributes["tokenspout.constraint.satisfied"] = finish.constraint_satisfied
        if self._telemetry.record_content:
            output = [{"role": "assistant", "parts": [{"type": "text", "content": "".join(self._text)}],
                       "finish_reason": finish.reason.value}]
            attributes["gen_ai.output.messages"] = json.dumps(output, ensure_ascii=False)
        self._span.set_attributes(attributes)
        labels = self._metric_attributes
        self._telemetry.request_duration.record(timings.total_s, labels)
        self._telemetry.time_to_first_token.record(timings.time_to_first_token_s, labels)
        if usage.completion_tokens > 1:
            self._telemetry.time_per_output_token.record(timings.decode_s / (usage.completion_tokens - 1), labels)
        self._telemetry.token_usage.record(usage.prompt_tokens, {**labels, "gen_ai.token.type": "input"})
        self._telemetry.token_usage.record(usage.completion_tokens, {**labels, "gen_ai.token.type": "output"})
        caller = {"tokenspout.caller": self._telemetry.caller_label(self._generation.scheduling.caller)}
        self._telemetry.caller_tokens.add(usage.prompt_tokens, {**caller, "gen_ai.token.type": "input"})
        self._telemetry.caller_tokens.add(usage.completion_tokens, {**caller, "gen_ai.token.type": "output"})

    def ended_early(self, reason: str) -> None:
        """The caller cancelled, disconnected or ran out of time."""
        self._span.set_attribute("gen_ai.response.finish_reasons", [reason])
        self._span.add_event("cancelled", {"tokenspout.reason": reason, "tokenspout.generated_tokens": self._position})
        self._telemetry.cancelled.add(1, self._metric_attributes)

    def failed(self, error: ServiceError) -> None:
        """The request ended with this status (the engine's error kind, as service.errors maps it)."""
        self._span.set_status(Status(StatusCode.ERROR, error.message))
        self._span.set_attribute("error.type", error.code.name)
        self._span.set_attribute("tokenspout.error.reason", error.reason)
