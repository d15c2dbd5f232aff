"""Constraint compiles, isolated from everything else the server does.

A big schema can take seconds and hundreds of megabytes to compile. Compiles
therefore run on their own threads (tokenization and other work use the default
pool, so a caller with a cached or no constraint never waits behind them), in two
lanes: small sources (most constraints, milliseconds each) on one thread, large
ones on `threads` others, so a 2 ms regex never queues behind a 10 s schema. At
most `max_concurrent` large compiles run or wait per server (beyond:
RESOURCE_EXHAUSTED with RetryInfo), and a caller waits at most `timeout_s` for
one. A compile that outlives its caller's budget still finishes and is cached,
so a retry is instant. Cache hits never touch a pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

from backend.constraints import CompiledConstraint, ConstraintCompiler, ConstraintSpec, source_chars
from service.errors import compile_budget_exceeded, too_many_compiles

SMALL_SOURCE_CHARS = 16_384
"""Constraints up to this size compile in milliseconds (measured: a 6 kB schema in 10 ms)."""


class CompileGate:
    def __init__(self, compiler: ConstraintCompiler, threads: int, max_concurrent: int, timeout_s: float) -> None:
        self._compiler = compiler
        self._small = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile-small")
        self._large = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="compile-large")
        self._max_concurrent = max_concurrent
        self._timeout_s = timeout_s
        self.running = 0
        """Large compiles started and not yet finished (including those whose caller stopped waiting)."""

    async def compile(self, spec: ConstraintSpec) -> CompiledConstraint:
        """The compiled constraint, from the cache or a fresh compile. Raises ConstraintError or ServiceError."""
        hit = self._compiler.cached(spec)
        if hit is not None:
            return hit
        loop = asyncio.get_running_loop()
        if source_chars(spec) <= SMALL_SOURCE_CHARS:
            future = loop.run_in_executor(self._small, self._compiler.compile, spec)
            future.add_done_callback(_retrieve)
        else:
            if self.running >= self._max_concurrent:
                raise too_many_compiles(self.running)
            self.running += 1
            future = loop.run_in_executor(self._large, self._compiler.compile, spec)
            future.add_done_callback(self._finished)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self._timeout_s)
        except TimeoutError:
            raise compile_budget_exceeded(self._timeout_s) from None

    def _finished(self, future: asyncio.Future[CompiledConstraint]) -> None:
        self.running -= 1
        _retrieve(future)

    def close(self) -> None:
        for pool in (self._small, self._large):
            pool.shutdown(wait=False, cancel_futures=True)


def _retrieve(future: asyncio.Future[CompiledConstraint]) -> None:
    """Reads the outcome, so a compile whose caller stopped waiting leaves no 'never retrieved' warning."""
    if not future.cancelled():
        future.exception()
