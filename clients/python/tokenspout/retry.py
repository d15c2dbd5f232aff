"""When and how long to wait before trying a call again.

Only calls that have received nothing yet are retried (a unary call, or a stream before its first
message): the server has not started their generation, so a retry cannot duplicate output.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import grpc

from tokenspout.errors import TokenspoutError, from_rpc_error

log = logging.getLogger("tokenspout.client")


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


class Tries:
    """One call's tries under one deadline, the same for a unary call and a stream, sync or asyncio: what is
    left of the deadline for the next try, and how long to wait before it."""

    def __init__(self, policy: RetryPolicy, timeout: float | None) -> None:
        self.policy = policy
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.retries = 0

    def timeout(self) -> float | None:
        """The next try's timeout: what is left of the deadline."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def wait_after(self, rpc_error: grpc.RpcError, what: str, may_retry: bool = True) -> float:
        """Seconds to wait before trying `what` again; raises the call's error (a TokenspoutError) instead when
        it may not be retried or the policy says no."""
        error = from_rpc_error(rpc_error)
        wait = self.policy.delay(error, self.retries, self.deadline) if may_retry else None
        if wait is None:
            raise error from None
        self.retries += 1
        log.info("retrying %s in %.2f s after %s", what, wait, error)
        return wait
