"""The engine protocol: what the service needs from any model backend.

Every engine is job-based and owns its model from exactly one worker thread:
`submit` and `cancel` are commands into that thread, and each request's events
come back through the `EventSink` it was submitted with, called from the
worker thread. The service never touches model objects itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from backend.common.cache_events import CacheEventHub
from backend.common.stats import EngineStats
from backend.constraints import ConstraintCompiler
from backend.events import Event
from backend.types import ChatContext, ChatMessage, GenerationRequest, ModelInfo

EventSink = Callable[[Event], None]
"""Receives one request's events on the engine thread; must not block."""


class EventBatcher(Protocol):
    """Takes the events of many sinks at once. A sink with a `batcher` attribute (one of these) gets the
    events an engine step produced through `batcher.deliver` in one call, with the other sinks of that
    batcher, rather than one call each: a service relaying events to an event loop then wakes it once
    per step, not once per stream (see service.streams). Each sink's events keep their order."""

    def deliver(self, outputs: list[tuple[EventSink, Event]]) -> None: ...


class EngineUnavailable(Exception):
    """The engine's own libraries are missing or fail to load on this machine."""


class Engine(Protocol):
    info: ModelInfo
    constraints: ConstraintCompiler
    """Compiles constraints against this engine's own vocabulary."""
    cache_events: CacheEventHub | None
    """Its KV-cache events (see backend.common.cache_events), when the cache_events setting is on."""

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
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, special_tokens_in_content: bool = False,
        context: ChatContext = ChatContext(),
    ) -> list[int]:
        """Renders messages (and `context`: tools, enable_thinking) with the model's chat template and tokenizes
        them. Raises ValueError.

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
