"""exllamav2 0.3.2 for the shared exllama core (backend.exllama.binding): its dynamic generator, a job
per sample with fresh sampler settings, its page table, and the filter shell over our grammar core.

The contract's logprobs come from the logits exllamav2 returns, which are those it sampled from: after
repetition penalties, logit bias, DRY and the grammar mask (sampler.py:408-444, 517; not the raw
logits), before temperature and truncation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backend.exllama.binding import BindingBase, Page
from backend.exllama.grammar_filter import GrammarFilterCore
from backend.exllama.job import Resume
from backend.exllama.sampling import token_bias_values
from backend.exllamav2.settings import padded_logit_width, settings_fields
from backend.exllamav2.sizes import PAGE_SIZE, GeneratorSizes, generator_fields
from backend.types import GenerationRequest, SpeculationParams


@dataclass(frozen=True)
class ExLlamaV2Classes:
    """What the binding builds with, from the imported libraries."""

    generator: Any
    """exllamav2.generator.ExLlamaV2DynamicGenerator"""
    job: Any
    """exllamav2.generator.ExLlamaV2DynamicJob"""
    settings: Any
    """exllamav2.generator.ExLlamaV2Sampler.Settings"""
    filter: type
    """exllamav2.generator.filters.ExLlamaV2Filter"""
    torch: Any


def import_classes() -> ExLlamaV2Classes:
    """The classes, once exllamav2 has been imported (backend.exllamav2.attention_provider)."""
    import torch
    from exllamav2.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler
    from exllamav2.generator.filters import ExLlamaV2Filter

    return ExLlamaV2Classes(ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler.Settings, ExLlamaV2Filter,
                            torch)


@dataclass(frozen=True)
class Loaded:
    """What the engine loaded: the model, its cache and tokenizer, and a draft model's model and cache."""

    model: Any
    cache: Any
    tokenizer: Any
    draft: dict[str, Any]
    """{"draft_model": ..., "draft_cache": ...}, or empty."""


class ExLlamaV2Binding(BindingBase):
    suppressed_ids_stay = True  # 0.3.2's rewind_checkpoint rewinds the text, not the ids (a typo)

    def __init__(self, classes: ExLlamaV2Classes, loaded: Loaded, sizes: GeneratorSizes, drafts: SpeculationParams,
                 eos_token_ids: tuple[int, ...], vocab_size: int) -> None:
        """`vocab_size`: the model config's (token_bias tensors are padded from it)."""
        super().__init__(classes.generator, classes.job, classes.torch, loaded, generator_fields(sizes, drafts),
                         eos_token_ids, vocab_size)
        self._settings_class, self._filter_class = classes.settings, filter_class(classes.filter)
        self.page_size = PAGE_SIZE if sizes.paged else sizes.cache_tokens  # unpaged, one page is the whole cache

    def retire(self, generator: Any) -> None:
        """0.3.2's generator starts two 16-worker pools (sampling, and filters) and never stops them: each
        generator replaced without this would leak their threads."""
        generator.sampling_pool.shutdown(wait=False, cancel_futures=True)
        generator.filter_pool.shutdown(wait=False, cancel_futures=True)

    def pages(self, generator: Any) -> Sequence[Page]:
        pages: Sequence[Page] = generator.all_pages
        return pages

    def _filter(self, core: GrammarFilterCore) -> Any:
        return self._filter_class(self._loaded.model, self._loaded.tokenizer, core)

    def _sampling(self, request: GenerationRequest, resume: Resume | None) -> dict[str, object]:
        """Fresh sampler settings (they carry DRY's and mirostat's state), or the old job's."""
        if resume is not None:
            return {"gen_settings": resume.previous.gen_settings}
        settings = self._settings_class(**settings_fields(request, self.breaker_ids))
        bias = token_bias_values(request, self._eos_token_ids)
        if bias:
            torch = self._torch
            settings.token_bias = torch.zeros(padded_logit_width(self._vocab_size), dtype=torch.float32)
            for token, value in bias.items():
                settings.token_bias[token] = value
        return {"gen_settings": settings}


def filter_class(base: type) -> type:
    """The ExLlamaV2Filter subclass over our grammar core (base.py:14-124): the mask path, in the background."""

    class LLGuidanceFilter(base):  # type: ignore[misc]  # exllamav2 is untyped
        def __init__(self, model: Any, tokenizer: Any, core: GrammarFilterCore) -> None:
            super().__init__(model, tokenizer)
            self.core = core

        def begin(self, prefix_str: str = "") -> None:
            self.core.begin()

        def feed(self, token: Any) -> None:
            self.core.feed(int(token.view(-1)[0]))

        def use_background_worker(self) -> bool:
            return True

        def can_mask_logits(self) -> bool:
            return True

        def prepare_logit_mask(self) -> bool:
            return self.core.prepare_mask()

        def mask_logits(self, logits: Any) -> Any:
            self.core.mask_logits(logits.numpy())
            return logits

        def next(self) -> tuple[list[int], list[int]]:
            return self.core.allowed_tokens()

    return LLGuidanceFilter
