"""The Python client's retry policy: which errors, how long, and never past the deadline."""

from __future__ import annotations

import time

import grpc

from tokenspout import InvalidRequestError, OverloadedError, RetryPolicy, UnavailableError


def overloaded(retry_after: float | None = None) -> OverloadedError:
    return OverloadedError("full", code=grpc.StatusCode.RESOURCE_EXHAUSTED, retry_after=retry_after)


def test_the_servers_delay_is_honoured_with_a_little_jitter():
    policy = RetryPolicy(max_retries=3, initial_backoff=0.1)
    waits = [policy.delay(overloaded(retry_after=2.0), 0, None) for _ in range(50)]
    assert all(2.0 <= wait <= 2.4 for wait in waits) and len(set(waits)) > 1


def test_without_a_delay_the_backoff_grows_and_is_capped():
    policy = RetryPolicy(max_retries=10, initial_backoff=0.5, multiplier=2.0, max_backoff=3.0)
    error = UnavailableError("down", code=grpc.StatusCode.UNAVAILABLE)
    for retries_done, most in [(0, 0.5), (1, 1.0), (2, 2.0), (3, 3.0), (6, 3.0)]:
        wait = policy.delay(error, retries_done, None)
        assert most / 2 <= wait <= most


def test_bounded_retries_only_of_retryable_errors_and_never_past_the_deadline():
    policy = RetryPolicy(max_retries=2)
    assert policy.delay(overloaded(1.0), 2, None) is None  # retries used up
    invalid = InvalidRequestError("bad", code=grpc.StatusCode.INVALID_ARGUMENT)
    assert policy.delay(invalid, 0, None) is None
    assert policy.delay(overloaded(1.0), 0, time.monotonic() + 0.5) is None  # the wait would pass the deadline
    assert policy.delay(overloaded(1.0), 0, time.monotonic() + 5.0) is not None
