"""The one error boundary every RPC passes through.

A server interceptor (service.guard does the wrapping) changes each method handler twice:
- its request deserializer, so bytes that are not a valid message become
  INVALID_ARGUMENT (one rate-limited WARNING line) instead of UNKNOWN with a
  traceback per call;
- its behaviour, so any exception a handler lets escape is turned into a status
  by `errors.from_exception`: a ServiceError as it says, a bad constraint or chat
  as INVALID_ARGUMENT, anything else as INTERNAL naming the request id, logged
  once with its traceback.
Handlers therefore raise ServiceError and never catch it themselves.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from service import errors
from service.guard import Context, Continuation, Request, Response, replaced, wrapped

log = logging.getLogger(__name__)

_MALFORMED_LOG_INTERVAL_S = 60.0


class _Malformed:
    """Stands in for a request whose bytes did not parse."""

    def __init__(self, message_name: str) -> None:
        self.error = errors.malformed_request(message_name)


class ErrorBoundary(grpc.aio.ServerInterceptor):
    def __init__(self, on_error: Callable[[grpc.StatusCode], None] = lambda code: None) -> None:
        self._on_error = on_error
        self._malformed_since_log = 0
        self._malformed_logged_at = -_MALFORMED_LOG_INTERVAL_S

    async def intercept_service(
        self, continuation: Continuation[Request, Response], handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Request, Response] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.request_deserializer is not None:
            safe = self._safe_deserializer(handler.request_deserializer, method)
            handler = replaced(handler, request_deserializer=safe)
        return wrapped(handler, before=self._checked, on_error=self._fail)

    def _safe_deserializer(self, deserialize: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
        def parse(data: bytes) -> Any:
            try:
                return deserialize(data)
            except Exception:
                self._note_malformed(method)
                return _Malformed(_message_name(deserialize))

        return parse

    def _note_malformed(self, method: str) -> None:
        """One WARNING line a minute at most, however many callers send garbage."""
        self._malformed_since_log += 1
        now = time.monotonic()
        if now - self._malformed_logged_at >= _MALFORMED_LOG_INTERVAL_S:
            log.warning("refused %d malformed request(s), the last for %s", self._malformed_since_log, method)
            self._malformed_since_log = 0
            self._malformed_logged_at = now

    def _checked(self, request: Any, context: Context) -> Any:
        if hasattr(request, "__aiter__"):  # a client-streaming call: check each message
            return _checked_stream(request)
        if isinstance(request, _Malformed):
            raise request.error
        errors.CURRENT_REQUEST_ID.set(getattr(request, "request_id", "") or "")
        return request

    async def _fail(self, exc: Exception, context: Context) -> None:
        if isinstance(exc, (grpc.aio.AbortError, asyncio.CancelledError)):
            raise exc  # the handler already chose its status, or the caller left
        request_id = errors.CURRENT_REQUEST_ID.get() or uuid.uuid4().hex
        error = errors.from_exception(exc, request_id)
        if error.reason == "INTERNAL":
            log.error("request %s failed: %s", request_id, type(exc).__name__, exc_info=exc)
        self._on_error(error.code)
        await context.abort_with_status(error.to_status())


def _message_name(deserialize: Callable[[bytes], Any]) -> str:
    """The protobuf type a generated deserializer (`SomeMessage.FromString`) parses."""
    descriptor = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", "request")


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Malformed):
            raise request.error
        yield request
