"""What one exllama generation gives the shared core (backend.exllama.core): the two generations drive
their generators the same way (enqueue, iterate, cancel between iterates, results by job identifier),
and differ in how a generator and a job are built, where the page table is, and how a retired
generator lets go of what it holds. Each binding (backend.exllamav2.binding, backend.exllamav3.binding)
implements GeneratorBinding over its library, imported by its engine; BindingBase is what both build
alike (a generator over the loaded model, a job per sample with its filter and its sampler)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Protocol

from backend.constraints import CompiledConstraint
from backend.exllama.grammar_filter import GrammarFilterCore
from backend.exllama.job import Resume
from backend.exllama.job_fields import job_fields, job_input
from backend.exllama.preemption import continue_with
from backend.exllama.sampling import sequence_breaker_ids
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


class LoadedModel(Protocol):
    """What an engine loaded (each binding's Loaded), as a binding builds generators over it."""

    @property
    def model(self) -> Any: ...

    @property
    def cache(self) -> Any: ...

    @property
    def tokenizer(self) -> Any:
        """The library's tokenizer (its pieces name the DRY sequence breakers)."""
        ...

    @property
    def draft(self) -> dict[str, Any]:
        """{"draft_model": ..., "draft_cache": ...}, or empty."""
        ...


class BindingBase:
    """A generator over the loaded model, and a job per sample with its grammar filter and its own sampler;
    each binding says how its filter shell and sampler are made (`_filter`, `_sampling`)."""

    def __init__(self, generator_class: Any, job_class: Any, torch: Any, loaded: LoadedModel,
                 generator_fields: dict[str, object], eos_token_ids: tuple[int, ...], vocab_size: int) -> None:
        """`vocab_size`: the model config's (the grammar's masks, and exllamav2's token bias, are sized by it)."""
        self._generator_class, self._job_class, self._torch = generator_class, job_class, torch
        self._loaded, self._generator_fields = loaded, generator_fields
        self._eos_token_ids, self._vocab_size = eos_token_ids, vocab_size
        pieces = loaded.tokenizer.get_id_to_piece_list(True)
        # One scan of the vocabulary per set of DRY sequence breakers.
        self.breaker_ids = functools.lru_cache(maxsize=16)(
            lambda breakers: frozenset(sequence_breaker_ids(pieces, breakers))
        )

    def new_generator(self) -> Any:
        loaded = self._loaded
        return self._generator_class(model=loaded.model, cache=loaded.cache, tokenizer=loaded.tokenizer,
                                     **loaded.draft, **self._generator_fields)

    def new_job(
        self, request: GenerationRequest, resume: Resume | None, compiled: CompiledConstraint | None
    ) -> tuple[Any, GrammarFilterCore | None]:
        torch = self._torch
        constraint = None if compiled is None else GrammarFilterCore(compiled, self._eos_token_ids, self._vocab_size)
        output = resume.output if resume is not None else ()
        job = self._job_class(
            input_ids=torch.tensor([job_input(request, output)], dtype=torch.long),
            filters=None if constraint is None else [self._filter(constraint)],
            **self._sampling(request, resume),
            **job_fields(request, self._eos_token_ids, len(output)),
        )
        return (job if resume is None else continue_with(job, resume.previous)), constraint

    def _filter(self, core: GrammarFilterCore) -> Any:
        """The library's filter over `core`."""
        raise NotImplementedError

    def _sampling(self, request: GenerationRequest, resume: Resume | None) -> dict[str, object]:
        """The job's sampler keyword: a fresh one, or the old job's, which a continuation samples on with."""
        raise NotImplementedError
