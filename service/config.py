"""Server settings, resolved once at start-up: flags > environment > config file > defaults.

Each setting has one flat name, whatever section of the config holds it: the
engine's settings are declared with the engine (backend.config.EngineConfig)
and nested here, the service's own are below. Environment variables are the
names upper-cased with a TOKENSPOUT_ prefix (TOKENSPOUT_CONTEXT_LENGTH, ...);
the config file is TOML with the names at the top level. Every value is parsed
by its field's type (a bool is true/false/1/0/yes/no, nothing else; a closed
set is one of its values), and every rule between settings is checked when its
section is built, so a bad start-up is one line naming the setting.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pathlib
import ssl
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from backend import EngineConfig
from service.cache_scope import CacheScope
from service.callers import ANY_CALLER, CallerWeight, parse_weights
from service.keys import ApiKey, parse_keys

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ENV_PREFIX = "TOKENSPOUT_"
_Section = typing.TypeVar("_Section", bound="DataclassInstance")
"""A config section: ServeConfig, or a dataclass nested in it."""


class LogFormat(enum.StrEnum):
    TEXT = "text"
    JSON = "json"
    """One object per line, with request_id, trace_id and caller."""


class ToolCallFormat(enum.StrEnum):
    """How the model writes tool calls (backend.tools.formats); auto: from its chat template."""

    AUTO = "auto"
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"
    NONE = "none"


class ReasoningFormatSetting(enum.StrEnum):
    """The reasoning markup parsed out of output; auto: the template's, else <think>."""

    AUTO = "auto"
    THINK = "think"
    NONE = "none"


class LogLevel(enum.StrEnum):
    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"
    CRITICAL = "CRITICAL"

    @classmethod
    def _missing_(cls, value: object) -> LogLevel | None:
        return cls.__members__.get(str(value).upper())  # any case, as Python's logging takes it


