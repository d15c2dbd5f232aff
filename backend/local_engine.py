"""An engine in this process: the Engine protocol's commands over an EngineCore on its EngineWorker thread.

What every engine in one process shares, written once: the door (backend.common.door) at submit, each
request's constraint taken from the compile cache (or compiled again on the compile lanes, never on the
submitting thread), the commands queued for the worker, the figures it publishes, and the Vocabulary half
of the protocol, answered by the engine's `vocabulary`. The engine process serves one of these to its front
ends (backend.process.host); tests use them directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from backend.common.cache_events import CacheEventHub
from backend.common.door import Door
from backend.common.output import make_finish
from backend.common.stats import EngineStats
from backend.config import EngineConfig
from backend.constraints import (
    CompiledConstraint,
    CompileLanes,
    CompileReport,
    ConstraintCompiler,
    ConstraintError,
    ConstraintSpec,
    TooManyCompiles,
)
from backend.engine import Vocabulary
from backend.events import ErrorEvent, ErrorKind, EventSink, FinishReason, Timings, TokenEvent
from backend.types import ChatContext, ChatMessage, GenerationRequest, ModelInfo
from backend.worker import EngineCore, EngineWorker, deliver


class WorkerEngine:
    """The command half of the Engine protocol, for an engine whose core runs on an EngineWorker.

    Subclasses call `_serve` once their core is built; every method here is thread-safe.
    """

    info: ModelInfo
    vocabulary: Vocabulary
    """Its tokenizer and chat template (the model itself, or loaded from the model's files)."""
    core: EngineCore
    constraints: ConstraintCompiler
    cache_events: CacheEventHub | None = None
    compiles: CompileLanes
    """Where its constraints compile (thread-safe)."""
    _door: Door
    _worker: EngineWorker

    def _serve(self, core: EngineCore, constraints: ConstraintCompiler, config: EngineConfig, name: str) -> None:
        """Starts the core on its own thread, compiling constraints with `constraints`; `config` as the core has it."""
        self.core = core
        self.constraints = constraints
        self.compiles = CompileLanes(constraints, config.compile_threads, config.max_concurrent_compiles)
        self._door = Door(config.capacity, config.per_caller_limit, config.fairness.fair)
        self._compiling: dict[str, list[_Compiling]] = {}
        """Requests whose constraint left the cache since the service compiled it, compiling again, by id: a caller
        may cancel one and send its id again before the first compile ends, so each is its own entry."""
        self._compiling_lock = threading.Lock()
        self._worker = EngineWorker(core, name)

    async def compile(self, spec: ConstraintSpec) -> CompileReport:
        """Compiles `spec` on the compile lanes (a cache hit at once). Raises ConstraintError or TooManyCompiles."""
        compiled = await asyncio.wrap_future(self.compiles.submit(spec))
        return compiled.report()

    def submit(self, request: GenerationRequest, sink: EventSink) -> None:
        """Lets the request in at the door (backend.common.door) and queues it with its constraint compiled: from the
        cache (the service compiled it first), else compiled again on the compile lanes, never on this thread. A
        refusal, or a constraint that cannot compile, is its one event."""
        scheduling = request.scheduling
        refusal = self._door.enter(request.request_id, scheduling.caller, scheduling.weight, scheduling.priority,
                                   request.n)
        if refusal is not None:
            deliver(sink, refusal)
            return
        spec = request.constraint
        compiled = None if spec is None else self.constraints.cached(spec)
        if spec is None or compiled is not None:
            self._worker.submit(request, sink, compiled)
            return
        try:
            future = self.compiles.submit(spec)
        except TooManyCompiles as busy:
            deliver(sink, ErrorEvent(f"{busy}, the most the engine allows; retry later", ErrorKind.OVERLOADED))
            return
        compiling = _Compiling()
        with self._compiling_lock:
            self._compiling.setdefault(request.request_id, []).append(compiling)
        future.add_done_callback(lambda done: self._compiled(request, sink, compiling, done))

    def _compiled(
        self, request: GenerationRequest, sink: EventSink, compiling: _Compiling, done: Future[CompiledConstraint]
    ) -> None:
        """On a compile thread: the request goes on to the worker, unless it was cancelled meanwhile. Then it ends
        here, never reaching the core: by now its id may belong to a newer request there, which a cancel by id
        would end too, and two live sequences of one id would share the core's bookkeeping."""
        with self._compiling_lock:
            pending = self._compiling[request.request_id]
            pending.remove(compiling)
            if not pending:
                del self._compiling[request.request_id]
        if compiling.cancelled:
            deliver(sink, TokenEvent((), "", 0, make_finish(request, FinishReason.CANCELLED, 0, Timings(0, 0, 0, 0, 0))))
            return
        try:
            compiled = done.result()
        except ConstraintError as exc:
            deliver(sink, ErrorEvent(f"the constraint cannot be enforced: {exc}", ErrorKind.CONSTRAINT_FAILED))
            return
        self._worker.submit(request, sink, compiled)

    def release(self, request_id: str) -> None:
        """Its caller is done with the request: its places at the door are free."""
        self._door.leave(request_id)

    def cancel(self, request_id: str) -> None:
        with self._compiling_lock:
            for compiling in self._compiling.get(request_id, ()):
                compiling.cancelled = True
        self._worker.cancel(request_id)

    def pause(self, request_id: str) -> None:
        self._worker.pause(request_id)

    def resume(self, request_id: str) -> None:
        self._worker.resume(request_id)

    def on_death(self, callback: Callable[[BaseException], None]) -> None:
        """`callback(exc)` runs on the engine thread if it dies."""
        self._worker.death_callbacks.append(callback)

    async def current_stats(self) -> EngineStats:
        return self.stats

    @property
    def stats(self) -> EngineStats:
        """The core's latest figures, with the door's refusals."""
        refused, by_caller = self._door.refusals()
        return dataclasses.replace(self.core.stats, refused_total=refused, refused_callers=by_caller)

    def _stop(self) -> None:
        """Stops the engine thread (ending every request) and the compile lanes."""
        self._worker.close()
        self.compiles.close()

    # The Vocabulary half of the protocol is the engine's `vocabulary`'s.

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.vocabulary.tokenize(text, add_special)

    def token_piece(self, token_id: int) -> bytes:
        return self.vocabulary.token_piece(token_id)

    def render_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, special_tokens_in_content: bool = False,
        context: ChatContext = ChatContext(),
    ) -> list[int]:
        return self.vocabulary.render_chat(messages, add_generation_prompt, special_tokens_in_content, context)

    def close(self) -> None:
        """Stops the engine (`_stop`) and frees its model: each engine's own."""
        raise NotImplementedError


class _Compiling:
    """A request whose constraint compiles before it reaches the worker."""

    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False
