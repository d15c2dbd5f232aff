"""One generation call, from the door to its last message.

    call = GenerationCall(calls, request, context)
    with call.admit():                   # who it is for; counted in flight until it ends
        await call.build()               # checks, prompt, constraint, deadline: one GenerationRequest
        await call.run(send)             # submit (the engine's door may refuse it), then one message per batch

Shaped like vLLM's AsyncLLM.generate: one coroutine per request over its own event stream
(service.streams). Leaving it before the engine ended the request (the caller cancelled,
disconnected or ran out of deadline, or the server ended the call) cancels the request in the
engine, which frees its cache before the next step; every call's end gives its places at the engine's
door back (backend.common.door). What the calls share is `Calls`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc
from opentelemetry import trace

from backend import (
    Engine,
    EngineStats,
    ErrorEvent,
    ErrorKind,
    EventSink,
    Finish,
    GenerationRequest,
    Scheduling,
    TokenEvent,
)
from service import auth, convert
from service.cache_scope import cache_salt
from service.callers import Callers
from service.compiles import CompileGate
from service.config import ServeConfig
from service.errors import (
    CURRENT_REQUEST_ID,
    FieldViolation,
    ServiceError,
    already_exists,
    from_engine,
    unimplemented,
)
from service.lifecycle import Lifecycle
from service.prompt import Prompt, PromptBuilder, off_loop_if_large
from service.samples import SampleParser, Samples, by_sample
from service.streams import EventRelay, RequestStream
from service.telemetry import Telemetry
from service.tracing import RequestTrace
from service.validate import RequestParams, RequestValidator
from tokenspout.v1 import generation_pb2 as pb

# The servicer's name, which the log lines had before calls had a module of their own.
log = logging.getLogger("service.generation")

_REFUSALS = (ErrorKind.OVERLOADED, ErrorKind.CALLER_OVER_LIMIT, ErrorKind.SHED, ErrorKind.QUEUE_TIMEOUT)

Context = grpc.aio.ServicerContext[Any, Any]
"""A call's gRPC context (its message types do not matter to what reads it here)."""
Send = Callable[[pb.GenerateStreamResponse], Awaitable[None]]
"""Sends one message of a call: its write to the caller, or a unary call's collection of them."""


class Calls:
    """What the calls share: the engine, the door (lifecycle, callers), the checks, prompts and compiles, and the
    running calls by (caller identity, request id), so that callers see only their own."""

    def __init__(
        self, engine: Engine, validator: RequestValidator, prompts: PromptBuilder, compiles: CompileGate,
        config: ServeConfig, lifecycle: Lifecycle, telemetry: Telemetry,
    ) -> None:
        self.engine = engine
        self.validator = validator
        self.prompts = prompts
        self.compiles = compiles
        self.lifecycle = lifecycle
        self.telemetry = telemetry
        self.fair = config.engine.fairness.fair
        self.callers = Callers(config.caller_weights, config.priority_callers, config.fairness_header)
        self.cache_scope = config.cache_scope
        self._buffer_events = config.stream_buffer_events
        self._running: dict[tuple[str, str], RequestStream] = {}
        self._engine_ids: set[str] = set()
        """The running streams' engine ids (kept, not gathered per call: hundreds of calls start at once)."""
        self._relay: EventRelay | None = None

    def refused(self, key: str, error: ServiceError) -> None:
        """Counts one request refused for load (at the engine's door, shed, or past its queue timeout) per caller
        and reason in the metrics."""
        if self.telemetry.enabled:
            self.telemetry.count_rejection(key, error.reason)

    def engine_id(self, request_id: str) -> str:
        """The id the engine knows a request by: its own, unless another caller's request has it now."""
        engine_id, n = request_id, 0
        while engine_id in self._engine_ids:
            n += 1
            engine_id = f"{request_id}~{n}"
        return engine_id

    def open(self, identity: str, request_id: str, engine_id: str, samples: int) -> RequestStream:
        """The event stream of a call that starts now; ALREADY_EXISTS while its caller runs another of that id."""
        if (identity, request_id) in self._running:
            raise already_exists(request_id)
        stream = RequestStream(self.engine, engine_id, self._buffer_events, samples)
        self._running[identity, request_id] = stream
        self._engine_ids.add(engine_id)
        return stream

    def close(self, identity: str, request_id: str) -> None:
        """The call is over for its caller (its id free for its next call); the engine's id and the request's place
        at the engine's door are given back once the engine is done with it: at once, or (a call that ended early)
        when the engine's last event for it arrives, so a newer request under that id never gets this one's."""
        stream = self._running.pop((identity, request_id))
        stream.when_engine_done(lambda: self._release(stream.request_id))

    def _release(self, engine_id: str) -> None:
        self._engine_ids.discard(engine_id)
        self.engine.release(engine_id)

    def sink(self, stream: RequestStream) -> EventSink:
        """Where the engine thread delivers the stream's events."""
        if self._relay is None:  # created on first use, inside the server's event loop
            self._relay = EventRelay(asyncio.get_running_loop())
        return self._relay.sink(stream)

    def cancel(self, identity: str, request_id: str) -> bool:
        """Cancels the caller's running request of that id; False when it has none (another's reads as none)."""
        stream = self._running.get((identity, request_id))
        if stream is None:
            return False
        self.engine.cancel(stream.request_id)
        return True

    def caller_statuses(self, stats: EngineStats) -> list[pb.CallerStatus]:
        return convert.caller_statuses(stats.callers, dict(stats.refused_callers), self.callers.weight)


