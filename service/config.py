"""Server settings, resolved once at start-up: flags > environment > config file > defaults.

Environment variables are the field names upper-cased with a TOKENSPOUT_
prefix (TOKENSPOUT_LISTEN, TOKENSPOUT_CONTEXT_LENGTH, ...). The config file is
TOML with the same field names at the top level. Every value is parsed by its
field's type (a bool is true/false/1/0/yes/no, nothing else), and every rule
that ties settings together is checked in `check`, so a bad start-up is one
line naming the setting.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import ssl
import tomllib
from dataclasses import dataclass
from typing import Any, Mapping

from backend.constraints.compiler import ConstraintLimits

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
    """llama.cpp compute threads; 0: every core but one, which the server's own gRPC work needs."""
    batch_tokens: int = 512
    gpu_layers: int = 0
    prefix_cache: bool = True
    """llama.cpp: start each prompt from the longest cached prefix of earlier ones (greedy output unchanged)."""
    prefix_cache_slots: int = 2
    """llama.cpp: cache streams beyond max_batch_size that only keep prefixes (context_length cells each)."""
    max_pause_s: float = 300.0
    """A stream whose caller reads nothing for this long ends with ABORTED (PAUSED_TOO_LONG)."""
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
    max_input_bytes: int = 1 << 20
    """Largest prompt, chat (all contents) or Tokenize text in UTF-8 bytes; more is INVALID_ARGUMENT."""
    compile_threads: int = 1
    """Threads for constraint compiles, apart from tokenization and everything else."""
    max_concurrent_compiles: int = 4
    """Constraint compiles running at once; more are refused with RESOURCE_EXHAUSTED and RetryInfo."""
    compile_timeout_s: float = 10.0
    """How long a caller waits for its constraint to compile (it finishes and is cached regardless)."""
    constraint_cache_mb: int = 512
    """Memory the compiled-constraint cache may hold (estimated), besides its 256-entry cap."""
    constraint_max_items_in_row: int = 2000
    """llguidance: most alternatives in one grammar rule (beyond: INVALID_ARGUMENT)."""
    constraint_lexer_fuel: int = 1_000_000
    """llguidance: work allowed building a constraint's lexer (about 50 per microsecond)."""
    constraint_step_lexer_fuel: int = 200_000
    """llguidance: lexer work allowed per token mask (about 14 per microsecond)."""
    constraint_max_lexer_states: int = 50_000
    """llguidance: lexer states one constraint may build (1-2 kB each, shared by its streams)."""
    constraint_max_grammar_size: int = 500_000
    """llguidance: symbols in a compiled grammar."""
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    """When set, clients must present a certificate signed by this CA (mTLS)."""
    api_keys_file: str = ""
    """API keys, one `name:sha256hex` per line; re-read when it changes and on SIGHUP."""
    api_keys: str = ""
    """API keys as comma-separated `name:sha256hex` (usually TOKENSPOUT_API_KEYS)."""
    reflection_requires_auth: bool = False
    """With API keys configured, reflection also needs a key (health stays open)."""
    special_tokens_in_chat_content: bool = False
    """Opt-in, unsafe: special-token text inside chat messages becomes real special tokens."""
    log_level: str = "INFO"
    log_format: str = "text"
    """text, or json: one object per line with request_id and trace_id."""
    trace_content: bool = False
    """Opt-in: record prompt and output text in spans (gen_ai.input/output.messages)."""
    prometheus_port: int = 0
    """Serve Prometheus metrics on this port (0: off). OTLP export follows the OTEL_* variables."""
    test_fail_requests_with_prefix: str = ""
    """Test-only: requests whose id has this prefix fail inside the engine."""
    test_kill_engine_after_steps: int = 0
    """Test-only: the engine thread dies after this many steps (0: never), to test liveness."""

    def constraint_limits(self) -> ConstraintLimits:
        return ConstraintLimits(
            max_items_in_row=self.constraint_max_items_in_row,
            initial_lexer_fuel=self.constraint_lexer_fuel,
            step_lexer_fuel=self.constraint_step_lexer_fuel,
            max_lexer_states=self.constraint_max_lexer_states,
            max_grammar_size=self.constraint_max_grammar_size,
            cache_bytes=self.constraint_cache_mb << 20,
        )


FIELDS = {f.name: f for f in dataclasses.fields(ServeConfig)}

_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "text"}


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(f"{text!r} is not a boolean (use true/false, 1/0 or yes/no)")


def field_type(name: str) -> type:
    return type(FIELDS[name].default)


def _coerce(name: str, value: Any) -> Any:
    """A value from any source as its field's type; TOML values must already have that type."""
    kind = field_type(name)
    try:
        if isinstance(value, str):
            if kind is bool:
                return parse_bool(value)
            return kind(value.strip()) if kind is not str else value
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}" if kind is bool else f"{name}: expected {_KIND_NAMES[kind]}, got {value!r}") from exc
    raise ValueError(f"{name}: expected {_KIND_NAMES[kind]}, got {value!r}")


