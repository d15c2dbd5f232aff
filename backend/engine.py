"""The engine protocol: what the service needs from any model backend.

Every engine is job-based and owns its model from exactly one worker thread:
`submit` and `cancel` are commands into that thread, and each request's events
come back through the `EventSink` it was submitted with. The service never
touches model objects itself. An engine runs in the service's process
(backend.local_engine.WorkerEngine), or in a process of its own that the service
reaches through backend.process (RemoteEngine, the same contract); the
`Vocabulary` part is then the service's own, loaded from the model's files.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from backend.common.cache_events import CacheWatching
from backend.common.stats import EngineStats
from backend.constraints import CompileReport, ConstraintSpec
from backend.events import EventSink
from backend.types import ChatContext, ChatMessage, GenerationRequest, ModelInfo


class EngineUnavailable(Exception):
    """The engine's own libraries are missing or fail to load on this machine."""


class EngineGone(Exception):
    """The engine's process exited while a request or a question waited on it."""


class Vocabulary(Protocol):
    """Prompts into tokens and tokens into bytes: the model's tokenizer and chat template."""

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Thread-safe; reads only the vocabulary."""
        ...

    def token_piece(self, token_id: int) -> bytes:
        """The bytes a token decodes to (empty for control tokens)."""
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


class Engine(Vocabulary, Protocol):
    info: ModelInfo

    @property
    def cache_events(self) -> CacheWatching | None:
        """Its KV-cache events (see backend.common.cache_events), when the cache_events setting is on."""
        ...

    async def compile(self, spec: ConstraintSpec) -> CompileReport:
        """Compiles a constraint against the engine's own vocabulary, where the engine keeps it for the requests that
        name it (a cache hit answers at once). Raises ConstraintError, or TooManyCompiles when the engine runs as
        many large compiles as it allows."""
        ...

    def submit(self, request: GenerationRequest, sink: EventSink) -> None:
        """Queues a validated request (its constraint compiled first through `compile`); its events go to `sink`.
        Thread-safe, never blocks."""
        ...

    def cancel(self, request_id: str) -> None:
        """Ends the request at the next step and frees its cache. Thread-safe, idempotent."""
        ...

    def release(self, request_id: str) -> None:
        """Its caller is done with the request (every submit is released once, after a cancel when the call ended
        early): its places at the door are free. Thread-safe, idempotent."""
        ...

    def pause(self, request_id: str) -> None:
        """Stops decoding the request (its cache is kept) until resume(). Thread-safe."""
        ...

    def resume(self, request_id: str) -> None:
        """Decodes a paused request again from where it stopped. Thread-safe."""
        ...

    def on_death(self, callback: Callable[[BaseException], None]) -> None:
        """Registers `callback(exc)`, called on the engine thread if that thread dies."""
        ...

    @property
    def stats(self) -> EngineStats:
        """Its latest figures (an engine in another process: as it last sent them)."""
        ...

    async def current_stats(self) -> EngineStats:
        """Its figures now."""
        ...

    def close(self) -> None:
        """Stops the engine in this process (its model freed), or the connection to one in its own process; called
        once, at shutdown."""
        ...
