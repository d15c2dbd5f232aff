"""The server's life, in one state: serving, draining, engine down, stopped.

Everything that depends on it reads it here: the admission interceptor (new
calls refused at once while draining or after the engine died), the servicer
(running calls that the server ends), health (NOT_SERVING from the moment it
stops serving), and the drain, which waits for the last call in flight. It
changes only on the event loop; the engine thread reports its death through
`loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Callable, Iterator

import grpc
from grpc_health.v1 import health, health_pb2

from service.errors import ServiceError, draining, engine_down
from service.guard import Context, Continuation, Request, Response, guarded
from tokenspout.v1 import generation_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name

# Calls that stay open while draining: a caller may still cancel its stream and watch the load.
_OPEN_WHILE_DRAINING = frozenset(f"/{SERVICE_NAME}/{method}" for method in ("Cancel", "GetServerStatus"))


class Phase(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"
    """New calls are refused; running ones may finish within the grace period."""
    ENGINE_DOWN = "engine_down"
    """The engine thread died: every call fails until the process exits for a restart."""
    STOPPED = "stopped"
    """The listener is closing."""


class Lifecycle:
    def __init__(self, health_servicer: HealthServicer) -> None:
        self.phase = Phase.SERVING
        self.refusal: ServiceError | None = None
        """What a new call gets, once the server no longer serves."""
        self.ending: ServiceError | None = None
        """What a running call fails with, once the server ends it (grace period over, engine dead)."""
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._interrupts: set[Callable[[], None]] = set()
        self._health = health_servicer
        self._health_update: asyncio.Future[None] | None = None
        self.engine_died = asyncio.Event()

    async def start_serving(self) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """A call in flight: the drain waits until none is left."""
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()

    @contextlib.contextmanager
    def interruptible(self, interrupt: Callable[[], None]) -> Iterator[None]:
        """While inside, `interrupt()` wakes the call when the server ends it (it then reads `ending`)."""
        self._interrupts.add(interrupt)
        try:
            yield
        finally:
            self._interrupts.discard(interrupt)

    async def drain(self, grace_s: float) -> bool:
        """Stops serving; waits up to `grace_s` for the calls in flight. True when none is left."""
        self._stop_serving(Phase.DRAINING, draining("the server is shutting down; retry on another replica"))
        await self._health.enter_graceful_shutdown()
        return await self.wait_idle(grace_s)

    def engine_down(self, reason: str) -> None:
        """The engine died: every call fails with ENGINE_DOWN until `engine_up` (an engine process started again)."""
        error = engine_down(f"the engine stopped ({reason}); retry on another replica")
        self._stop_serving(Phase.ENGINE_DOWN, error)
        self.end_running(error)
        self._health_update = asyncio.ensure_future(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))
        self.engine_died.set()

    def engine_up(self) -> None:
        """An engine started again after `engine_down` answers: calls are served again (unless draining)."""
        if self.phase is not Phase.ENGINE_DOWN:
            return
        self.phase, self.refusal, self.ending = Phase.SERVING, None, None
        self.engine_died.clear()
        self._health_update = asyncio.ensure_future(self.start_serving())

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)

    def end_running(self, error: ServiceError) -> None:
        """Every running call fails with `error` (once the grace period is over, or the engine died)."""
        self.ending = self.ending or error
        for interrupt in list(self._interrupts):
            interrupt()

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    def stop(self) -> None:
        self.phase = Phase.STOPPED

    def _stop_serving(self, phase: Phase, refusal: ServiceError) -> None:
        if self.phase is Phase.SERVING or phase is Phase.ENGINE_DOWN:
            self.phase = phase
            self.refusal = refusal


class RefuseWhenNotServing(grpc.aio.ServerInterceptor):
    """Once the server stops serving, new GenerationService calls are refused at once.

    Decided when a call arrives, so admitted calls pay nothing per message.
    """

    def __init__(self, lifecycle: Lifecycle) -> None:
        self._lifecycle = lifecycle

    async def intercept_service(
        self, continuation: Continuation[Request, Response], handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Request, Response] | None:
        handler = await continuation(handler_call_details)
        refusal = self._lifecycle.refusal
        method = handler_call_details.method
        if handler is None or refusal is None or not method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        if method in _OPEN_WHILE_DRAINING and self._lifecycle.phase is Phase.DRAINING:
            return handler

        def refuse(context: Context) -> None:
            raise refusal

        return guarded(handler, refuse)


class HealthServicer(health.aio.HealthServicer):
    """The standard health service, whose Watch streams end cleanly (OK, after NOT_SERVING) when the
    server closes, instead of being cancelled, which gRPC would log with a traceback."""

    def __init__(self) -> None:
        super().__init__()
        self._watches: set[asyncio.Future[None]] = set()
        self._ending = False

    async def Watch(
        self, request: health_pb2.HealthCheckRequest,
        context: grpc.aio.ServicerContext[health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse],
    ) -> None:
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
