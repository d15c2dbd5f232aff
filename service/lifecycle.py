"""What callers and balancers see while the server's life changes: calls refused at once while it
drains or after its engine died, health Watch streams that end cleanly, and the test-only engine death."""

from __future__ import annotations

import asyncio
import itertools

import grpc
from grpc_health.v1 import health, health_pb2

from backend.engine import Engine
from service.errors import ServiceError
from service.guard import guarded
from tokenspout.v1 import generation_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
ENGINE_DOWN_EXIT_CODE = 3

# Calls that stay open while draining: a caller may still cancel its stream and watch the load.
_OPEN_WHILE_DRAINING = frozenset(f"/{SERVICE_NAME}/{method}" for method in ("Cancel", "GetServerStatus"))


class Admission(grpc.aio.ServerInterceptor):
    """While draining or after the engine died, new GenerationService calls are refused at once.

    Decided when a call arrives, so admitted calls pay nothing per message.
    """

    def __init__(self) -> None:
        self.refusal: ServiceError | None = None

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or self.refusal is None or not method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        if method in _OPEN_WHILE_DRAINING and self.refusal.reason == "DRAINING":
            return handler
        refusal = self.refusal

        def refuse(context: grpc.aio.ServicerContext) -> None:
            raise refusal

        return guarded(handler, refuse)


class HealthServicer(health.aio.HealthServicer):
    """The standard health service, whose Watch streams end cleanly (OK, after NOT_SERVING) when the
    server closes, instead of being cancelled, which gRPC would log with a traceback."""

    def __init__(self) -> None:
        super().__init__()
        self._watches: set[asyncio.Future] = set()
        self._ending = False

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        watch = asyncio.ensure_future(super().Watch(request, context))
        self._watches.add(watch)
        try:
            await watch
        except asyncio.CancelledError:
            if not self._ending:  # the caller left
                raise
        finally:
            self._watches.discard(watch)

    def end_watches(self) -> None:
        self._ending = True
        for watch in self._watches:
            watch.cancel()


def kill_engine_after(engine: Engine, steps: int) -> None:
    """Test-only (test_kill_engine_after_steps): the engine thread dies as a bug in its loop would.

    Wraps the core's step from outside; nothing in the engine or its sampling knows.
    """
    step = engine.core.step
    count = itertools.count(1)

    def dying_step():
        if next(count) > steps:
            raise RuntimeError(f"test_kill_engine_after_steps: the engine thread dies after {steps} steps")
        return step()

    engine.core.step = dying_step