def load_config(
    flags: Mapping[str, Any], environ: Mapping[str, str] = os.environ, config_file: str | None = None
) -> ServeConfig:
    """Merges the sources and checks the result; `flags` holds only the flags given (None = not given)."""
    values: dict[str, Any] = {}
    path = config_file or environ.get(ENV_PREFIX + "CONFIG")
    if path:
        try:
            with open(pathlib.Path(path), "rb") as f:
                from_file = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path} is not valid TOML: {exc}") from exc
        unknown = set(from_file) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown settings in {path}: {', '.join(sorted(unknown))}")
        values.update(from_file)
    for name in FIELDS:
        if ENV_PREFIX + name.upper() in environ:
            values[name] = environ[ENV_PREFIX + name.upper()]
    values.update({k: v for k, v in flags.items() if v is not None and k in FIELDS})
    config = ServeConfig(**{name: _coerce(name, value) for name, value in values.items()})
    check(config)
    return config


def _check_tls_files(config: ServeConfig) -> None:
    """Python's own TLS loads the files as gRPC will, so bad PEM fails here in one line, not in gRPC's log."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key, password=lambda: b"")  # never prompts
    except ssl.SSLError as exc:
        raise ValueError(
            f"tls_cert and tls_key: not a PEM certificate and its unencrypted private key ({exc.reason or exc})"
        ) from None
    if config.tls_client_ca:
        try:
            context.load_verify_locations(config.tls_client_ca)
        except ssl.SSLError as exc:
            raise ValueError(f"tls_client_ca: not a PEM CA certificate ({exc.reason or exc})") from None


def check(config: ServeConfig) -> None:
    """Every rule between settings, in one place; raises ValueError with one line naming the setting."""
    problems = [
        (config.context_length < 16, "context_length must be at least 16"),
        (config.max_batch_size < 1, "max_batch_size must be at least 1"),
        (config.batch_tokens < config.max_batch_size, "batch_tokens must be at least max_batch_size"),
        (config.threads < 0 or config.gpu_layers < 0 or config.cache_tokens < 0,
         "threads, gpu_layers and cache_tokens must not be negative"),
        (config.max_queued_requests < 0, "max_queued_requests must not be negative"),
        (config.prefix_cache_slots < 0, "prefix_cache_slots must not be negative"),
        (config.max_pause_s <= 0, "max_pause_s must be positive"),
        (config.stream_buffer_events < 2, "stream_buffer_events must be at least 2"),
        (config.grace_period_s < 0, "grace_period_s must not be negative"),
        (min(dataclasses.astuple(config.constraint_limits())) < 1, "constraint_* limits must be positive"),
        (min(config.max_input_bytes, config.compile_threads, config.max_concurrent_compiles,
             config.constraint_cache_mb) < 1 or config.compile_timeout_s <= 0,
         "max_input_bytes, compile_threads, max_concurrent_compiles, constraint_cache_mb and compile_timeout_s "
         "must be positive"),
        (config.engine not in ("llama.cpp", "exllamav2"), "engine must be llama.cpp or exllamav2"),
        (config.cache_type not in ("fp16", "q4", "q6", "q8"), "cache_type must be fp16, q4, q6 or q8"),
        (config.log_format not in ("text", "json"), "log_format must be text or json"),
        (config.log_level.upper() not in LOG_LEVELS, f"log_level must be one of {', '.join(LOG_LEVELS)}"),
        (not 0 <= config.prometheus_port <= 65535, "prometheus_port must be 0 to 65535"),
        (config.test_kill_engine_after_steps < 0, "test_kill_engine_after_steps must not be negative"),
        (":" not in config.listen, "listen must be host:port (port 0 picks a free one)"),
        (bool(config.tls_cert) != bool(config.tls_key), "tls_cert and tls_key go together"),
        (bool(config.tls_client_ca) and not config.tls_cert,
         "tls_client_ca (mTLS) needs tls_cert and tls_key: without them the server would be plaintext"),
    ]
    for failed, message in problems:
        if failed:
            raise ValueError(message)
    for name in ("tls_cert", "tls_key", "tls_client_ca", "api_keys_file"):
        path = getattr(config, name)
        if path and not os.access(path, os.R_OK):
            raise ValueError(f"{name}: cannot read {path}")
    if config.tls_cert:
        _check_tls_files(config)
    if config.reflection_requires_auth and not (config.api_keys or config.api_keys_file):
        raise ValueError("reflection_requires_auth needs api_keys or api_keys_file")
    if config.api_keys or config.api_keys_file:
        from service.auth import KeyStore  # the keys' own format rules live with them

        KeyStore(config.api_keys, config.api_keys_file)
