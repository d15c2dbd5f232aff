"""Builds and runs the gRPC server: generation, health, reflection, TLS, drain."""

from __future__ import annotations

import asyncio
import logging
import pathlib
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from backend.engine import Engine
from service.config import ServeConfig
from service.generation import GenerationServicer
from service.telemetry import Telemetry, from_environment
from service.validate import RequestValidator
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name

_CHANNEL_OPTIONS = [
    # Pings keep idle-looking streams (a long prefill) alive through proxies.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # A second server on the same port must fail, not share it.
    ("grpc.so_reuseport", 0),
]


def build_engine(config: ServeConfig) -> Engine:
    if config.engine == "exllamav2":
        return _build_exllamav2(config)
    from backend.llamacpp.core import LlamaCppConfig
    from backend.llamacpp.engine import LlamaCppEngine
    from backend.models import DEFAULT_MODEL_ID, resolve_model_path

    engine_config = LlamaCppConfig(
        context_length=config.context_length,
        max_batch_size=config.max_batch_size,
        threads=config.threads,
        batch_tokens=config.batch_tokens,
        gpu_layers=config.gpu_layers,
        fail_requests_with_prefix=config.test_fail_requests_with_prefix,
    )
    path = resolve_model_path(config.model)
    model_id = config.model_id or (DEFAULT_MODEL_ID if config.model == "default" else path.stem)
    return LlamaCppEngine(path, engine_config, model_id=model_id)


def _build_exllamav2(config: ServeConfig) -> Engine:
    from backend.exllamav2.engine import ExLlamaV2Config, ExLlamaV2Engine
    from backend.models import ModelNotFound

    model_dir = pathlib.Path(config.model).expanduser()
    missing = [name for name in ("config.json", "tokenizer.json") if not (model_dir / name).is_file()]
    if missing:  # exllamav2 reads only tokenizer.json; SentencePiece-only models are not supported
        raise ModelNotFound(f"exllamav2 needs a model directory with config.json and tokenizer.json; {model_dir} lacks {', '.join(missing)}")
    engine_config = ExLlamaV2Config(
        max_seq_len=config.context_length,
        cache_tokens=config.cache_tokens,
        cache_type=config.cache_type,
        max_batch_size=config.max_batch_size,
        gpu_split=tuple(float(gb) for gb in config.gpu_split.split(",") if gb),
    )
    return ExLlamaV2Engine(model_dir, engine_config, model_id=config.model_id)


def _credentials(config: ServeConfig) -> grpc.ServerCredentials | None:
    if not config.tls_cert:
        return None
    read = lambda path: pathlib.Path(path).read_bytes()  # noqa: E731
    return grpc.ssl_server_credentials(
        [(read(config.tls_key), read(config.tls_cert))],
        root_certificates=read(config.tls_client_ca) if config.tls_client_ca else None,
        require_client_auth=bool(config.tls_client_ca),
    )


class TokenspoutServer:
    def __init__(self, engine: Engine, config: ServeConfig, telemetry: Telemetry | None = None) -> None:
        self.engine = engine
        self.config = config
        telemetry = telemetry or from_environment(config.trace_content, config.prometheus_port)
        if telemetry.enabled:
            telemetry.observe_engine(lambda: engine.stats)
        self.server = grpc.aio.server(interceptors=telemetry.interceptors(), options=_CHANNEL_OPTIONS)
        self.health = health.aio.HealthServicer()
        model_names = (config.model,) if config.model != "default" else ()
        self.servicer = GenerationServicer(engine, RequestValidator(engine, model_names=model_names), config, telemetry)
        pb_grpc.add_GenerationServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )
        credentials = _credentials(config)
        if credentials is None:
            self.port = self.server.add_insecure_port(config.listen)
        else:
            self.port = self.server.add_secure_port(config.listen, credentials)

    async def start(self) -> None:
        await self.server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def drain(self) -> None:
        """Health goes NOT_SERVING, new calls are refused, running streams get the grace period."""
        self.servicer.draining = True
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.config.grace_period_s)


async def run(config: ServeConfig) -> int:
    engine = await asyncio.to_thread(build_engine, config)
    try:
        server = TokenspoutServer(engine, config)
        await server.start()
        host = config.listen.rsplit(":", 1)[0]
        # Tests and scripts read this line to learn the port (listen may say :0).
        print(f"tokenspout serving {engine.info.model_id} on {host}:{server.port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, _on_signal, stop)
        await stop.wait()
        log.info("draining: up to %.0f s for running streams", config.grace_period_s)
        await server.drain()
        return 0
    finally:
        engine.close()


def _on_signal(stop: asyncio.Event) -> None:
    if stop.is_set():  # a second signal: leave now
        logging.getLogger(__name__).warning("second signal: exiting without waiting")
        raise SystemExit(1)
    stop.set()
