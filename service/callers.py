"""Who a request is for, as fair sharing sees it: its fairness key, the key's weight, and whether the
caller may ask for a priority above 0.

The fairness key is the caller's identity (service.auth.caller(): the API key's name, the client
certificate's subject, else anonymous ""), unless `fairness_header` names a header that the proxy in
front sets for every call (the Gateway API Inference Extension's `x-gateway-inference-fairness-id`):
then that header's value, when the call has one. Only set it where every call comes through that
proxy, since any caller can send a header.
"""

from __future__ import annotations

from collections.abc import Iterable

from service.caller_weights import ANY_CALLER, CallerWeight
from service.errors import FieldViolation, invalid_argument, priority_not_allowed

MAX_KEY_LENGTH = 128


class Callers:
    def __init__(
        self, weights: tuple[CallerWeight, ...] = (), priority_callers: tuple[str, ...] = (ANY_CALLER,),
        fairness_header: str = "",
    ) -> None:
        self._weights = dict(weights)
        self._priority_callers = frozenset(priority_callers)
        self._header = fairness_header.lower()

    def key(self, identity: str, metadata: Iterable[tuple[str, str | bytes]]) -> str:
        """The fairness key of a call by `identity` with this metadata (gRPC's: bytes under a `-bin` key).
        Raises INVALID_ARGUMENT for a bad header, binary ones included."""
        if not self._header:
            return identity
        value = next((v for k, v in metadata if k == self._header), None)
        if value is None:
            return identity
        if isinstance(value, bytes) or not 0 < len(value) <= MAX_KEY_LENGTH or not all(" " <= c <= "~" for c in value):
            raise invalid_argument([FieldViolation(
                self._header, f"printable ASCII, 1 to {MAX_KEY_LENGTH} characters (a fairness id)")])
        return value

    def weight(self, key: str) -> float:
        return self._weights.get(key, 1.0)

    def check_priority(self, identity: str, priority: int) -> None:
        """Raises PERMISSION_DENIED when the caller asks for a priority above 0 and `priority_callers` leaves it out."""
        if priority > 0 and ANY_CALLER not in self._priority_callers and identity not in self._priority_callers:
            raise priority_not_allowed(priority)
