"""The engine protocol: what the service needs from any model backend.

Every engine is job-based and owns its model from exactly one worker thread:
`submit` and `cancel` are commands into that thread, and each request's events
come back through the `EventSink` it was submitted with, called from the
worker thread. The service never touches model objects itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from backend.constraints import ConstraintCompiler
from backend.fairness import CallerTally
from backend.types import Event, GenerationRequest, SpeculationMode, SpeculationParams

EventSink = Callable[[Event], None]
"""Receives one request's events on the engine thread; must not block."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    engine: str
    context_length: int
    vocab_size: int
    max_batch_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    samplers: tuple[str, ...]
    constraint_kinds: tuple[str, ...] = field(default_factory=tuple)
    quantization: str = ""
    speculation_modes: tuple[SpeculationMode, ...] = (SpeculationMode.OFF,)
    """The modes a request may ask for."""
    default_speculation: SpeculationParams = SpeculationParams()
    draft_tokens_per_request: bool = True
    """Whether a request's own max_draft_tokens is honoured (exllamav2 drafts the same for every job)."""
    request_features: tuple[str, ...] = ("prompt_token_ids", "truncate_input_tokens")
    """The request options it serves, by field name (the service does these two for every engine; "n" and
    "output.prompt_logprobs" are an engine's own)."""
    attention_provider: str = ""
    """The attention it runs on: "llama.cpp"; for exllamav2 "flash-attn", "sdpa" (tokenspout's paged
    attention) or "none" (unpaged); "" where it means nothing (a test's fake engine)."""


ALL_REQUEST_FEATURES = ("prompt_token_ids", "n", "truncate_input_tokens", "output.prompt_logprobs")

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")

COMMON_SAMPLERS = (
    "temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "penalty_last_n", "seed", "logit_bias", "dry", "xtc", "mirostat",
)
"""SamplingParams fields every engine honours (GetModelInfo.samplers lists an engine's own)."""


class EngineUnavailable(Exception):
    """The engine's own libraries are missing or fail to load on this machine."""


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
    draft_tokens_total: int = 0
    """Proposed tokens checked (speculative decoding) ..."""
    accepted_draft_tokens_total: int = 0
    """... and the ones accepted: output that took no step of its own."""
    callers: tuple[CallerTally, ...] = ()
    """Per caller (fairness key): running, queued and preempted now, and totals (backend.fairness)."""

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_prompt_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0


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
    draft_tokens_total: int = 0
    accepted_draft_tokens_total: int = 0

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

    def snapshot(self, **live: int) -> EngineStats:
        """The totals with the live figures (running_sequences, cache_tokens_used, ...) as one EngineStats."""
        return EngineStats(**vars(self), **live)  # every field a number: a shallow copy is a copy


class Engine(Protocol):
    info: ModelInfo
    constraints: ConstraintCompiler
    """Compiles constraints against this engine's own vocabulary."""

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Thread-safe; reads only the vocabulary."""
        ...

    def token_piece(self, token_id: int) -> bytes:
        """The bytes a token decodes to (empty for control tokens)."""
        ...

    def budget_problem(self, prompt_tokens: int, max_new_tokens: int) -> str:
        """Why a request of this size can never run here, or "" (checked before submit)."""
        ...

    def render_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, special_tokens_in_content: bool = False
    ) -> list[int]:
        """Renders messages with the model's chat template and tokenizes them. Raises ValueError.

        Only the template's markup holds special tokens; special-token text in message content is
        plain text unless `special_tokens_in_content` (unsafe: callers could forge turns).
        """
        ...

    def submit(self, request: GenerationRequest, sink: EventSink) -> None:
        """Queues a validated request; its events go to `sink`. Thread-safe, never blocks."""
        ...

    def cancel(self, request_id: str) -> None:
        """Ends the request at the next step and frees its cache. Thread-safe, idempotent."""
        ...

    def pause(self, request_id: str) -> None:
        """Stops decoding the request (its cache is kept) until resume(). Thread-safe."""
        ...

    def resume(self, request_id: str) -> None:
        ...

    def on_death(self, callback: Callable[[BaseException], None]) -> None:
        """Registers `callback(exc)`, called on the engine thread if that thread dies."""
        ...

    @property
    def stats(self) -> EngineStats:
        ...

    def close(self) -> None:
        ...
