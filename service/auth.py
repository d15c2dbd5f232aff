"""Who is calling: API keys sent as bearer tokens, and the client certificate under mTLS.

Keys are configured as `name:sha256hex` (see service.keys): one per line in
`api_keys_file`, which is re-read when it changes and on SIGHUP, and
comma-separated in `api_keys`. Callers send `authorization: Bearer <key>`.

The caller's identity is the key's name; without keys, the client certificate's
subject under mTLS; otherwise anonymous (""). Handlers read it with `caller()`.
"""

from __future__ import annotations

import contextvars
import logging
import time

import grpc

from service.config import ServeConfig
from service.errors import ServiceError, unauthenticated
from service.guard import Context, Continuation, Request, Response, guarded
from service.keys import KeyStore

log = logging.getLogger(__name__)

ANONYMOUS = ""
_caller: contextvars.ContextVar[str] = contextvars.ContextVar("tokenspout_caller", default=ANONYMOUS)
# Refused calls are logged at most this often, however many arrive.
_REFUSAL_LOG_INTERVAL_S = 60.0

HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIX = "/grpc.reflection."


def caller() -> str:
    """The identity of the caller whose RPC is running in this task ("" when anonymous)."""
    return _caller.get()


def certificate_subject(context: Context) -> str:
    """The verified client certificate's subject (or common name), "" without one."""
    properties = context.auth_context()
    for name in ("x509_subject", "x509_common_name"):
        first = next(iter(properties.get(name, ())), None)
        if first is not None:
            return first.decode("utf-8", "replace")
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

    async def intercept_service(
        self, continuation: Continuation[Request, Response], handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Request, Response] | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._open):
            return handler
        return guarded(handler, self._identify)

    def _identify(self, context: Context) -> None:
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

    def _refused(self, context: Context, why: str) -> ServiceError:
        """The error for a refused call; one WARNING line a minute at most, with the last peer."""
        self._refused_since_log += 1
        now = time.monotonic()
        if now - self._refusal_logged_at >= _REFUSAL_LOG_INTERVAL_S:
            log.warning("refused %d unauthenticated call(s), the last from %s: %s", self._refused_since_log,
                        context.peer(), why)
            self._refused_since_log = 0
            self._refusal_logged_at = now
        return unauthenticated(why)


def bearer_token(context: Context) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str):  # bytes only under a -bin key
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


def interceptor(config: ServeConfig) -> AuthInterceptor | None:
    """The interceptor this config needs (None when there are neither keys nor mTLS), with one log line.
    Reads the keys file: raises OSError or ValueError when it cannot."""
    mtls = bool(config.tls_client_ca)
    if config.authenticates:
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
