"""Server settings, resolved once at start-up: flags > environment > config file > defaults.

Each setting has one flat name, whatever section of the config holds it: the
engine's settings are declared with the engine (backend.config.EngineConfig)
and nested here, the service's own are below. Environment variables are the
names upper-cased with a TOKENSPOUT_ prefix (TOKENSPOUT_CONTEXT_LENGTH, ...);
the config file is TOML with the names at the top level. Every value is parsed
by its field's type (service.setting_values), and every rule between settings
is checked when its section is built, so a bad start-up is one line naming the
setting. Each setting is declared with its help (backend.setting), which
`serve --help` and docs/configuration.md show (service.settings_help).
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

from backend import EngineConfig, Group, SettingHelp, setting
from service.cache_scope import CacheScope
from service.caller_weights import ANY_CALLER, CallerWeight
from service.keys import ApiKey
from service.setting_values import check_typed, coerce

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
    listen: str = setting(
        "127.0.0.1:50051", "Address to bind. Port 0 picks a free one.", Group.SERVER, values="`host:port`")
    engine: EngineConfig = field(default_factory=EngineConfig)
    engine_process: bool = setting(
        True, "The engine in a process of its own, supervised and started again if it dies "
        "([the engine process](engines.md#the-engine-process)); `false`: on a thread of the server's process, "
        "whose death then ends the server.", Group.SERVER)
    front_ends: int = setting(
        1, "gRPC front-end processes on `listen`, one engine. The kernel spreads connections, not calls, among "
        "them. Needs `engine_process`.", Group.SERVER, values="1 to 64")
    max_engine_restarts: int = setting(
        5, "Deaths of the engine process in a row after which the server exits (status 3) instead of starting "
        "it again; an hour up starts the count again.", Group.SERVER, values="0 or more")
    caller_weights: tuple[CallerWeight, ...] = setting(
        (), "`name=weight` per caller: its share relative to others.", Group.SCHEDULING,
        values="`name=weight` entries, comma-separated (or a TOML list); weights above 0",
        shown_default="every caller 1")
    priority_callers: tuple[str, ...] = setting(
        (ANY_CALLER,), "Callers that may send `priority` above 0. `*` is everyone; empty is no one. Others get "
        "`PERMISSION_DENIED`.", Group.SCHEDULING, values="caller names, comma-separated (or a TOML list)")
    fairness_header: str = setting(
        "", "A header a trusted proxy sets to name the tenant (e.g. `x-gateway-inference-fairness-id`). Its value "
        "becomes the caller's fairness key. Set it only where every call comes through that proxy.",
        Group.SCHEDULING, values="a header name")
    cache_scope: CacheScope = setting(
        CacheScope.SHARED, "Whose requests share cached prefixes: `shared` (everyone's; a request's `cache_salt` "
        "narrows it) or `caller` (each caller's own, by fairness key; `cache_salt` divides further, and no salt "
        "reaches another caller's cells). `caller` closes the first-token-time side channel between callers; the "
        "llama.cpp engine only (exllamav2 and exllamav3 refuse it at start-up).", Group.SCHEDULING)
    caller_metric_labels: int = setting(
        20, "Callers that get their own `tokenspout.caller` metric label (the first seen). The rest share "
        "`_other`.", Group.SCHEDULING, values="0 or more")
    stream_buffer_events: int = setting(
        64, "Token events buffered for a slow reader before its sequence is paused.", Group.STREAMS,
        values="at least 2")
    grace_period_s: float = setting(
        30.0, "On SIGTERM or SIGINT, how long running streams may finish.", Group.STREAMS,
        values="seconds, 0 or more")
    max_input_bytes: int = setting(
        1 << 20, "Largest prompt, chat (all messages) or Tokenize input, in UTF-8 bytes. More is "
        "`INVALID_ARGUMENT`.", Group.STREAMS, values="at least 1")
    compile_timeout_s: float = setting(
        10.0, "How long a caller waits for a compile (`COMPILE_BUDGET_EXCEEDED` after). The compile still "
        "finishes into the cache.", Group.CONSTRAINTS, values="seconds, above 0")
    tls_cert: str = setting(
        "", "Serve TLS with this certificate (PEM). Goes with `tls_key`.", Group.SECURITY, values="a PEM file")
    tls_key: str = setting(
        "", "The certificate's private key (PEM, unencrypted). Goes with `tls_cert`.", Group.SECURITY,
        values="a PEM file")
    tls_client_ca: str = setting(
        "", "Also require client certificates signed by this CA (mTLS). Needs `tls_cert`.", Group.SECURITY,
        values="a PEM file")
    api_keys_file: str = setting(
        "", "API keys, one `name:sha256hex` per line, `#` comments allowed. Re-read when it changes and on "
        "SIGHUP; a file that does not parse keeps the previous keys.", Group.SECURITY, values="a file")
    api_keys: tuple[ApiKey, ...] = setting(
        (), "More keys, as text (also in the TOML file).", Group.SECURITY,
        values="`name:sha256hex` entries, comma-separated")
    reflection_requires_auth: bool = setting(
        False, "With API keys, reflection needs a key too. Health stays open. Needs keys.", Group.SECURITY)
    special_tokens_in_chat_content: bool = setting(
        False, "Unsafe opt-in: special-token text inside chat messages becomes special tokens. For trusted "
        "callers only.", Group.SECURITY)
    tool_call_format: ToolCallFormat = setting(
        ToolCallFormat.AUTO, "How the model writes tool calls, parsed out of its output and enforced: `auto` (the "
        "chat template's own markup; `hermes` with the fallback prompt when the template takes no tools), "
        "`hermes`, `llama3_json`, `mistral`, or `none` (chats with tools are refused). See "
        "[API](api.md#tool-calls-and-reasoning).", Group.TOOLS)
    reasoning_format: ReasoningFormatSetting = setting(
        ReasoningFormatSetting.AUTO, "The reasoning markup parsed out of text and enforced: `auto` (the "
        "template's, else `think`), `think` (`<think>`...`</think>`), or `none` (reasoning stays in text; "
        "`REASONING_MODE_ON` is refused).", Group.TOOLS)
    log_level: LogLevel = setting(LogLevel.INFO, "The least severe level logged.", Group.TELEMETRY,
                                  values="`DEBUG`, `INFO`, `WARNING`, `ERROR` or `CRITICAL`, any case")
    log_format: LogFormat = setting(
        LogFormat.TEXT, "`text`: time, level, logger and message. `json`: one object per line, with "
        "`request_id`, `trace_id` and `caller`.", Group.TELEMETRY)
    trace_content: bool = setting(
        False, "Record prompt and output text in spans (`gen_ai.input.messages`, `gen_ai.output.messages`).",
        Group.TELEMETRY)
    prometheus_port: int = setting(
        0, "Serve Prometheus metrics on this port, at `/metrics` (front end i of several on this port + i). `0` "
        "is off. OTLP export follows the `OTEL_*` variables.", Group.TELEMETRY, values="0 to 65535")
    prometheus_host: str = setting(
        "", "The address the metrics listener binds. By default the host of `listen`, so a server that listens "
        "on loopback keeps its metrics there too; `0.0.0.0` (or `::`) exposes them on every interface.",
        Group.TELEMETRY, values="a host name or address", shown_default="the host of `listen`")
    cache_events_endpoint: str = setting(
        "", "Also publish the events over ZMQ PUB, in vLLM's msgpack format. An address with `*` (`tcp://*:5557`), "
        "`ipc://` or `inproc://` is bound; any other is connected to (a central subscriber that binds).",
        Group.CACHE_EVENTS, values="a ZMQ address")
    cache_events_replay_endpoint: str = setting(
        "", "A ZMQ ROUTER address (bound) where a subscriber asks for missed batches or a snapshot "
        "(`tcp://*:5558`).", Group.CACHE_EVENTS, values="a ZMQ address")
    cache_events_topic: str = setting(
        "", "The topic of every ZMQ message, as llm-d's indexer parses it.", Group.CACHE_EVENTS, values="text",
        shown_default="`kv@<POD_IP or host name>@<model id>`")

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
    def metrics_host(self) -> str:
        """Where the Prometheus listener binds: prometheus_host, else the host gRPC listens on (all interfaces
        for an empty host, loopback for a unix socket), so metrics are never more exposed than the API."""
        if self.prometheus_host:
            return self.prometheus_host
        if self.listen.startswith("unix"):
            return "127.0.0.1"
        return self.listen.rpartition(":")[0].strip("[]") or "0.0.0.0"

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
    help: SettingHelp


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
        assert "help" in f.metadata, f"setting {name} has no help: declare it with backend.setting(...)"
        found[name] = Setting(name, (*path, f.name), kind, default, f.metadata["help"])
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
        for name, value in from_file.items():
            check_typed(name, SETTINGS[name].kind, value, path)
        values.update(from_file)
    for name in SETTINGS:
        if ENV_PREFIX + name.upper() in environ:
            values[name] = environ[ENV_PREFIX + name.upper()]
    values.update({k: v for k, v in flags.items() if v is not None and k in SETTINGS})
    by_path = {SETTINGS[name].path: coerce(name, SETTINGS[name].kind, value) for name, value in values.items()}
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
