"""The GenerationService servicer: admit, validate, submit, stream the events back.

A caller that keeps up gets one token per message; one that falls behind gets
what has queued up in one message (up to `max_tokens_per_message`), and if its
buffer fills, its sequence is paused (see service.streams). When the caller
cancels, disconnects or runs out of deadline, grpc.aio cancels the handler and
its `finally` cancels the request in the engine, which frees the cache before
the next step.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from typing import AsyncIterator, Callable, Iterator, TypeVar

import grpc
from opentelemetry import trace

from backend import Engine, ErrorEvent, ErrorKind, Finish, FinishReason, GenerationRequest, Scheduling, TokenEvent
from backend.constraints import json_output_problem
from service import auth, convert
from service.callers import Callers
from service.compiles import CompileGate
from service.config import ServeConfig
from service.errors import (
    CURRENT_REQUEST_ID, FieldViolation, ServiceError, already_exists, deadline_exceeded, from_engine, invalid_argument,
    unimplemented,
)
from service.lifecycle import Lifecycle, Phase
from service.offsets import token_offsets
from service.shares import Shares
from service.streams import EventRelay, RequestStream
from service.telemetry import Telemetry
from service.tracing import RequestTrace
from service.validate import RequestValidator, input_bytes
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# Inputs larger than this are tokenized off the event loop (llama.cpp's tokenizer drops the GIL).
_INLINE_TOKENIZE_BYTES = 16_384
_TOKENIZE_SLICE = 8_192

_REFUSALS = (ErrorKind.SHED, ErrorKind.QUEUE_TIMEOUT)
T = TypeVar("T")
Message = TypeVar("Message", pb.GenerateStreamRequest, pb.TokenizeRequest)


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(
        self,
        engine: Engine,
        validator: RequestValidator,
        config: ServeConfig,
        lifecycle: Lifecycle,
        telemetry: Telemetry | None = None,
    ) -> None:
        self._engine = engine
        self._lifecycle = lifecycle
        self._telemetry = telemetry or Telemetry(enabled=False)
        self._validator = validator
        self._config = config
        engine_config = config.engine
        self._fair = engine_config.fairness.fair
        self._shares = Shares(engine.info.max_batch_size + engine_config.max_queued_requests, config.per_caller_limit,
                              self._fair)
        self._callers = Callers(config.caller_weights, config.priority_callers, config.fairness_header)
        self._active: dict[tuple[str, str], RequestStream] = {}
        """Running requests by (caller identity, request id): callers see only their own."""
        self._compiles = CompileGate(
            engine.constraints, config.compile_threads, config.max_concurrent_compiles, config.compile_timeout_s
        )
        self._relay: EventRelay | None = None
        self.rejected_total = 0

    def _engine_id(self, request_id: str) -> str:
        """The id the engine knows a request by: its own, unless another caller's request has it now."""
        in_use = {stream.request_id for stream in self._active.values()}
        engine_id, n = request_id, 0
        while engine_id in in_use:
            n += 1
            engine_id = f"{request_id}~{n}"
        return engine_id

    async def GenerateStream(
        self, request: pb.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        with self._slot(request, context) as scheduling:
            generation = await self._validate(request, context, scheduling)
            async with contextlib.aclosing(self._stream(request, generation)) as messages:
                async for message in messages:
                    await _write(context, message)
        return
        yield  # an async generator, as gRPC's interceptors expect, that writes its messages itself (see _write)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        # Same fields under the same numbers: the wire bytes are a valid stream request.
        stream_request = pb.GenerateStreamRequest.FromString(request.SerializeToString())
        stream_request.output.max_tokens_per_message = 0
        stream_request.output.heartbeat_interval_ms = 0
        with self._slot(stream_request, context) as scheduling:
            generation = await self._validate(stream_request, context, scheduling)
            messages = [m async for m in self._stream(stream_request, generation, streaming=False)]
        return convert.unary_response(messages)

    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext) -> pb.CancelResponse:
        response = pb.CancelResponse()
        caller = auth.caller()
        for request_id in request.request_ids:
            stream = self._active.get((caller, request_id))  # another caller's request reads as not found
            if stream is not None:
                self._engine.cancel(stream.request_id)
                response.cancelled.append(request_id)
            else:
                response.not_found.append(request_id)
        return response

    async def GetServerStatus(
        self, request: pb.GetServerStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerStatusResponse:
        stats = self._engine.stats
        return pb.GetServerStatusResponse(
            running_sequences=stats.running_sequences,
            queued_requests=stats.queued_requests,
            paused_sequences=stats.paused_sequences,
            cache_tokens_used=stats.cache_tokens_used,
            cache_tokens_free=stats.cache_tokens_total - stats.cache_tokens_used,
            max_batch_size=self._engine.info.max_batch_size,
            max_queued_requests=self._config.engine.max_queued_requests,
            engine_steps=stats.steps,
            cancelled_total=stats.cancelled_total,
            last_cancel_latency_steps=stats.last_cancel_latency_steps,
            last_cancel_latency_ms=stats.last_cancel_latency_s * 1000,
            max_cancel_latency_steps=stats.max_cancel_latency_steps,
            rejected_total=self.rejected_total,
            draining=self._lifecycle.phase is Phase.DRAINING,
            started_total=stats.started_total,
            cached_prefixes=stats.prefix_cache_entries,
            cached_prefix_tokens=stats.prefix_cache_tokens,
            prompt_tokens_total=stats.prompt_tokens_total,
            cached_prompt_tokens_total=stats.cached_prompt_tokens_total,
            prefix_cache_hit_rate=stats.prefix_hit_rate,
            preempted_total=stats.preempted_total,
            preempted_sequences=stats.preempted_sequences,
            recomputed_tokens_total=stats.recomputed_tokens_total,
            draft_tokens_total=stats.draft_tokens_total,
            accepted_draft_tokens_total=stats.accepted_draft_tokens_total,
            attention_provider=self._engine.info.attention_provider,
            callers=convert.caller_statuses(stats.callers, self._shares.refused, self._callers.weight),
        )

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        self._validator.check_model(request.model)
        return await self._off_loop_if_large(self._tokenize_response, request)

    def _tokenize_response(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        response = pb.TokenizeResponse()
        self._validator.check_tokenize(request)
        if request.HasField("chat"):
            self._fill_tokens(response, self._validator.prompt_tokens(request))
            return response
        texts = self._validator.tokenize_texts(request)
        if request.texts:
            for data, tokens in texts:
                self._fill_tokens(response.results.add(), tokens, data if request.return_offsets else None)
        else:
            data, tokens = texts[0]
            self._fill_tokens(response, tokens, data if request.return_offsets else None)
        return response

    def _fill_tokens(self, result: pb.TokenizeResponse | pb.TokenizeResult, tokens: list[int],
                     offsets_in: bytes | None = None) -> None:
        """Ids, pieces and count, with the offsets of the tokens in `offsets_in` when given."""
        result.count = len(tokens)
        pieces: list[bytes] = []
        # In slices: one protobuf call over 300,000 pieces holds the GIL for ~50 ms, and the
        # event loop (health checks included) would wait that long for it.
        for start in range(0, len(tokens), _TOKENIZE_SLICE):
            part = tokens[start : start + _TOKENIZE_SLICE]
            result.token_ids.extend(part)
            part_pieces = [self._engine.token_piece(t) for t in part]
            result.pieces.extend(part_pieces)
            pieces += part_pieces
        if offsets_in is not None:
            offsets = token_offsets(offsets_in, pieces)
            for name in ("byte_starts", "byte_ends", "char_starts", "char_ends"):
                getattr(result.offsets, name).extend(getattr(offsets, name))

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        self._validator.check_model(request.model)
        return convert.model_info(self._engine.info, self._validator.limits)

    async def CompileConstraint(
        self, request: pb.CompileConstraintRequest, context: grpc.aio.ServicerContext
    ) -> pb.CompileConstraintResponse:
        self._validator.check_model(request.model)
        violations: list[FieldViolation] = []
        spec = self._validator.constraint_spec(request.constraint, violations)
        if violations:
            raise invalid_argument(violations)
        compiled = await self._compiles.compile(spec)
        return pb.CompileConstraintResponse(
            compile_ms=compiled.fresh_compile_s * 1000,
            cached=compiled.cached,
            warnings=compiled.warnings,
        )

    @contextlib.contextmanager
    def _slot(self, request: pb.GenerateStreamRequest, context: grpc.aio.ServicerContext) -> Iterator[Scheduling]:
        """Admission control: a place in the batch or the bounded queue within the caller's share and limit,
        or an immediate refusal (see service.shares); yields who the request is for."""
        if self._lifecycle.refusal is not None:
            raise self._lifecycle.refusal
        identity = auth.caller()
        key = self._callers.key(identity, context.invocation_metadata() or ())
        if request.priority and not self._fair:
            raise unimplemented([FieldViolation("priority", "this server schedules first come, first served "
                                                "(scheduling = fifo): leave priority at 0")])
        self._callers.check_priority(identity, request.priority)
        if request.n > self._validator.limits.max_samples:  # before it is counted as that many places
            raise invalid_argument([FieldViolation("n", f"at most {self._validator.limits.max_samples} samples")])
        places = max(1, request.n)
        weight = self._callers.weight(key)
        try:
            self._shares.check(key, weight, request.priority, places)
        except ServiceError as refusal:
            self.rejected_total += 1
            if self._telemetry.enabled:
                self._telemetry.count_rejection(key, refusal.reason)
            raise
        with self._shares.hold(key, weight, request.priority, places), self._lifecycle.call():
            yield Scheduling(key, weight, request.priority)

    async def _validate(
        self, request: pb.GenerateStreamRequest, context: grpc.aio.ServicerContext, scheduling: Scheduling
    ) -> GenerationRequest:
        """See RequestValidator; adds who it is for, the caller's deadline, and its x-request-id when it gave no
        request_id."""
        if not request.request_id:
            metadata = dict(context.invocation_metadata() or ())
            request.request_id = metadata.get("x-request-id", "")[: self._validator.limits.max_request_id_length]
        generation, spec = await self._off_loop_if_large(self._validator.generation_request, request)
        CURRENT_REQUEST_ID.set(generation.request_id)
        queue_timeout_s = request.queue_timeout_ms / 1000 if request.queue_timeout_ms else None
        scheduling = dataclasses.replace(scheduling, queue_timeout_s=queue_timeout_s)
        generation = dataclasses.replace(generation, scheduling=scheduling)
        if spec is not None:
            generation = dataclasses.replace(generation, constraint=await self._compiles.compile(spec))
        remaining = context.time_remaining()
        if remaining is not None:
            generation = dataclasses.replace(generation, deadline=time.monotonic() + remaining)
        return generation

    @staticmethod
    async def _off_loop_if_large(work: Callable[[Message], T], request: Message) -> T:
        """Runs tokenizing work on a worker thread when the input is large, so the loop never stalls."""
        if input_bytes(request) > _INLINE_TOKENIZE_BYTES:
            return await asyncio.to_thread(work, request)
        return work(request)

    async def _stream(
        self, request: pb.GenerateStreamRequest, generation: GenerationRequest, streaming: bool = True
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        """Submits the request and yields one message per batch of queued events."""
        request_id = generation.request_id
        if self._lifecycle.ending is not None:
            raise self._lifecycle.ending
        if self._relay is None:  # created on first use, inside the server's event loop
            self._relay = EventRelay(asyncio.get_running_loop())
        key = (auth.caller(), request_id)
        if key in self._active:
            raise already_exists(request_id)
        engine_id = self._engine_id(request_id)
        stream = RequestStream(self._engine, engine_id, self._config.stream_buffer_events)
        self._active[key] = stream
        tracing = (
            RequestTrace(self._telemetry, request, generation, self._engine.info.model_id, streaming)
            if self._telemetry.enabled
            else None
        )
        submitted = generation if engine_id == request_id else dataclasses.replace(generation, request_id=engine_id)
        self._engine.submit(submitted, self._relay.sink(stream))
        output = request.output
        batching = (output.max_tokens_per_message, max(output.min_tokens_per_message, 1), output.flush_interval_ms / 1000)
        samples = generation.n
        started: set[int] = set()  # samples that have sent their first message
        finishes: dict[int, Finish] = {}
        validate_afterwards = generation.constraint is not None and not generation.constraint.spec.strict
        texts: dict[int, list[str]] = collections.defaultdict(list)
        ended = False  # every sample finished, or the engine failed the request
        try:
            with self._lifecycle.interruptible(stream.interrupt):
                while len(finishes) < samples:
                    batch = await stream.next_batch(*batching, heartbeat_s=output.heartbeat_interval_ms / 1000)
                    if self._lifecycle.ending is not None:  # the grace period is over, or the engine died
                        raise self._lifecycle.ending
                    if batch is None:
                        yield pb.GenerateStreamResponse(request_id=request_id, heartbeat=True)
                        continue
                    if isinstance(batch, ErrorEvent):
                        ended = True
                        if samples > 1:  # one sample's failure fails the call: the others end with it
                            self._engine.cancel(engine_id)
                        error = from_engine(batch, request_id)
                        if batch.kind in _REFUSALS:  # for load, after it was let in
                            if batch.kind is ErrorKind.SHED:
                                self.rejected_total += 1
                            if self._telemetry.enabled:
                                self._telemetry.count_rejection(generation.scheduling.caller, error.reason)
                        if tracing:
                            tracing.failed(error)
                        # The engine's own fault is an error; a caller's constraint or absence is not.
                        level = logging.ERROR if error.code is grpc.StatusCode.INTERNAL else logging.INFO
                        log.log(level, "request %s failed (%s): %s", request_id, error.reason, batch.message,
                                extra=_ids(request_id))
                        raise error
                    for index, events in _by_sample(batch):
                        first = index not in started
                        started.add(index)
                        message = convert.stream_response(request_id, events, generation.output.return_tokens,
                                                          len(generation.prompt_token_ids) if first else 0)
                        message.index = index
                        if first:
                            message.truncated_input_tokens = generation.truncated_tokens
                        finish = events[-1].finish
                        if finish is not None:
                            finishes[index] = finish
                            if finish.reason is FinishReason.TIME_LIMIT and generation.ends_at_deadline:
                                # gRPC's contract: a call past the caller's deadline fails. Ending it OK would
                                # race the caller's own timer, so a loaded client could see either outcome.
                                raise deadline_exceeded(request_id, events[-1].generated_tokens)
                        if validate_afterwards:
                            texts[index].append(message.text)
                            if finish is not None:
                                _report_validation(message.finish, generation, "".join(texts[index]))
                        if tracing:
                            with tracing.batch(events):
                                if len(finishes) == samples and finish is not None:
                                    tracing.finished(finish)
                                yield message
                        else:
                            yield message
            ended = True
            finish = finishes[0]
            log.info(
                "request %s finished: %s, %d tokens",
                request_id, finish.reason.value, finish.usage.completion_tokens, extra=_ids(request_id),
            )
        finally:
            del self._active[key]
            if not ended:  # the caller left early (or the server ended it): free the sequences before the next step
                self._engine.cancel(engine_id)
                expired = generation.deadline is not None and time.monotonic() >= generation.deadline
                reason = "time_limit" if expired else "cancelled"
                if self._lifecycle.ending is not None:
                    reason = self._lifecycle.ending.reason.lower()
                    log.info("request %s ended by the server: %s", request_id, reason, extra=_ids(request_id))
                else:
                    log.info("request %s ended by the caller: %s", request_id, reason, extra=_ids(request_id))
                if tracing:
                    tracing.ended_early(reason)


async def _write(context: grpc.aio.ServicerContext, message: pb.GenerateStreamResponse) -> None:
    """Sends one message. A caller that resets its stream while the write waits on HTTP/2 flow control
    fails the write before gRPC marks the call closed, and gRPC would log that as a crash with a
    traceback; it is the caller leaving, so the call ends as gRPC ends any cancelled one."""
    try:
        await context.write(message)
    except grpc.aio.InternalError:  # the call's stream is gone
        raise asyncio.CancelledError from None


def _ids(request_id: str) -> dict[str, str]:
    """Log record fields: the request id, the caller's identity, and the trace id when the request is traced."""
    span_context = trace.get_current_span().get_span_context()
    trace_id = format(span_context.trace_id, "032x") if span_context.is_valid else ""
    return {"request_id": request_id, "trace_id": trace_id, "caller": auth.caller()}


def _by_sample(batch: list[TokenEvent]) -> list[tuple[int, list[TokenEvent]]]:
    """A batch's events grouped by sample, each sample's in order, the samples in order of first event."""
    grouped: dict[int, list[TokenEvent]] = {}
    for event in batch:
        grouped.setdefault(event.index, []).append(event)
    return list(grouped.items())


def _report_validation(finish: pb.Finish, request: GenerationRequest, text: str) -> None:
    """Non-strict JSON constraints were approximated: say honestly whether the output complies."""
    problem = json_output_problem(request.constraint.spec, text)
    if problem:
        finish.constraint_satisfied = False
        finish.constraint_message = problem
