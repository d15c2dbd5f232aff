"""Whose requests share cached prefixes: the salt the engine keeps cells apart by.

A cached prefix makes a request's first token come sooner, so a caller timing
its own requests could learn that someone else sent a prompt (a timing side
channel). The engine shares cells only between requests of the same salt; this
module makes that salt from the server's `cache_scope` and the request's own
`cache_salt`:

- `shared`: unsalted requests share with each other; a request with a
  cache_salt shares only with requests of that salt (vLLM's cache_salt:
  the salt is a secret a tenant's callers share).
- `caller`: every caller's requests share only with the same caller's (its
  fairness key: the API key's name, the certificate's subject, or the fairness
  header; see service.callers), and a cache_salt divides that further. The
  caller is part of the salt, so no salt a caller chooses reaches another
  caller's cells.

The parts are hashed length-prefixed, so two different (scope, caller, salt)
never make the same salt; the engine sees only the digest.
"""

from __future__ import annotations

import enum
import hashlib


class CacheScope(enum.StrEnum):
    SHARED = "shared"
    CALLER = "caller"


def cache_salt(scope: CacheScope, caller: str, requested: str) -> str:
    """The salt the engine shares cells by ("" for an unsalted request in the shared scope)."""
    if scope is CacheScope.SHARED and not requested:
        return ""
    parts = [scope.value, *([caller] if scope is CacheScope.CALLER else []), requested]
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()
