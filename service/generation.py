"""The GenerationService servicer: validate, submit, stream the events back.

Each request gets its own asyncio queue, fed from the engine thread. The
handler sends whatever has queued up as one message (up to
`max_tokens_per_message` tokens): a caller that keeps up gets one token per
message, one that falls behind gets fewer, larger messages. When the caller
cancels, disconnects or runs out of deadline, the handler's `finally` cancels
the request in the engine, which frees its cache at the next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator

import grpc

from backend.constraints.validation import json_output_problem
from backend.engine import Engine, EventSink
from backend.types import ErrorEvent, Event, GenerationRequest, TokenEvent
from service import convert
from service.errors import FieldViolation, ServiceError, internal, invalid_argument
from service.validate import RequestValidator
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# Prompts longer than this are tokenized off the event loop.
_INLINE_TOKENIZE_CHARS = 16_384


class EventRelay:
    """Carries events from the engine thread to per-request asyncio queues.

    One engine step delivers an event to every running sequence; waking the
    event loop once per burst instead of once per event leaves more of the CPU
    to the model.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[Event], Event]] = []

    def sink(self, events: asyncio.Queue[Event]) -> EventSink:
        return lambda event: self._post(events, event)

    def _post(self, events: asyncio.Queue[Event], event: Event) -> None:
        with self._lock:
            self._pending.append((events, event))
            wake = len(self._pending) == 1  # otherwise a flush is already scheduled
        if wake:
            self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for events, event in pending:
            events.put_nowait(event)


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, engine: Engine, validator: RequestValidator) -> None:
        self._engine = engine
        self._validator = validator
        self._relay: EventRelay | None = None

    async def GenerateStream(
        self, request: pb.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        try:
            generation = await self._validate(request)
            async for message in self._stream(generation, request.output.max_tokens_per_message):
                yield message
        except ServiceError as error:
            await context.abort_with_status(error.to_status())

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        # Same fields under the same numbers: the wire bytes are a valid stream request.
        stream_request = pb.GenerateStreamRequest.FromString(request.SerializeToString())
        try:
            generation = await self._validate(stream_request)
            messages = [m async for m in self._stream(generation, max_tokens_per_message=0)]
        except ServiceError as error:
            await context.abort_with_status(error.to_status())
        return convert.unary_response(messages)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            self._validator.check_model(request.model)
            tokens = self._validator.prompt_tokens(request)
        except ServiceError as error:
            await context.abort_with_status(error.to_status())
        pieces = [self._engine.token_piece(t) for t in tokens]
        return pb.TokenizeResponse(token_ids=tokens, pieces=pieces, count=len(tokens))

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        try:
            self._validator.check_model(request.model)
        except ServiceError as error:
            await context.abort_with_status(error.to_status())
        info, limits = self._engine.info, self._validator.limits
        return pb.GetModelInfoResponse(
            model_id=info.model_id,
            engine=info.engine,
            context_length=info.context_length,
            vocab_size=info.vocab_size,
            special_tokens=pb.SpecialTokens(bos_token_id=info.bos_token_id, eos_token_ids=info.eos_token_ids),
            samplers=info.samplers,
            constraint_kinds=info.constraint_kinds,
            has_chat_template=info.has_chat_template,
            limits=pb.Limits(
                max_batch_size=info.max_batch_size,
                max_new_tokens=info.context_length,
                max_stop_sequences=limits.max_stop_sequences,
                max_stop_sequence_length=limits.max_stop_sequence_length,
                max_top_logprobs=limits.max_top_logprobs,
                max_logit_bias_entries=limits.max_logit_bias_entries,
            ),
        )

    async def CompileConstraint(
        self, request: pb.CompileConstraintRequest, context: grpc.aio.ServicerContext
    ) -> pb.CompileConstraintResponse:
        try:
            self._validator.check_model(request.model)
            violations: list[FieldViolation] = []
            spec = self._validator.constraint_spec(request.constraint, violations)
            if violations:
                raise invalid_argument(violations)
            compiled = await asyncio.to_thread(self._validator.compile, spec)
        except ServiceError as error:
            await context.abort_with_status(error.to_status())
        return pb.CompileConstraintResponse(
            compile_ms=0.0 if compiled.cached else compiled.compile_s * 1000,
            cached=compiled.cached,
            warnings=compiled.warnings,
        )

    async def _validate(self, request: pb.GenerateStreamRequest) -> GenerationRequest:
        # Long prompts and constraint compiles run on a worker thread (both release the GIL).
        if len(request.prompt) > _INLINE_TOKENIZE_CHARS or self._validator.needs_compiling(request):
            return await asyncio.to_thread(self._validator.generation_request, request)
        return self._validator.generation_request(request)

    async def _stream(
        self, request: GenerationRequest, max_tokens_per_message: int
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        """Submits the request and yields one message per batch of queued events."""
        if self._relay is None:  # created on first use, inside the server's event loop
            self._relay = EventRelay(asyncio.get_running_loop())
        events: asyncio.Queue[Event] = asyncio.Queue()
        self._engine.submit(request, self._relay.sink(events))
        finished = False
        input_tokens = len(request.prompt_token_ids)
        with_tokens = request.output.return_tokens
        validate_afterwards = request.constraint is not None and not request.constraint.spec.strict
        text: list[str] = []
        try:
            while not finished:
                batch = await _next_batch(events, max_tokens_per_message)
                if isinstance(batch, ErrorEvent):
                    finished = True
                    log.error("request %s failed in the engine: %s", request.request_id, batch.message)
                    raise internal(request.request_id, batch.message)
                finished = batch[-1].finish is not None
                message = convert.stream_response(request.request_id, batch, with_tokens, input_tokens)
                if validate_afterwards:
                    text.append(message.text)
                    if finished:
                        _report_validation(message.finish, request, "".join(text))
                yield message
                input_tokens = 0  # only on the first message
        finally:
            if not finished:  # the caller left early: free the sequence at the next step
                self._engine.cancel(request.request_id)


def _report_validation(finish: pb.Finish, request: GenerationRequest, text: str) -> None:
    """Non-strict JSON constraints were approximated: say honestly whether the output complies."""
    problem = json_output_problem(request.constraint.spec, text)
    if problem:
        finish.constraint_satisfied = False
        finish.constraint_message = problem


async def _next_batch(events: asyncio.Queue[Event], max_tokens: int) -> list[TokenEvent] | ErrorEvent:
    """Waits for one event, then takes whatever else is queued, up to `max_tokens` tokens."""
    first = await events.get()
    if isinstance(first, ErrorEvent):
        return first
    batch = [first]
    tokens = len(first.tokens)
    while batch[-1].finish is None and not events.empty():
        if max_tokens and tokens >= max_tokens:
            break
        event = events.get_nowait()
        if isinstance(event, ErrorEvent):
            return event
        batch.append(event)
        tokens += len(event.tokens)
    return batch
