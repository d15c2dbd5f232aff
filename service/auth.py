"""Who is calling: API keys sent as bearer tokens, and the client certificate under mTLS.

Keys are configured as `name:sha256hex` (the hex SHA-256 of the key itself, so
the server never stores a usable key): one per line in `api_keys_file`, which
is re-read when it changes and on SIGHUP, and comma-separated in `api_keys`.
Callers send `authorization: Bearer <key>`. Every configured digest is compared
with `hmac.compare_digest`, so the time taken says nothing about which key, or
how much of one, matched.

The caller's identity is the key's name; without keys, the client certificate's
subject under mTLS; otherwise anonymous (""). Handlers read it with `caller()`.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
import os
import re
import time
from typing import TYPE_CHECKING

import grpc

from service.errors import ServiceError, unauthenticated
from service.guard import guarded

if TYPE_CHECKING:
    from service.config import ServeConfig

log = logging.getLogger(__name__)

ANONYMOUS = ""
_caller: contextvars.ContextVar[str] = contextvars.ContextVar("tokenspout_caller", default=ANONYMOUS)
_KEY_LINE = re.compile(r"([^:\s]+):([0-9a-fA-F]{64})")
# How often a changed keys file is noticed without SIGHUP.
_FILE_CHECK_S = 1.0
# Refused calls are logged at most this often, however many arrive.
_REFUSAL_LOG_INTERVAL_S = 60.0

HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIX = "/grpc.reflection."


def caller() -> str:
    """The identity of the caller whose RPC is running in this task ("" when anonymous)."""
    return _caller.get()


def parse_keys(text: str, source: str) -> list[tuple[str, bytes]]:
    """`name:sha256hex` entries, one per line (blank lines and # comments skipped)."""
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _KEY_LINE.fullmatch(line)
        if match is None:
            raise ValueError(f"{source} line {number}: expected name:sha256hex (64 hex digits)")
        keys.append((match.group(1), bytes.fromhex(match.group(2))))
    return keys


class KeyStore:
    def __init__(self, inline: str = "", path: str = "") -> None:
        self._inline = parse_keys(inline.replace(",", "\n"), "api_keys")
        self._path = path
        self._stamp: tuple | None = None
        self._checked_at = 0.0
        self._keys = list(self._inline)
        if path:
            self.reload()

    def __len__(self) -> int:
        return len(self._keys)

    def reload(self) -> None:
        """Re-reads the keys file; raises OSError or ValueError and keeps the old keys if it is bad."""
        stat = os.stat(self._path)
        with open(self._path, encoding="utf-8") as f:
            from_file = parse_keys(f.read(), self._path)
        self._keys = self._inline + from_file
        self._stamp = (stat.st_mtime_ns, stat.st_size, stat.st_ino)

    def reload_if_changed(self, force: bool = False) -> None:
        """At most once a second (or when forced, on SIGHUP): a changed or replaced file is re-read."""
        now = time.monotonic()
        if not self._path or not (force or now - self._checked_at >= _FILE_CHECK_S):
            return
        self._checked_at = now
        try:
            stat = os.stat(self._path)
            if force or (stat.st_mtime_ns, stat.st_size, stat.st_ino) != self._stamp:
                self.reload()
                log.info("API keys reloaded from %s: %d keys", self._path, len(self._keys))
        except (OSError, ValueError) as exc:
            log.error("API keys file not reloaded, the previous keys stay in force: %s", exc)

    def name_for(self, key: str) -> str | None:
        """The name of a configured key, or None. Compares every digest, whichever matches."""
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        found = None
        for name, expected in self._keys:
            if hmac.compare_digest(digest, expected) and found is None:
                found = name
        return found


def certificate_subject(context: grpc.aio.ServicerContext) -> str:
    """The verified client certificate's subject (or common name), "" without one."""
    properties = context.auth_context()
    for name in ("x509_subject", "x509_common_name"):
        values = properties.get(name)
        if values:
            return values[0].decode("utf-8", "replace")
    return ""


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Sets each call's identity; with keys configured, refuses calls without a valid one.

    Health is always open (probes carry no keys); reflection too unless `reflection_requires_auth`.
    """

    def __init__(self, keys: KeyStore | None, mtls: bool, reflection_requires_auth: bool = False) -> None:
        self.keys = keys
        self._mtls = mtls
        self._open = (HEALTH_PREFIX,) if reflection_requires_auth else (HEALTH_PREFIX, REFLECTION_PREFIX)
        self._refused_since_log = 0
        self._refusal_logged_at = -_REFUSAL_LOG_INTERVAL_S

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._open):
            return handler
        return guarded(handler, self._identify)

    def _identify(self, context: grpc.aio.ServicerContext) -> None:
        if self.keys is None:
            _caller.set(certificate_subject(context) if self._mtls else ANONYMOUS)
            return
        self.keys.reload_if_changed()
        token = bearer_token(context)
        if token is None:
            raise self._refused(context, "this server needs an API key: send `authorization: Bearer <key>`")
        name = self.keys.name_for(token)
        if name is None:
            raise self._refused(context, "the API key was not accepted")
        _caller.set(name)

    def _refused(self, context: grpc.aio.ServicerContext, why: str) -> ServiceError:
        """The error for a refused call; one WARNING line a minute at most, with the last peer."""
        self._refused_since_log += 1
        now = time.monotonic()
        if now - self._refusal_logged_at >= _REFUSAL_LOG_INTERVAL_S:
            log.warning("refused %d unauthenticated call(s), the last from %s: %s", self._refused_since_log,
                        context.peer(), why)
            self._refused_since_log = 0
            self._refusal_logged_at = now
        return unauthenticated(why)


def bearer_token(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


def interceptor(config: ServeConfig) -> AuthInterceptor | None:
    """The interceptor this config needs (None when there are neither keys nor mTLS), with one log line."""
    mtls = bool(config.tls_client_ca)
    if config.api_keys or config.api_keys_file:
        keys = KeyStore(config.api_keys, config.api_keys_file)
        reflection = "needs a key" if config.reflection_requires_auth else "open"
        log.info(
            "authentication on: %d API keys; health open, reflection %s%s",
            len(keys), reflection, "; client certificates verified (mTLS)" if mtls else "",
        )
        return AuthInterceptor(keys, mtls, config.reflection_requires_auth)
    if mtls:
        log.info("authentication by client certificate (mTLS) only: no API keys configured")
        return AuthInterceptor(None, mtls=True)
    log.info("authentication off: no api_keys or api_keys_file configured, every caller may use every RPC")
    return None
