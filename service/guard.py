"""Wraps a gRPC method handler's behaviour, whatever its kind: the building block of the
error boundary and of the access interceptors (authentication, admission).

`before` runs first, inside the call's own task (so a ContextVar it sets is visible to the
handler), and may replace the request; it refuses a call by raising ServiceError, which the
error boundary around it turns into the status. `on_error` sees anything the call raised.
"""

from __future__ import annotations

import inspect
from typing import Any, Awaitable, Callable

import grpc

Before = Callable[[Any, grpc.aio.ServicerContext], Any]
OnError = Callable[[Exception, grpc.aio.ServicerContext], Awaitable[None]]
Check = Callable[[grpc.aio.ServicerContext], None]

_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


def wrapped(handler: grpc.RpcMethodHandler, before: Before | None = None, on_error: OnError | None = None):
    """`handler` with its behaviour wrapped (the request deserializer is left as it is)."""
    changes = {kind: _wrap(getattr(handler, kind), before, on_error) for kind in _KINDS if getattr(handler, kind)}
    return handler._replace(**changes)


def guarded(handler: grpc.RpcMethodHandler, check: Check) -> grpc.RpcMethodHandler:
    """`handler` with `check` run first; a check refuses by raising ServiceError."""

    def before(request, context):
        check(context)
        return request

    return wrapped(handler, before)


def _wrap(behavior: Callable, before: Before | None, on_error: OnError | None) -> Callable:
    if inspect.isasyncgenfunction(behavior):

        async def stream(request, context):
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

    async def call(request, context):
        try:
            if before is not None:
                request = before(request, context)
            return await behavior(request, context)
        except Exception as exc:
            if on_error is None:
                raise
            await on_error(exc, context)

    return call