@dataclass(frozen=True)
class ServeConfig:
    listen: str = "127.0.0.1:50051"
    engine: EngineConfig = field(default_factory=EngineConfig)
    engine_process: bool = True
    """Run the engine in a process of its own, supervised, beside the gRPC front ends (false: in the server's
    process, as one front end with it)."""
    front_ends: int = 1
    """gRPC front-end processes, all on `listen` (SO_REUSEPORT spreads connections, not calls), one engine."""
    max_engine_restarts: int = 5
    """Times in a row the engine process is started again after dying before the server gives up and exits
    (a run of an hour without dying starts the count again)."""
    caller_weights: tuple[CallerWeight, ...] = ()
    """`name=weight` per fairness key (comma-separated, or a TOML list): its share relative to others (default 1)."""
    priority_callers: tuple[str, ...] = (ANY_CALLER,)
    """The callers (identities) that may send a priority above 0; "*" is everyone, empty is no one."""
    fairness_header: str = ""
    """A header the proxy in front sets to name the tenant (x-gateway-inference-fairness-id); empty: off."""
    cache_scope: CacheScope = CacheScope.SHARED
    """Whose requests share cached prefixes: everyone's (`shared`), or each caller's own (`caller`: its
    fairness key); a request's cache_salt narrows either (see service.cache_scope)."""
    caller_metric_labels: int = 20
    """Callers that get their own label on per-caller metrics (the first seen); the rest share "_other"."""
    stream_buffer_events: int = 64
    """Token events buffered for a caller that reads slowly before its sequence is paused."""
    grace_period_s: float = 30.0
    max_input_bytes: int = 1 << 20
    """Largest prompt, chat (all contents) or Tokenize text in UTF-8 bytes; more is INVALID_ARGUMENT."""
    compile_timeout_s: float = 10.0
    """How long a caller waits for its constraint to compile (it finishes and is cached regardless)."""
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    """When set, clients must present a certificate signed by this CA (mTLS)."""
    api_keys_file: str = ""
    """API keys, one `name:sha256hex` per line; re-read when it changes and on SIGHUP."""
    api_keys: tuple[ApiKey, ...] = ()
    """API keys as comma-separated `name:sha256hex` (usually TOKENSPOUT_API_KEYS)."""
    reflection_requires_auth: bool = False
    """With API keys configured, reflection also needs a key (health stays open)."""
    special_tokens_in_chat_content: bool = False
    """Opt-in, unsafe: special-token text inside chat messages becomes real special tokens."""
    tool_call_format: ToolCallFormat = ToolCallFormat.AUTO
    """The tool-call markup parsed and enforced: auto takes the template's (hermes for the fallback prompt)."""
    reasoning_format: ReasoningFormatSetting = ReasoningFormatSetting.AUTO
    """The reasoning markup parsed out of text and enforced: auto is the template's, else think."""
    log_level: LogLevel = LogLevel.INFO
    log_format: LogFormat = LogFormat.TEXT
    trace_content: bool = False
    """Opt-in: record prompt and output text in spans (gen_ai.input/output.messages)."""
    prometheus_port: int = 0
    """Serve Prometheus metrics on this port (0: off). OTLP export follows the OTEL_* variables."""
    cache_events_endpoint: str = ""
    """Publish the KV-cache events over ZMQ PUB here (tcp://*:5557 binds, tcp://host:port connects); needs cache_events."""
    cache_events_replay_endpoint: str = ""
    """A ZMQ ROUTER address where a subscriber asks for missed batches or a snapshot (tcp://*:5558); empty: none."""
    cache_events_topic: str = ""
    """The ZMQ topic of every batch; empty: kv@<POD_IP or host name>@<model id>, as llm-d's indexer parses it."""

    def __post_init__(self) -> None:
        rules = [
            (self.stream_buffer_events < 2, "stream_buffer_events must be at least 2"),
            (self.caller_metric_labels < 0, "caller_metric_labels must not be negative"),
            (self.grace_period_s < 0, "grace_period_s must not be negative"),
            (not 1 <= self.front_ends <= 64, "front_ends must be 1 to 64"),
            (self.front_ends > 1 and not self.engine_process, "front_ends above 1 needs engine_process = true"),
            (self.max_engine_restarts < 0, "max_engine_restarts must not be negative"),
            (self.max_input_bytes < 1 or self.compile_timeout_s <= 0,
             "max_input_bytes and compile_timeout_s must be positive"),
            (not 0 <= self.prometheus_port <= 65535, "prometheus_port must be 0 to 65535"),
            (":" not in self.listen, "listen must be host:port (port 0 picks a free one)"),
            (bool(self.tls_cert) != bool(self.tls_key), "tls_cert and tls_key go together"),
            (bool(self.tls_client_ca) and not self.tls_cert,
             "tls_client_ca (mTLS) needs tls_cert and tls_key: without them the server would be plaintext"),
            (self.reflection_requires_auth and not self.authenticates,
             "reflection_requires_auth needs api_keys or api_keys_file"),
            ((bool(self.cache_events_endpoint) or bool(self.cache_events_replay_endpoint)) and not self.engine.cache_events,
             "cache_events_endpoint and cache_events_replay_endpoint need cache_events = true"),
            (bool(self.cache_events_replay_endpoint) and not self.cache_events_endpoint,
             "cache_events_replay_endpoint needs cache_events_endpoint (replay serves what the PUB socket sent)"),
        ]
        for broken, message in rules:
            if broken:
                raise ValueError(message)

    @property
    def authenticates(self) -> bool:
        """Keys are configured (even an empty keys file keeps authentication on)."""
        return bool(self.api_keys or self.api_keys_file)


# -- one flat name per setting ---------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    name: str
    path: tuple[str, ...]
    """Attribute names from ServeConfig down to the value."""
    kind: Any
    default: Any


