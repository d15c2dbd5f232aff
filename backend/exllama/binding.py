"""What one exllama generation gives the shared core (backend.exllama.core): the two generations drive
their generators the same way (enqueue, iterate, cancel between iterates, results by job identifier),
and differ in how a generator and a job are built, where the page table is, and how a retired
generator lets go of what it holds. Each binding (backend.exllamav2.binding, backend.exllamav3.binding)
implements this over its library, imported by its engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from backend.constraints import CompiledConstraint
from backend.exllama.grammar_filter import GrammarFilterCore
from backend.exllama.job import Resume
from backend.types import GenerationRequest


class Page(Protocol):
    """A cache page, as both generations' page tables hold it."""

    @property
    def ref_count(self) -> int:
        """Jobs holding it (0: free, its keys and values kept for a later prompt)."""
        ...

    @property
    def kv_position(self) -> int:
        """Tokens of it whose keys and values are valid."""
        ...


class GeneratorBinding(Protocol):
    page_size: int
    """Tokens per cache page: every job reserves whole pages for its prompt and output."""
    suppressed_ids_stay: bool
    """A banned-string rewind leaves the suppressed ids in the result's `token_ids` (backend.exllama.results)."""

    def new_generator(self) -> Any:
        """A generator over the engine's model and cache, with nothing queued (raises what the library raises)."""
        ...

    def retire(self, generator: Any) -> None:
        """Lets a generator that is being replaced, or closed with the engine, go of its threads and memory."""
        ...

    def new_job(
        self, request: GenerationRequest, resume: Resume | None, compiled: CompiledConstraint | None
    ) -> tuple[Any, GrammarFilterCore | None]:
        """The request's generator job (given a Resume, the one continuing a preempted job: never constrained),
        and the grammar filter core it carries when given its compiled constraint."""
        ...

    def pages(self, generator: Any) -> Sequence[Page]:
        """Every page of the generator's page table, free ones too."""
        ...
