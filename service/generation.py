"""The GenerationService servicer: each RPC hands its work to its owner and converts the answer.

Generation is a GenerationCall (service.call): admitted, built, then run, one message per batch
of events. A caller that keeps up gets one token per message; one that falls behind gets what
has queued up in one message (up to `max_tokens_per_message`), and if its buffer fills, its
sequence is paused (see service.streams). When the caller cancels, disconnects or runs out of
deadline, grpc.aio cancels the handler, and the call cancels the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from backend import Engine
from service import auth, convert
from service.cache_watch import CacheWatches
from service.call import Calls, Context, GenerationCall
from service.compiles import CompileGate
from service.config import ServeConfig
from service.errors import FieldViolation, invalid_argument
from service.lifecycle import Lifecycle, Phase
from service.offsets import token_offsets
from service.prompt import PromptBuilder, off_loop_if_large
from service.telemetry import Telemetry
from service.validate import RequestValidator
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

_TOKENIZE_SLICE = 8_192


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
        self._validator = validator
        self._config = config
        self._lifecycle = lifecycle
        self._prompts = PromptBuilder(engine, validator.limits.max_input_bytes, config.special_tokens_in_chat_content)
        self._compiles = CompileGate(engine, config.compile_timeout_s)
        self._calls = Calls(engine, validator, self._prompts, self._compiles, config, lifecycle,
                            telemetry or Telemetry(enabled=False))
        self.cache_watches = CacheWatches(engine.cache_events, engine.info.engine)
        self.cache_event_sources = pb.CacheEventSources()
        """Where the ZMQ publisher sends (set by the server once it binds), for GetModelInfo."""

    async def GenerateStream(
        self, request: pb.GenerateStreamRequest, context: Context
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        call = GenerationCall(self._calls, request, context)
        with call.admit():
            await call.build()
            try:
                await call.run(context.write)
            except grpc.aio.InternalError:
                # A caller that resets its stream while a write waits on HTTP/2 flow control fails the write
                # before gRPC marks the call closed, and gRPC would log that as a crash; it is the caller
                # leaving (run has cancelled its request), so the call ends as gRPC ends any cancelled one.
                raise asyncio.CancelledError from None
        return
        yield  # an async generator, as gRPC's interceptors expect, that writes its messages itself

    async def Generate(self, request: pb.GenerateRequest, context: Context) -> pb.GenerateResponse:
        # Same fields under the same numbers: the wire bytes are a valid stream request.
        stream_request = pb.GenerateStreamRequest.FromString(request.SerializeToString())
        stream_request.output.max_tokens_per_message = 0
        stream_request.output.heartbeat_interval_ms = 0
        call = GenerationCall(self._calls, stream_request, context, streaming=False)
        messages: list[pb.GenerateStreamResponse] = []

        async def keep(message: pb.GenerateStreamResponse) -> None:
            messages.append(message)

        with call.admit():
            await call.build()
            await call.run(keep)
        return convert.unary_response(messages)

    async def Cancel(self, request: pb.CancelRequest, context: Context) -> pb.CancelResponse:
        response = pb.CancelResponse()
        caller = auth.caller()
        for request_id in request.request_ids:
            if self._calls.cancel(caller, request_id):
                response.cancelled.append(request_id)
            else:
                response.not_found.append(request_id)
        return response

    async def GetServerStatus(self, request: pb.GetServerStatusRequest, context: Context) -> pb.GetServerStatusResponse:
        stats = await self._engine.current_stats()
        return convert.server_status(
            stats, self._engine.info, max_queued_requests=self._config.engine.max_queued_requests,
            rejected_total=stats.refused_total + stats.shed_total, draining=self._lifecycle.phase is Phase.DRAINING,
            callers=self._calls.caller_statuses(stats),
            cache_events_sequence=stats.cache_events_sequence,
        )

    async def WatchCacheEvents(
        self, request: pb.WatchCacheEventsRequest, context: Context
    ) -> AsyncIterator[pb.WatchCacheEventsResponse]:
        async with contextlib.aclosing(self.cache_watches.watch(request)) as batches:
            async for batch in batches:
                yield batch

    async def Tokenize(self, request: pb.TokenizeRequest, context: Context) -> pb.TokenizeResponse:
        self._validator.check_model(request.model)
        return await off_loop_if_large(self._tokenize_response, request)

    def _tokenize_response(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        response = pb.TokenizeResponse()
        chat = self._validator.check_tokenize(request)
        if chat is not None:
            self._fill_tokens(response, self._prompts.chat_tokens(request.chat, chat))
            return response
        texts = self._prompts.tokenize_texts(request)
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

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Context) -> pb.GetModelInfoResponse:
        self._validator.check_model(request.model)
        info = convert.model_info(self._engine.info, self._validator.limits, self._validator.formats)
        info.cache_event_sources.CopyFrom(self.cache_event_sources)
        return info

    async def CompileConstraint(
        self, request: pb.CompileConstraintRequest, context: Context
    ) -> pb.CompileConstraintResponse:
        self._validator.check_model(request.model)
        violations: list[FieldViolation] = []
        spec = self._validator.constraint_spec(request.constraint, violations)
        if violations or spec is None:
            raise invalid_argument(violations)
        report = await self._compiles.compile(spec)
        return pb.CompileConstraintResponse(
            compile_ms=report.fresh_compile_s * 1000,
            cached=report.cached,
            warnings=report.warnings,
        )