def _settings(cls: type, path: tuple[str, ...] = (), prefix: str = "") -> dict[str, Setting]:
    found: dict[str, Setting] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            found.update(_settings(kind, (*path, f.name), prefix + f.metadata.get("prefix", "")))
            continue
        name = f.metadata.get("setting", prefix + f.name)
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            assert callable(f.default_factory), f"setting {name} has no default"
            default = f.default_factory()
        assert name not in found, f"two settings named {name}"
        found[name] = Setting(name, (*path, f.name), kind, default)
    return found


SETTINGS = _settings(ServeConfig)


def value_of(config: ServeConfig, name: str) -> Any:
    """A setting's value by its flat name."""
    value: Any = config
    for attribute in SETTINGS[name].path:
        value = getattr(value, attribute)
    return value


def _build(cls: type[_Section], values: Mapping[tuple[str, ...], Any], path: tuple[str, ...] = ()) -> _Section:
    """The (nested) config from values by path; each section's rules run as it is built."""
    hints = typing.get_type_hints(cls)
    arguments = {}
    for f in dataclasses.fields(cls):
        here = (*path, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            arguments[f.name] = _build(hints[f.name], values, here)
        elif here in values:
            arguments[f.name] = values[here]
    return cls(**arguments)


# -- parsing values ---------------------------------------------------------------------------

_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")
_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "text"}


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(f"{text!r} is not a boolean (use true/false, 1/0 or yes/no)")


def _coerce(setting: Setting, value: Any) -> Any:
    """A value from any source as its setting's type; TOML values must already have that type."""
    name, kind = setting.name, setting.kind
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(value.strip())
        except (AttributeError, ValueError):
            choices = [member.value for member in kind]
            raise ValueError(f"{name} must be {', '.join(choices[:-1])} or {choices[-1]}, not {value!r}") from None
    if kind == tuple[ApiKey, ...]:
        if not isinstance(value, str):
            raise ValueError(f"{name}: expected text, got {value!r}")
        return tuple(parse_keys(value.replace(",", "\n"), name))
    if kind == tuple[float, ...]:
        return _numbers(name, value)
    if kind == tuple[str, ...]:
        return _strings(name, value)
    if kind == tuple[CallerWeight, ...]:
        return parse_weights(_strings(name, value), name)
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


def _strings(name: str, value: Any) -> tuple[str, ...]:
    """Comma-separated text ("a,b"), or a TOML list of strings."""
    if isinstance(value, str):
        return tuple(item.strip() for item in value.split(",") if item.strip())
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise ValueError(f"{name}: expected comma-separated text or a list of strings, got {value!r}")


def _numbers(name: str, value: Any) -> tuple[float, ...]:
    """Comma-separated numbers ("20,24"), or a TOML list of them."""
    items = [item for item in value.split(",") if item.strip()] if isinstance(value, str) else value
    try:
        if not isinstance(items, list) or any(isinstance(item, bool) for item in items):
            raise ValueError
        return tuple(float(item) for item in items)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected comma-separated numbers, got {value!r}") from None


# -- loading ------------------------------------------------------------------------------------


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
        unknown = set(from_file) - set(SETTINGS)
        if unknown:
            raise ValueError(f"unknown settings in {path}: {', '.join(sorted(unknown))}")
        values.update(from_file)
    for name in SETTINGS:
        if ENV_PREFIX + name.upper() in environ:
            values[name] = environ[ENV_PREFIX + name.upper()]
    values.update({k: v for k, v in flags.items() if v is not None and k in SETTINGS})
    by_path = {SETTINGS[name].path: _coerce(SETTINGS[name], value) for name, value in values.items()}
    config = _build(ServeConfig, by_path)
    _check_files(config)
    return config


def _check_files(config: ServeConfig) -> None:
    """Files the settings name must be readable, and TLS files must be what they claim."""
    for name in ("tls_cert", "tls_key", "tls_client_ca", "api_keys_file"):
        path = getattr(config, name)
        if path and not os.access(path, os.R_OK):
            raise ValueError(f"{name}: cannot read {path}")
    if config.tls_cert:
        _check_tls_files(config)


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
