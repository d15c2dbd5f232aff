"""Builds and runs the gRPC server: generation, health, reflection, TLS, auth, drain, liveness.

`run` serves with the engine in a process of its own (service.supervisor starts it and the front ends,
each a TokenspoutServer on a RemoteEngine), or in this process (engine_process = false). The port is
checked before the model loads, so a busy port fails in a second, not after a long load. On SIGTERM
the server drains visibly: health says NOT_SERVING and new calls get UNAVAILABLE (DRAINING) while the
listener stays open for `grace_period_s`; streams still running then end with UNAVAILABLE too. If the
engine dies, health says NOT_SERVING and every waiting and new call gets UNAVAILABLE (ENGINE_DOWN):
an engine process is started again and serving resumes once it answers; an engine in this process
ends the process, non-zero, for a restart.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import pathlib
import signal
import time
from collections.abc import Callable

import grpc
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from backend import MODEL_RECIPE, CacheEventHub, Engine, EngineRecipe, EngineStats, RemoteEngine
from service import auth
from service.boundary import ErrorBoundary
from service.cache_scope import CacheScope
from service.chat import ChatFormats
from service.config import ServeConfig
from service.generation import GenerationServicer
from service.kv_publisher import ZmqCachePublisher, cache_publisher
from service.lifecycle import SERVICE_NAME, HealthServicer, Lifecycle, RefuseWhenNotServing
from service.limits import Limits
from service.reflection import ReflectionServicer, load_descriptor_set
from service.startup import ENGINE_DOWN_EXIT_CODE, StartupError, check_port, serving_line
from service.telemetry import MetricsListenError, Telemetry, from_environment
from service.validate import RequestValidator
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [
    # Pings keep idle-looking streams (a long prefill) alive through proxies.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


def _channel_options(front_ends: int) -> list[tuple[str, int]]:
    """A second server on the same port must fail, not share it (the port is checked before any front end
    binds); several front ends share it (SO_REUSEPORT: the kernel spreads connections among them)."""
    return [*_CHANNEL_OPTIONS, ("grpc.so_reuseport", int(front_ends > 1))]


# After the grace period, how long cut streams get to send their UNAVAILABLE before the listener closes.
_CUT_WAIT_S = 2.0
# Before health Watch streams end: time for them to send NOT_SERVING, when the drain had nothing to wait for.
_WATCH_FLUSH_S = 0.1
# After the engine died: how long health probes and callers see NOT_SERVING / UNAVAILABLE before the exit.
_ENGINE_DOWN_LINGER_S = 5.0


def _fresh_stats(engine: RemoteEngine) -> Callable[[], EngineStats]:
    """The figures of an engine in another process as they are at a metrics scrape (read on the exporter's thread):
    asked for on the event loop, unless it does not answer within a second (then as last sent, at most 250 ms old
    while they change). One question serves a scrape's every instrument."""
    loop = asyncio.get_running_loop()
    last: list[tuple[float, EngineStats]] = []

    def read() -> EngineStats:
        if last and time.monotonic() - last[0][0] < 0.05:
            return last[0][1]
        try:
            stats = asyncio.run_coroutine_threadsafe(engine.current_stats(), loop).result(timeout=1.0)
        except Exception:  # the engine is starting again, or the loop is busy past a second
            return engine.stats
        last[:] = [(time.monotonic(), stats)]
        return stats

    return read


def _credentials(config: ServeConfig) -> grpc.ServerCredentials | None:
    if not config.tls_cert:
        return None

    def read(path: str) -> bytes:
        return pathlib.Path(path).read_bytes()

    return grpc.ssl_server_credentials(
        [(read(config.tls_key), read(config.tls_cert))],
        root_certificates=read(config.tls_client_ca) if config.tls_client_ca else None,
        require_client_auth=bool(config.tls_client_ca),
    )


class TokenspoutServer:
    def __init__(
        self, engine: Engine | None, config: ServeConfig, telemetry: Telemetry | None = None, front_end: int = 0,
    ) -> None:
        """Binds the port at once; the engine may come later, through `attach`, before `start`. Front end
        `front_end` of several serves its metrics on prometheus_port + front_end."""
        if config.front_ends == 1:
            check_port(config.listen)  # before anything else, so a busy port is the only line printed
        self.config = config
        prometheus_port = config.prometheus_port + front_end if config.prometheus_port else 0
        try:
            self.telemetry = telemetry = telemetry or from_environment(
                config.trace_content, prometheus_port, config.caller_metric_labels, config.metrics_host
            )
        except MetricsListenError as exc:
            raise StartupError(str(exc)) from None
        try:
            self.auth = auth.interceptor(config)
        except (OSError, ValueError) as exc:
            raise StartupError(f"api_keys_file: {exc}") from None
        self.health = HealthServicer()
        self.lifecycle = Lifecycle(self.health)
        access = [self.auth, RefuseWhenNotServing(self.lifecycle)] if self.auth else [RefuseWhenNotServing(self.lifecycle)]
        # Tracing outermost, so it sees the status the error boundary chose; access checks inside
        # the boundary, so their refusals become statuses there like every other error.
        boundary = ErrorBoundary(on_error=telemetry.count_error)
        self.server = grpc.aio.server(
            interceptors=[*telemetry.interceptors(), boundary, *access], options=_channel_options(config.front_ends)
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection = ReflectionServicer.for_modules(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name),
            load_descriptor_set(), health_pb2, reflection_pb2,
        )
        self.server.add_generic_rpc_handlers(reflection.handlers())
        self.port = self._bind()
        if engine is not None:
            self.attach(engine)

    def _bind(self) -> int:
        try:
            credentials = _credentials(self.config)
        except (OSError, ValueError, RuntimeError) as exc:
            raise StartupError(f"cannot use the TLS files: {exc}") from None
        try:
            if credentials is None:
                return self.server.add_insecure_port(self.config.listen)
            return self.server.add_secure_port(self.config.listen, credentials)
        except RuntimeError:
            raise StartupError(f"cannot listen on {self.config.listen}: gRPC refused it (its log line says why)") from None

    def attach(self, engine: Engine) -> None:
        """Serves generation with this engine; if its thread dies, the server stops serving (ENGINE_DOWN). Raises
        StartupError when the engine cannot serve as configured."""
        scope = self.config.cache_scope
        if scope is not CacheScope.SHARED and "cache_salt" not in engine.info.request_features:
            raise StartupError(f"cache_scope = {scope.value}: this engine cannot keep callers' cached prefixes apart "
                               "(see docs/engines.md); leave cache_scope at shared")
        self.engine = engine
        self.telemetry.describe_engine(engine.info)
        if self.telemetry.enabled:
            self.telemetry.observe_engine(_fresh_stats(engine) if isinstance(engine, RemoteEngine) else lambda: engine.stats)
        model = self.config.engine.model
        validator = RequestValidator(
            engine.info,
            Limits(max_input_bytes=self.config.max_input_bytes),
            model_names=(model,) if model != "default" else (),
            formats=ChatFormats.resolve(engine.info, self.config.tool_call_format, self.config.reasoning_format),
        )
        self.servicer = GenerationServicer(engine, validator, self.config, self.lifecycle, self.telemetry)
        self.cache_publisher = self._publish_cache_events(engine)
        # protoc's gRPC plugin writes no annotations (the .pyi beside it covers the messages only).
        pb_grpc.add_GenerationServiceServicer_to_server(self.servicer, self.server)  # type: ignore[no-untyped-call]

    def _publish_cache_events(self, engine: Engine) -> ZmqCachePublisher | None:
        """The ZMQ publisher of the engine's KV-cache events, when cache_events_endpoint is set: here for an engine
        in this process (an engine in a process of its own publishes them there, and says where)."""
        publisher = None
        if isinstance(engine, RemoteEngine):
            endpoint, replay, topic = engine.cache_event_sources
        elif isinstance(engine.cache_events, CacheEventHub):
            try:
                publisher = cache_publisher(self.config, engine.cache_events, engine.info.model_id)
            except zmq.ZMQError as exc:
                raise StartupError(str(exc)) from None
            if publisher is None:
                return None
            endpoint, replay, topic = publisher.sources
        else:
            return None
        if endpoint:
            self.servicer.cache_event_sources.MergeFrom(
                pb.CacheEventSources(endpoint=endpoint, replay_endpoint=replay, topic=topic)
            )
        return publisher

    async def start(self) -> None:
        loop = asyncio.get_running_loop()

        def died(exc: BaseException) -> None:
            """On the engine thread (in this process), before it closes its requests: the loop runs this callback
            first; on the event loop for an engine process."""
            loop.call_soon_threadsafe(self.lifecycle.engine_down, type(exc).__name__)

        self.engine.on_death(died)
        if isinstance(self.engine, RemoteEngine):  # the supervisor starts another: served again once it answers
            self.engine.on_ready(self.lifecycle.engine_up)
        await self.server.start()
        await self.lifecycle.start_serving()

    async def drain(self) -> None:
        """Health goes NOT_SERVING and new calls are refused at once, while the listener stays open and
        running streams get the grace period; those still running then end with UNAVAILABLE."""
        if not await self.lifecycle.drain(self.config.grace_period_s):
            log.warning("grace period over: %d requests end with UNAVAILABLE", self.lifecycle.in_flight)
            refusal = self.lifecycle.refusal
            assert refusal is not None, "drain() stopped serving"
            self.lifecycle.end_running(refusal)
            await self.lifecycle.wait_idle(_CUT_WAIT_S)
        await self._close()

    async def fail_engine(self) -> None:
        """The engine thread died (see Lifecycle.engine_down): callers and probes see it, then the listener closes."""
        await self.lifecycle.wait_idle(_CUT_WAIT_S)
        await asyncio.sleep(_ENGINE_DOWN_LINGER_S)
        await self._close()

    async def _close(self) -> None:
        self.lifecycle.stop()
        await asyncio.sleep(_WATCH_FLUSH_S)
        self.health.end_watches()
        self.servicer.cache_watches.end_all()
        await self.server.stop(_CUT_WAIT_S)
        if self.cache_publisher is not None:
            self.cache_publisher.close()


async def run_in_process(config: ServeConfig, recipe: EngineRecipe = MODEL_RECIPE) -> int:
    """The engine on a thread of this process, one front end (engine_process = false): its death ends the server."""
    server = TokenspoutServer(None, config)  # the port first: a busy one fails before the model loads
    try:
        engine = await asyncio.to_thread(recipe.engine, config.engine)
    except BaseException:
        await server.server.stop(None)
        raise
    try:
        await start_with_engine(server, engine)
        # Tests and scripts read this line to learn the port (listen may say :0).
        print(serving_line(config, engine.info.model_id, server.port), flush=True)
        return await serve_until_signal(server, exit_on_engine_death=True)
    finally:
        engine.close()


async def start_with_engine(server: TokenspoutServer, engine: Engine) -> None:
    """Serves generation with `engine` (attach), listens (start), and freezes what start-up built."""
    server.attach(engine)
    await server.start()
    freeze_startup()


def freeze_startup() -> None:
    """What start-up built (modules, the engine, the vocabulary) lives as long as the process. Frozen, the collector's
    full passes stop walking it: each stalled every stream ~30 ms at 256 streams (as vLLM's and SGLang's servers do;
    docs/benchmarks.md, "The service at a GPU's pace")."""
    gc.collect()
    gc.freeze()


async def serve_until_signal(
    server: TokenspoutServer, exit_on_engine_death: bool, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
) -> int:
    """Serves until one of `signals`, then drains: 0; or, with `exit_on_engine_death`, until the engine dies:
    ENGINE_DOWN_EXIT_CODE after callers and probes have seen it. SIGHUP re-reads the API keys file."""
    config = server.config
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in signals:
        loop.add_signal_handler(sig, _on_signal, stop)
    if server.auth is not None and server.auth.keys is not None and config.api_keys_file:
        loop.add_signal_handler(signal.SIGHUP, server.auth.keys.reload_if_changed, True)
    died = server.lifecycle.engine_died
    waits = [asyncio.create_task(stop.wait())]
    if exit_on_engine_death:
        waits.append(asyncio.create_task(died.wait()))
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        wait.cancel()
    if exit_on_engine_death and died.is_set():
        log.error("the engine thread died: health NOT_SERVING, calls UNAVAILABLE, exiting for a restart")
        await server.fail_engine()
        return ENGINE_DOWN_EXIT_CODE
    log.info("draining: up to %.0f s for running streams", config.grace_period_s)
    await server.drain()
    return ENGINE_DOWN_EXIT_CODE if exit_on_engine_death and died.is_set() else 0  # it may die while draining


def _on_signal(stop: asyncio.Event) -> None:
    if stop.is_set():  # a second signal: leave now
        logging.getLogger(__name__).warning("second signal: exiting without waiting")
        raise SystemExit(1)
    stop.set()
