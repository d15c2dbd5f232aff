"""What exllamav3's generator, cache and loader are built with, from the engine's settings.

exllamav3 1.6.5 checks these only with asserts: the cache holds whole 256-token pages (cache/quant.py),
a prefill chunk is a multiple of the page (generator.py: shared_chunk_size), and a job reserves pages
for its prompt, max_new_tokens, one more token and its drafts' window up front (Job.prepare_for_queue),
shortening max_new_tokens to what fits rather than refusing it: so the service checks that budget
before a request is queued (ModelInfo.cache_reserve_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.config import EngineConfig, ExLlamaV3Settings
from backend.types import SpeculationMode, SpeculationParams

PAGE_SIZE = 256  # exllamav3's constants.PAGE_SIZE
MAX_CHUNK_TOKENS = 2048
"""Most prompt tokens of one job the generator prefills in one forward pass (its default)."""


@dataclass(frozen=True)
class GeneratorSizes:
    chunk: int
    """Prefill tokens per job per iterate(), a whole number of pages."""
    batch: int
    cache_tokens: int


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def generator_sizes(config: EngineConfig, chunk_tokens: int = MAX_CHUNK_TOKENS) -> GeneratorSizes:
    """The sizes for these settings; the chunk no longer than the context rounded up to a page."""
    chunk = min(_round_up(chunk_tokens, PAGE_SIZE), _round_up(config.context_length, PAGE_SIZE))
    cache_tokens = _round_up(config.exllamav3.cache_tokens or config.context_length * config.max_batch_size, PAGE_SIZE)
    return GeneratorSizes(chunk, config.max_batch_size, cache_tokens)


def speculation(config: EngineConfig, has_draft_model: bool) -> SpeculationParams:
    """What the generator drafts, for every job alike: the draft model when there is one, else n-gram
    drafting only when the server asks for it (see SpeculationSetting.AUTO)."""
    mode = SpeculationMode.DRAFT_MODEL if has_draft_model else config.speculation_mode(SpeculationMode.OFF)
    return SpeculationParams(mode, config.max_draft_tokens)


def reserve_tokens(drafts: SpeculationParams) -> int:
    """Tokens a job reserves beyond prompt + max_new_tokens: one, and the drafts' window where it drafts."""
    return 1 + (drafts.max_draft_tokens if drafts.mode is not SpeculationMode.OFF else 0)


def generator_fields(sizes: GeneratorSizes, drafts: SpeculationParams, own: ExLlamaV3Settings) -> dict[str, object]:
    """Keyword arguments for exllamav3's Generator beside model, cache, tokenizer and a draft model's model and
    cache (it takes **kwargs and ignores the ones it does not know: each is checked against 1.6.5's in the tests)."""
    fields: dict[str, object] = {"max_batch_size": sizes.batch, "max_chunk_size": sizes.chunk}
    if drafts.mode is not SpeculationMode.OFF:
        fields["num_draft_tokens"] = drafts.max_draft_tokens
    if drafts.mode is SpeculationMode.NGRAM:
        fields["ngram_match_min"] = own.ngram_match_min
    return fields


def cache_fields(sizes: GeneratorSizes, drafts: SpeculationParams, own: ExLlamaV3Settings) -> dict[str, object]:
    """Keyword arguments for a Cache beside its model and layer_type: quantized, bits for keys and values."""
    fields: dict[str, object] = {
        "max_num_tokens": sizes.cache_tokens,
        "max_batch_size": sizes.batch,  # recurrent models' state slots
        "max_history": drafts.max_draft_tokens if drafts.mode is not SpeculationMode.OFF else 0,
    }
    if own.cache_bits:
        fields |= {"k_bits": own.cache_bits, "v_bits": own.cache_v_bits or own.cache_bits}
    return fields


def load_fields(sizes: GeneratorSizes, own: ExLlamaV3Settings, tensor_parallel: bool) -> dict[str, object]:
    """Keyword arguments for Model.load: the split (by GB per GPU, or tensor parallel) and what it is sized for."""
    fields: dict[str, object] = {"max_chunk_size": sizes.chunk, "max_batch_size": sizes.batch, "progressbar": False}
    if own.gpu_split:
        fields["use_per_device"] = list(own.gpu_split)
    if tensor_parallel:
        fields |= {"tensor_p": True, "tp_backend": str(own.tensor_parallel_backend)}
    return fields
