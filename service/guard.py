"""Runs a check before a gRPC handler: the building block of the auth and admission interceptors.

A check sees the call's context (metadata, peer certificate) and either returns
or raises ServiceError, which ends the call with that status before the
handler runs. It runs inside the call's own task, so a ContextVar it sets is
visible to the handler.
"""

from __future__ import annotations

import inspect
from typing import Callable

import grpc

from service.errors import ServiceError

Check = Callable[[grpc.aio.ServicerContext], None]


def guarded(handler: grpc.RpcMethodHandler, check: Check) -> grpc.RpcMethodHandler:
    """`handler` with `check` run first, for any of the four kinds of method."""
    kind = {
        (False, False): "unary_unary", (False, True): "unary_stream",
        (True, False): "stream_unary", (True, True): "stream_stream",
    }[(handler.request_streaming, handler.response_streaming)]
    behavior = getattr(handler, kind)
    if handler.response_streaming and not inspect.iscoroutinefunction(behavior):

        async def stream_guarded(request, context):
            if await _passes(check, context):
                async for message in behavior(request, context):
                    yield message

        return handler._replace(**{kind: stream_guarded})

    async def guarded_call(request, context):
        if await _passes(check, context):
            return await behavior(request, context)
        return None

    return handler._replace(**{kind: guarded_call})


async def _passes(check: Check, context: grpc.aio.ServicerContext) -> bool:
    try:
        check(context)
    except ServiceError as error:
        await context.abort_with_status(error.to_status())  # raises: the handler never runs
        return False
    return True
