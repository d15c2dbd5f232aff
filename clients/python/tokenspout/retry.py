"""When and how long to wait before trying a call again.

Only calls that have received nothing yet are retried (a unary call, or a stream before its first
message): the server has not started their generation, so a retry cannot duplicate output.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from tokenspout.errors import TokenspoutError


@dataclass(frozen=True)
class RetryPolicy:
    """Up to `max_retries` retries of OverloadedError and UnavailableError.

    The wait is the server's RetryInfo delay when it sent one, else an exponential backoff
    (initial_backoff * multiplier ** attempt, at most max_backoff) with jitter.
    """

    max_retries: int = 2
    initial_backoff: float = 0.5
    max_backoff: float = 8.0
    multiplier: float = 2.0

    def delay(self, error: TokenspoutError, retries_done: int, deadline: float | None) -> float | None:
        """Seconds to wait before the next try, or None when the error should be raised."""
        if not error.retryable or retries_done >= self.max_retries:
            return None
        if error.retry_after is not None:
            # Honour the server's delay; a little jitter spreads callers it refused together.
            wait = error.retry_after * random.uniform(1.0, 1.2)
        else:
            wait = min(self.max_backoff, self.initial_backoff * self.multiplier**retries_done)
            wait *= random.uniform(0.5, 1.0)
        if deadline is not None and time.monotonic() + wait >= deadline:
            return None
        return wait


NO_RETRIES = RetryPolicy(max_retries=0)


def deadline_of(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def remaining(deadline: float | None) -> float | None:
    """The timeout for the next try: what is left of the call's deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