class GenerationCall:
    """One Generate or GenerateStream call: `admit`, `build`, then `run` (see above)."""

    def __init__(
        self, calls: Calls, request: pb.GenerateStreamRequest, context: Context, streaming: bool = True,
    ) -> None:
        self._calls = calls
        self._request = request
        self._context = context
        self._streaming = streaming
        self._identity = auth.caller()
        self._key = ""
        self._weight = 1.0
        self.request_id = ""
        """The id the caller knows the request by (the engine's may differ: see Calls.engine_id)."""
        self._generation: GenerationRequest | None = None
        self._trace: RequestTrace | None = None
        self._ended = False
        """The engine ended the request: every sample finished, or it failed."""
        self._output_parser: Callable[[], SampleParser] | None = None
        """Makes each sample's output parser (a chat turn's, when its output holds reasoning or tool calls)."""

    @property
    def generation(self) -> GenerationRequest:
        """The request as the engine takes it (made by `build`)."""
        assert self._generation is not None, "build() comes first"
        return self._generation

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """Who the call is for (its fairness key, weight and priority), counted in flight until it ends; or a
        refusal now. Its places in the engine (the batch or the bounded queue, within the caller's share and
        limit) are the engine's door's to give, at submit (backend.common.door)."""
        calls, request = self._calls, self._request
        if calls.lifecycle.refusal is not None:
            raise calls.lifecycle.refusal
        self._key = calls.callers.key(self._identity, self._context.invocation_metadata() or ())
        if request.priority and not calls.fair:
            raise unimplemented([FieldViolation("priority", "this server schedules first come, first served "
                                                "(scheduling = fifo): leave priority at 0")])
        calls.callers.check_priority(self._identity, request.priority)
        calls.validator.check_samples(request)
        self._weight = calls.callers.weight(self._key)
        with calls.lifecycle.call():
            yield

    async def build(self) -> GenerationRequest:
        """Checks, prompt, constraint, deadline and who it is for, made into the one request the engine gets."""
        request = self._request
        if not request.request_id:  # then the caller's x-request-id names it
            header = dict(self._context.invocation_metadata() or ()).get("x-request-id", "")
            if isinstance(header, str):  # always: gRPC gives bytes only for a -bin header
                request.request_id = header[: self._calls.validator.limits.max_request_id_length]
        params, prompt, arrival_time = await off_loop_if_large(self._prepare, request)
        self.request_id = params.request_id
        CURRENT_REQUEST_ID.set(params.request_id)
        spec = params.constraint if prompt.chat is None else await prompt.chat.constraint(self._calls.compiles)
        report = None if spec is None else await self._calls.compiles.compile(spec)
        self._output_parser = None if prompt.chat is None else prompt.chat.output_parser()
        self._generation = GenerationRequest(
            request_id=self._calls.engine_id(params.request_id),  # claimed in run(), with no await between
            prompt_token_ids=prompt.token_ids,
            sampling=params.sampling,
            stopping=params.stopping,
            output=params.output,
            constraint=spec,
            constraint_compile_s=report.fresh_compile_s if report is not None else 0.0,
            speculation=params.speculation,
            arrival_time=arrival_time,
            deadline=self._deadline(),
            last_message_start=prompt.last_message_start,
            scheduling=Scheduling(self._key, self._weight, request.priority, params.queue_timeout_s),
            truncated_tokens=prompt.truncated_tokens,
            sample_seeds=params.sample_seeds,
            prompt_logprobs=params.prompt_logprobs,
            turn_end=prompt.turn_end,
            cache_salt=cache_salt(self._calls.cache_scope, self._key, params.cache_salt),
        )
        return self._generation

    async def run(self, send: Send) -> None:
        """Submits the request and sends one message per batch of its events, or a heartbeat when none came
        for a while. Leaving before the engine ended it cancels it there. A coroutine that sends, not a
        generator the handler iterates: one frame less to suspend and resume for each of its messages."""
        samples = Samples(self.generation, self.request_id, self._output_parser)
        stream = self._submit()
        lifecycle, request_trace = self._calls.lifecycle, self._trace
        try:
            with lifecycle.interruptible(stream.interrupt):
                pacing = self._pacing()
                while not samples.done:
                    batch = await stream.next_batch(*pacing)
                    if lifecycle.ending is not None:  # the grace period is over, or the engine died
                        raise lifecycle.ending
                    if batch is None:
                        await send(pb.GenerateStreamResponse(request_id=self.request_id, heartbeat=True))
                    elif isinstance(batch, ErrorEvent):
                        raise self._failed(batch)
                    else:
                        # One sample (nearly every call): its batch as it is, not regrouped per message.
                        for index, events in ((0, batch),) if samples.n == 1 else by_sample(batch):
                            message = samples.message(index, events)
                            if request_trace is None:
                                await send(message)
                                continue
                            # The message's span around its write; the call's last one records how it finished.
                            with _message_span(request_trace, events, events[-1].finish if samples.done else None):
                                await send(message)
            self._finished(samples.finishes[0])
        finally:
            if not self._ended:  # the caller left, or the server ended the call: free its sequences now
                self._calls.engine.cancel(self.generation.request_id)
                self._ended_early(samples.generated_tokens)
            self._calls.close(self._identity, self.request_id)

    def _prepare(self, request: pb.GenerateStreamRequest) -> tuple[RequestParams, Prompt, float]:
        """The checks and the prompt (on a worker thread when the input is large), and when they were done:
        the request's arrival, from which its queue time counts."""
        params = self._calls.validator.params(request)
        prompt = self._calls.prompts.prompt(request, params.stopping.max_new_tokens, params.chat)
        return params, prompt, time.monotonic()

    def _deadline(self) -> float | None:
        """The caller's gRPC deadline on the engine's clock: a request still queued then never starts."""
        remaining = self._context.time_remaining()
        return None if remaining is None else time.monotonic() + remaining

    def _submit(self) -> RequestStream:
        """Joins the running calls and hands the request to the engine."""
        calls = self._calls
        if calls.lifecycle.ending is not None:
            raise calls.lifecycle.ending
        stream = calls.open(self._identity, self.request_id, self.generation.request_id, self.generation.n)
        if calls.telemetry.enabled:
            self._trace = RequestTrace(calls.telemetry, self._request, self.request_id, self.generation,
                                       calls.engine.info.model_id, self._streaming)
        calls.engine.submit(self.generation, calls.sink(stream))
        return stream

    def _pacing(self) -> tuple[int, int, float, float]:
        """RequestStream.next_batch's arguments for the messages the request's OutputOptions ask for: max and
        min tokens, flush interval and heartbeat interval (read once, not from the protobuf per message)."""
        output = self._request.output
        return (output.max_tokens_per_message, max(output.min_tokens_per_message, 1),
                output.flush_interval_ms / 1000, output.heartbeat_interval_ms / 1000)

    def _failed(self, event: ErrorEvent) -> ServiceError:
        """The status the engine's error ends the call with, counted when it is a refusal for load, and logged."""
        self._ended = True
        if self.generation.n > 1:  # one sample's failure fails the call: the others end with it
            self._calls.engine.cancel(self.generation.request_id)
        error = from_engine(event, self.request_id)
        if event.kind in _REFUSALS:  # for load
            self._calls.refused(self.generation.scheduling.caller, error)
        if self._trace:
            self._trace.failed(error)
        # The engine's own fault is an error; a caller's constraint or absence is not.
        level = logging.ERROR if error.code is grpc.StatusCode.INTERNAL else logging.INFO
        log.log(level, "request %s failed (%s): %s", self.request_id, error.reason, event.message,
                extra=_ids(self.request_id))
        return error

    def _finished(self, finish: Finish) -> None:
        self._ended = True
        log.info("request %s finished: %s, %d tokens", self.request_id, finish.reason.value,
                 finish.usage.completion_tokens, extra=_ids(self.request_id))

    def _ended_early(self, tokens: int) -> None:
        """Says who ended the call before the engine did, and why: the server (its reason), or the caller
        (time_limit once its deadline has passed, else cancelled); and the tokens it had been sent."""
        deadline = self.generation.deadline
        reason = "time_limit" if deadline is not None and time.monotonic() >= deadline else "cancelled"
        ending = self._calls.lifecycle.ending
        if ending is not None:
            reason = ending.reason.lower()
            log.info("request %s ended by the server: %s, %d tokens", self.request_id, reason, tokens,
                     extra=_ids(self.request_id))
        else:
            log.info("request %s ended by the caller: %s, %d tokens", self.request_id, reason, tokens,
                     extra=_ids(self.request_id))
        if self._trace:
            self._trace.ended_early(reason)


@contextlib.contextmanager
def _message_span(request_trace: RequestTrace, events: list[TokenEvent], finish: Finish | None) -> Iterator[None]:
    with request_trace.batch(events):
        if finish is not None:
            request_trace.finished(finish)
        yield


def _ids(request_id: str) -> dict[str, str]:
    """Log record fields: the request id, the caller's identity, and the trace id when the request is traced."""
    span_context = trace.get_current_span().get_span_context()
    trace_id = format(span_context.trace_id, "032x") if span_context.is_valid else ""
    return {"request_id": request_id, "trace_id": trace_id, "caller": auth.caller()}
