"""What an engine publishes about itself: EngineStats, the snapshot any thread may read, and the
running totals an engine core keeps on its own thread to build it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict, Unpack


@dataclass
class CallerTally:
    """One caller's live figures and totals, for GetServerStatus."""

    caller: str
    running: int = 0
    queued: int = 0
    preempted: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    preempted_total: int = 0
    queue_timeouts_total: int = 0
    shed_total: int = 0
    weight: float = 1.0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after every change; safe to read from any thread."""

    steps: int = 0
    running_sequences: int = 0
    paused_sequences: int = 0
    queued_requests: int = 0
    cache_tokens_used: int = 0
    cache_tokens_total: int = 0
    started_total: int = 0
    cancelled_total: int = 0
    last_cancel_latency_steps: int = 0
    last_cancel_latency_s: float = 0.0
    max_cancel_latency_steps: int = 0
    prefix_cache_entries: int = 0
    """Cached prefixes kept for reuse (idle cache streams, or the engine's own cached pages)."""
    prefix_cache_tokens: int = 0
    prompt_tokens_total: int = 0
    """Prompt tokens of every request started."""
    cached_prompt_tokens_total: int = 0
    """Of those, the ones taken from the prefix cache instead of being computed."""
    preempted_total: int = 0
    """Sequences that gave up their slot to a waiting request (paused ones, or for priority or a fair share)."""
    preempted_sequences: int = 0
    recomputed_tokens_total: int = 0
    """Tokens computed again when preempted sequences came back (what preemption cost)."""
    retiled_tokens_total: int = 0
    """Tokens computed again as prompt rows when their sequences ended, so that later prompts share what
    was generated (what keeping generated tokens cached cost; llama.cpp, backend.llamacpp.retile)."""
    draft_tokens_total: int = 0
    """Proposed tokens checked (speculative decoding) ..."""
    accepted_draft_tokens_total: int = 0
    """... and the ones accepted: output that took no step of its own."""
    shed_total: int = 0
    """Waiting requests that gave their place to a more entitled one (backend.common.fairness)."""
    refused_total: int = 0
    """Requests refused at the door (backend.common.door) ..."""
    refused_callers: tuple[tuple[str, int], ...] = ()
    """... and per caller (fairness key)."""
    cache_events_sequence: int = 0
    """The last KV-cache event batch published (backend.common.cache_events), with cache_events on."""
    engine_restarts: int = 0
    """Times the engine's process was started again after it died (its totals count from its latest start)."""
    callers: tuple[CallerTally, ...] = ()
    """Per caller (fairness key): running, queued and preempted now, and totals (backend.common.fairness)."""

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_prompt_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0


class LiveFigures(TypedDict, total=False):
    """The EngineStats fields an engine core reads off its own state when it publishes (the rest are
    EngineCounters' totals): `EngineCounters.snapshot`'s keyword arguments."""

    steps: int
    running_sequences: int
    paused_sequences: int
    queued_requests: int
    cache_tokens_used: int
    cache_tokens_total: int
    prefix_cache_entries: int
    prefix_cache_tokens: int
    preempted_sequences: int
    cache_events_sequence: int


@dataclass(frozen=True)
class CancelOrder:
    """A cancel as the worker received it, so the core can tell how long it took to serve."""

    request_id: str
    issued_at: float
    issued_at_step: int


@dataclass
class EngineCounters:
    """The running totals of an engine core (engine thread only); `snapshot` publishes them."""

    started_total: int = 0
    prompt_tokens_total: int = 0
    cached_prompt_tokens_total: int = 0
    cancelled_total: int = 0
    last_cancel_latency_steps: int = 0
    last_cancel_latency_s: float = 0.0
    max_cancel_latency_steps: int = 0
    preempted_total: int = 0
    recomputed_tokens_total: int = 0
    retiled_tokens_total: int = 0
    draft_tokens_total: int = 0
    accepted_draft_tokens_total: int = 0
    shed_total: int = 0

    def started(self, prompt_tokens: int) -> None:
        self.started_total += 1
        self.prompt_tokens_total += prompt_tokens

    def cancelled(self, order: CancelOrder, step: int, now: float) -> None:
        """A cancel that ended a request: how many steps and seconds it took to serve."""
        steps = step - order.issued_at_step
        self.cancelled_total += 1
        self.last_cancel_latency_steps = steps
        self.last_cancel_latency_s = now - order.issued_at
        self.max_cancel_latency_steps = max(self.max_cancel_latency_steps, steps)

    def snapshot(self, callers: tuple[CallerTally, ...] = (), **live: Unpack[LiveFigures]) -> EngineStats:
        """The totals with the callers' and the live figures (running_sequences, cache_tokens_used, ...) as
        one EngineStats."""
        return EngineStats(**vars(self), callers=callers, **live)  # every field a number: a shallow copy is a copy
