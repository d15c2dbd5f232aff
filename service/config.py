"""Server settings, resolved once at start-up: flags > environment > config file > defaults.

Environment variables are the field names upper-cased with a TOKENSPOUT_
prefix (TOKENSPOUT_LISTEN, TOKENSPOUT_CONTEXT_LENGTH, ...). The config file is
TOML with the same field names at the top level.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import tomllib
from dataclasses import dataclass
from typing import Any, Mapping

ENV_PREFIX = "TOKENSPOUT_"


@dataclass(frozen=True)
class ServeConfig:
    listen: str = "127.0.0.1:50051"
    engine: str = "llama.cpp"
    """llama.cpp (GGUF, CPU or GPU) or exllamav2 (EXL2/GPTQ directory, CUDA; work in progress)."""
    model: str = "default"
    """A local GGUF path (or "default": the embedded SmolLM2-135M-Instruct), or a model directory for exllamav2."""
    model_id: str = ""
    """The name callers use in `model`; defaults to the model's own name."""
    context_length: int = 2048
    max_batch_size: int = 8
    threads: int = 0
    batch_tokens: int = 512
    gpu_layers: int = 0
    cache_tokens: int = 0
    """exllamav2: the cache's token budget shared by all jobs (0: context_length * max_batch_size)."""
    cache_type: str = "fp16"
    """exllamav2: fp16, q4, q6 or q8."""
    gpu_split: str = ""
    """exllamav2: GB per GPU, comma-separated (empty: fill the GPUs in order)."""
    max_queued_requests: int = 16
    """Requests that may wait beyond max_batch_size; more are refused with RESOURCE_EXHAUSTED."""
    stream_buffer_events: int = 64
    """Token events buffered for a caller that reads slowly before its sequence is paused."""
    grace_period_s: float = 30.0
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    """When set, clients must present a certificate signed by this CA (mTLS)."""
    log_level: str = "INFO"
    log_format: str = "text"
    """text, or json: one object per line with request_id and trace_id."""
    trace_content: bool = False
    """Opt-in: record prompt and output text in spans (gen_ai.input/output.messages)."""
    prometheus_port: int = 0
    """Serve Prometheus metrics on this port (0: off). OTLP export follows the OTEL_* variables."""
    test_fail_requests_with_prefix: str = ""
    """Test-only: requests whose id has this prefix fail inside the engine."""


FIELDS = {f.name: f for f in dataclasses.fields(ServeConfig)}


def _coerce(name: str, value: Any) -> Any:
    kind = type(ServeConfig.__dataclass_fields__[name].default)
    try:
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: cannot use {value!r} as {kind.__name__}") from exc


def load_config(
    flags: Mapping[str, Any], environ: Mapping[str, str] = os.environ, config_file: str | None = None
) -> ServeConfig:
    """Merges the sources; `flags` holds only the flags the user gave (None = not given)."""
    values: dict[str, Any] = {}
    path = config_file or environ.get(ENV_PREFIX + "CONFIG")
    if path:
        with open(pathlib.Path(path), "rb") as f:
            from_file = tomllib.load(f)
        unknown = set(from_file) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown settings in {path}: {', '.join(sorted(unknown))}")
        values.update(from_file)
    for name in FIELDS:
        if ENV_PREFIX + name.upper() in environ:
            values[name] = environ[ENV_PREFIX + name.upper()]
    values.update({k: v for k, v in flags.items() if v is not None and k in FIELDS})
    config = ServeConfig(**{name: _coerce(name, value) for name, value in values.items()})
    if config.context_length < 16 or config.max_batch_size < 1 or config.batch_tokens < config.max_batch_size:
        raise ValueError("need context_length >= 16, max_batch_size >= 1 and batch_tokens >= max_batch_size")
    if config.max_queued_requests < 0 or config.stream_buffer_events < 2:
        raise ValueError("need max_queued_requests >= 0 and stream_buffer_events >= 2")
    if config.engine not in ("llama.cpp", "exllamav2") or config.cache_type not in ("fp16", "q4", "q6", "q8"):
        raise ValueError("engine must be llama.cpp or exllamav2, cache_type fp16, q4, q6 or q8")
    if config.log_format not in ("text", "json"):
        raise ValueError("log_format must be text or json")
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ValueError("tls_cert and tls_key go together")
    return config
