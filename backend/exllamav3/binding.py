"""exllamav3 1.6.5 for the shared exllama core (backend.exllama.binding): its Generator, a Job per sample
with a CustomSampler of its own (backend.exllamav3.sampler), its page table, and the filter shell over
our grammar core.

The contract's logprobs come from the logits exllamav3 returns with each token, which are the model's
raw logits (Job.receive_sample keeps them before its sampler adds penalties, bias or the grammar mask).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backend.config import ExLlamaV3Settings
from backend.exllama.binding import BindingBase, Page
from backend.exllama.grammar_filter import GrammarFilterCore
from backend.exllama.job import Resume
from backend.exllamav3.sampler import sampler_steps
from backend.exllamav3.sizes import PAGE_SIZE, GeneratorSizes, generator_fields
from backend.types import GenerationRequest, SpeculationParams


@dataclass(frozen=True)
class ExLlamaV3Classes:
    """What the engine loads and the binding builds with, from the imported libraries."""

    config: Any
    """exllamav3.Config"""
    model: Any
    """exllamav3.Model"""
    cache: Any
    """exllamav3.Cache"""
    fp16_layer: Any
    """exllamav3.CacheLayer_fp16"""
    quant_layer: Any
    """exllamav3.CacheLayer_quant"""
    tokenizer: Any
    """exllamav3.Tokenizer"""
    generator: Any
    """exllamav3.Generator"""
    job: Any
    """exllamav3.Job"""
    filter: type
    """exllamav3.Filter"""
    sampling: Any
    """exllamav3.generator.sampler: CustomSampler and the SS_* steps"""
    torch: Any


def import_classes() -> ExLlamaV3Classes:
    """Imports exllamav3, which compiles its CUDA extension on first import unless a prebuilt one imports."""
    import exllamav3
    import exllamav3.generator.sampler as sampling
    import torch

    return ExLlamaV3Classes(
        exllamav3.Config, exllamav3.Model, exllamav3.Cache, exllamav3.CacheLayer_fp16, exllamav3.CacheLayer_quant,
        exllamav3.Tokenizer, exllamav3.Generator, exllamav3.Job, exllamav3.Filter, sampling, torch,
    )


@dataclass(frozen=True)
class Loaded:
    """What the engine loaded: the model's config, the model, its cache and tokenizer, and a draft model's model
    and cache."""

    config: Any
    model: Any
    cache: Any
    tokenizer: Any
    draft: dict[str, Any]
    """{"draft_model": ..., "draft_cache": ...}, or empty."""


class ExLlamaV3Binding(BindingBase):
    suppressed_ids_stay = False  # 1.6.5 rewinds a banned string's ids with its text
    page_size = PAGE_SIZE

    def __init__(self, classes: ExLlamaV3Classes, loaded: Loaded, sizes: GeneratorSizes, drafts: SpeculationParams,
                 own: ExLlamaV3Settings, eos_token_ids: tuple[int, ...]) -> None:
        super().__init__(classes.generator, classes.job, classes.torch, loaded, generator_fields(sizes, drafts, own),
                         eos_token_ids, loaded.config.vocab_size)
        self._sampling_module, self._filter_class = classes.sampling, filter_class(classes.filter, classes.torch)

    def retire(self, generator: Any) -> None:
        """Generator.close(): its filter threads and pinned buffers go (one that replaces it on the same cache
        makes it refuse to iterate anyway)."""
        generator.close()

    def pages(self, generator: Any) -> Sequence[Page]:
        pages: Sequence[Page] = generator.pagetable.all_pages
        return pages

    def _filter(self, core: GrammarFilterCore) -> Any:
        return self._filter_class(self._loaded.tokenizer, core)

    def _sampling(self, request: GenerationRequest, resume: Resume | None) -> dict[str, object]:
        """A sampler of its own (steps may keep state), or the old job's."""
        if resume is not None:
            return {"sampler": resume.previous.sampler}
        sampling = self._sampling_module
        steps = sampler_steps(request, self._eos_token_ids, self.breaker_ids, self._loaded.tokenizer)
        return {"sampler": sampling.CustomSampler([getattr(sampling, name)(**arguments) for name, arguments in steps])}


def filter_class(base: type, torch: Any) -> type:
    """The exllamav3 Filter subclass over our grammar core (generator/filter/filter.py): its mask is the packed
    bitmask, computed in the background; a completed grammar ends the job ("end_filter"), and a banned-string
    rewind replays the filter's journal through reset() and accept_token()."""

    class LLGuidanceFilter(base):  # type: ignore[misc]  # exllamav3 is untyped
        def __init__(self, tokenizer: Any, core: GrammarFilterCore) -> None:
            super().__init__(tokenizer, trigger_token=None, prefix_str=None, eos_after_completed=True)
            self.core = core

        def reset(self) -> None:
            self.core.begin()

        def accept_token(self, token: int) -> None:
            self.core.feed(token)

        def get_next_logit_mask(self) -> Any:
            self.core.prepare_mask()
            return torch.from_numpy(self.core.bitmask)

        def is_completed(self) -> bool:
            return self.core.complete

        def use_background_worker(self) -> bool:
            return True

    return LLGuidanceFilter
