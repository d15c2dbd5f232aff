"""Wraps a gRPC method handler's behaviour, whatever its kind: the building block of the
error boundary and of the access interceptors (authentication, admission).

`before` runs first, inside the call's own task (so a ContextVar it sets is visible to the
handler), and may replace the request; it refuses a call by raising ServiceError, which the
error boundary around it turns into the status. `on_error` sees anything the call raised.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

Context = grpc.aio.ServicerContext[Any, Any]
"""A call's context, as the interceptors see every method's (their message types do not matter here)."""
Behavior = Callable[[Any, Context], Any]
"""A handler's behaviour: a coroutine function, or an async generator function for a streaming response."""
Before = Callable[[Any, Context], Any]
OnError = Callable[[Exception, Context], Awaitable[None]]
Check = Callable[[Context], None]
Request = TypeVar("Request")
Response = TypeVar("Response")
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable["grpc.RpcMethodHandler[Request, Response] | None"]]
"""What a server interceptor passes a call on to: the next interceptor, or the method's handler (None: no such method)."""

_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


def replaced(handler: grpc.RpcMethodHandler[Request, Response], **changes: Any) -> grpc.RpcMethodHandler[Request, Response]:
    """`handler` with some of its fields changed."""
    # gRPC's handlers are namedtuples (grpc._utilities.RpcMethodHandler); the stub declares only the ABC.
    copy: grpc.RpcMethodHandler[Request, Response] = handler._replace(**changes)  # type: ignore[attr-defined]
    return copy


def wrapped(
    handler: grpc.RpcMethodHandler[Request, Response], before: Before | None = None, on_error: OnError | None = None,
) -> grpc.RpcMethodHandler[Request, Response]:
    """`handler` with its behaviour wrapped (the request deserializer is left as it is)."""
    changes = {kind: _wrap(getattr(handler, kind), before, on_error) for kind in _KINDS if getattr(handler, kind)}
    return replaced(handler, **changes)


def guarded(handler: grpc.RpcMethodHandler[Request, Response], check: Check) -> grpc.RpcMethodHandler[Request, Response]:
    """`handler` with `check` run first; a check refuses by raising ServiceError."""

    def before(request: Any, context: Context) -> Any:
        check(context)
        return request

    return wrapped(handler, before)


def _wrap(behavior: Behavior, before: Before | None, on_error: OnError | None) -> Behavior:
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
            try:
                if before is not None:
                    request = before(request, context)
                async for message in behavior(request, context):
                    yield message
            except Exception as exc:
                if on_error is None:
                    raise
                await on_error(exc, context)

        return stream

    async def call(request: Any, context: Context) -> Any:
        try:
            if before is not None:
                request = before(request, context)
            return await behavior(request, context)
        except Exception as exc:
            if on_error is None:
                raise
            await on_error(exc, context)

    return call
