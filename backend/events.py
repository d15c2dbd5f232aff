"""What an engine sends back for each sequence: its tokens as they come, how it finished, or why it failed.

Neutral like backend.types: an engine turns its own results into these, the service turns them into
stream messages. They are msgspec Structs, encoded as arrays: an engine process sends every stream's
events of a step to its front ends in one message (backend.process.protocol), and a Struct is made,
encoded and decoded several times faster than a dataclass (docs/engines.md, "The engine process").
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Protocol

import msgspec


class FinishReason(enum.Enum):
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
    STOP_TOKEN = "stop_token"
    MAX_TOKENS = "max_tokens"
    TIME_LIMIT = "time_limit"
    CONTEXT_LIMIT = "context_limit"
    CANCELLED = "cancelled"
    CONSTRAINT_COMPLETE = "constraint_complete"


class TopLogprob(msgspec.Struct, frozen=True, array_like=True, gc=False):
    token_id: int
    piece: bytes
    logprob: float


# The two types built for every token are not frozen (a frozen dataclass cost 1.1 us a TokenEvent, a slotted one
# 0.24, a Struct less): treat them as values.
class GeneratedToken(msgspec.Struct, array_like=True, gc=False):
    token_id: int
    piece: bytes
    logprob: float | None = None
    top_logprobs: tuple[TopLogprob, ...] = ()


class Usage(msgspec.Struct, frozen=True, array_like=True, gc=False):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    draft_tokens: int = 0
    """Proposed tokens checked (speculative decoding)."""
    accepted_draft_tokens: int = 0
    """Of those, the ones the model's own sampling agreed with: output that took no step of its own."""


class Timings(msgspec.Struct, frozen=True, array_like=True, gc=False):
    queue_s: float
    time_to_first_token_s: float
    prefill_s: float
    decode_s: float
    total_s: float
    constraint_compile_s: float = 0.0
    constraint_mask_s: float = 0.0


class Finish(msgspec.Struct, frozen=True, array_like=True, gc=False):
    reason: FinishReason
    usage: Usage
    timings: Timings
    seed: int
    stop_sequence: str | None = None
    stop_token_id: int | None = None
    constraint_satisfied: bool | None = None
    """None without a constraint; False when the output was cut short of the grammar's end."""


class TokenEvent(msgspec.Struct, tag="t", array_like=True, gc=False):
    """New output of one sequence from one engine step.

    `text` is complete UTF-8 that can no longer become part of a stop sequence;
    it may be empty while text is held back. `finish` is set on the last event.
    """

    tokens: tuple[GeneratedToken, ...]
    text: str
    generated_tokens: int
    finish: Finish | None = None
    step: int = 0
    """The engine step that produced it."""
    mask_s: float = 0.0
    """Constraint mask time spent on it."""
    accepted_drafts: int = 0
    """Of its tokens, the proposed ones that were accepted (speculative decoding)."""
    index: int = 0
    """The sample it belongs to (GenerationRequest.sample_index)."""
    prompt_tokens: tuple[GeneratedToken, ...] = ()
    """On a sample's first event, with prompt logprobs asked for: the prompt's tokens and their logprobs."""


class ErrorKind(enum.Enum):
    """Why one sequence failed: service.errors turns each kind into the caller's status."""

    ENGINE_FAILURE = "engine_failure"
    """The engine could not go on with it (a decode or sampling fault)."""
    CONSTRAINT_FAILED = "constraint_failed"
    """The caller's constraint could not be enforced any further (llguidance's limits): its input, not a fault."""
    PAUSED_TOO_LONG = "paused_too_long"
    """The caller read nothing for max_pause_s, so its sequence was ended to free its place."""
    SHED = "shed"
    """It was still waiting when the engine was over capacity, and the least entitled waiting request."""
    QUEUE_TIMEOUT = "queue_timeout"
    """It did not start within its queue_timeout_ms."""
    OVERLOADED = "overloaded"
    """Refused at the engine's door: the server is full (backend.common.door)."""
    CALLER_OVER_LIMIT = "caller_over_limit"
    """Refused at the engine's door: its caller holds as many requests as one caller may."""
    ENGINE_DOWN = "engine_down"
    """The engine's process exited (it is being started again)."""


class ErrorEvent(msgspec.Struct, frozen=True, tag="e", array_like=True, gc=False):
    """This one sequence failed; other sequences carry on."""

    message: str
    kind: ErrorKind = ErrorKind.ENGINE_FAILURE


Event = TokenEvent | ErrorEvent

EventSink = Callable[[Event], None]
"""Receives one request's events on the engine thread; must not block. A sink may carry a `batcher`
(an EventBatcher) that takes a step's events for all its sinks in one call (see backend.worker.deliver_all)."""


class EventBatcher(Protocol):
    """Takes the events of many sinks at once. A sink with a `batcher` attribute (one of these) gets the
    events an engine step produced through `batcher.deliver` in one call, with the other sinks of that
    batcher, rather than one call each: a service relaying events to an event loop then wakes it once
    per step, not once per stream (see service.streams). Each sink's events keep their order."""

    def deliver(self, outputs: list[tuple[EventSink, Event]]) -> None: ...
