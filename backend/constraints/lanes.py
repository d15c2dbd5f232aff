"""Constraint compiles, isolated from everything else the engine does.

A big schema can take seconds and hundreds of megabytes to compile. Compiles
therefore run on threads of their own (compiling releases the GIL), in two lanes:
small sources (most constraints, milliseconds each) on one thread, large ones on
`threads` others, so a 2 ms regex never queues behind a 10 s schema. At most
`max_concurrent` large compiles run or wait at once (beyond: TooManyCompiles).
A compile whose caller stopped waiting still finishes and is cached, so a retry
is instant. Cache hits never touch a pool.
"""

from __future__ import annotations

import concurrent.futures
import threading

from backend.constraints.compiler import CompiledConstraint, ConstraintCompiler, source_chars
from backend.constraints.spec import ConstraintSpec

SMALL_SOURCE_CHARS = 16_384
"""Constraints up to this size compile in milliseconds (measured: a 6 kB schema in 10 ms)."""


class TooManyCompiles(Exception):
    """`running` large compiles are under way, the most the engine allows."""

    def __init__(self, running: int) -> None:
        super().__init__(f"{running} large constraint compiles are under way")
        self.running = running


class CompileLanes:
    """Thread-safe: `submit` may be called from any thread."""

    def __init__(self, compiler: ConstraintCompiler, threads: int, max_concurrent: int) -> None:
        self.compiler = compiler
        self._small = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile-small")
        self._large = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="compile-large")
        self._max_concurrent = max_concurrent
        self._lock = threading.Lock()
        self.running = 0
        """Large compiles started and not yet finished (including those whose caller stopped waiting)."""

    def submit(self, spec: ConstraintSpec) -> concurrent.futures.Future[CompiledConstraint]:
        """The compiled constraint, from the cache (a finished future) or a compile on its lane; its exception is
        ConstraintError. Raises TooManyCompiles at once when the large lane is full."""
        hit = self.compiler.cached(spec)
        if hit is not None:
            done: concurrent.futures.Future[CompiledConstraint] = concurrent.futures.Future()
            done.set_result(hit)
            return done
        if source_chars(spec) <= SMALL_SOURCE_CHARS:
            return self._small.submit(self.compiler.compile, spec)
        with self._lock:
            if self.running >= self._max_concurrent:
                raise TooManyCompiles(self.running)
            self.running += 1
        future = self._large.submit(self.compiler.compile, spec)
        future.add_done_callback(self._finished)
        return future

    def _finished(self, future: concurrent.futures.Future[CompiledConstraint]) -> None:
        with self._lock:
            self.running -= 1

    def close(self) -> None:
        for pool in (self._small, self._large):
            pool.shutdown(wait=False, cancel_futures=True)
