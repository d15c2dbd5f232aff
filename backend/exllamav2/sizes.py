"""The sizes the dynamic generator is built with, from the engine's settings, checked before it asserts.

exllamav2 0.3.2 checks these only with asserts, inside the generator's constructor and first
iterate(): the prefill chunk must be a multiple of its 256-token page and no more than the
model's max_input_len, which load_autosplit cuts to max_seq_len (model.py:532); and 8 tokens per
sequence must fit in one forward pass (max_batch_size * 8 <= max_input_len, dynamic.py:366-370).
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.config import EngineConfig
from backend.types import SpeculationMode, SpeculationParams

PAGE_SIZE = 256  # the dynamic generator's page: cache sizes and prefill chunks are multiples of it
MAX_CHUNK_TOKENS = 2048
"""Most prompt tokens of one job the generator prefills in one forward pass."""
_MAX_Q_SIZE = 8  # the generator's default max_q_size: tokens evaluated per sequence per decode step


@dataclass(frozen=True)
class GeneratorSizes:
    max_seq_len: int
    chunk: int
    """Prefill tokens per job per iterate(); also the model's max_input_len."""
    batch: int
    cache_tokens: int
    paged: bool
    """Continuous batching; without it exllamav2 runs one job at a time."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def generator_sizes(
    config: EngineConfig, paged_attention: bool, no_flash_attn: bool, chunk_tokens: int = MAX_CHUNK_TOKENS
) -> GeneratorSizes:
    """The sizes for these settings and this model. Raises ValueError, saying why, where 0.3.2 would assert.

    `paged_attention` is exllamav2's has_flash_attn_with_paged; `no_flash_attn` the model config's
    flag, which arch_compat_overrides() sets for some architectures: paged mode asserts without
    flash-attn (dynamic.py:354-357).
    """
    max_seq_len = config.context_length
    if max_seq_len < PAGE_SIZE:
        raise ValueError(
            f"context_length {max_seq_len} is under exllamav2's {PAGE_SIZE}-token page, the smallest prefill chunk"
        )
    paged = paged_attention and not no_flash_attn
    batch = config.max_batch_size if paged else 1
    # A multiple of the page, and no longer than the context rounded down to one.
    chunk = max(PAGE_SIZE, min(_round_up(chunk_tokens, PAGE_SIZE), max_seq_len // PAGE_SIZE * PAGE_SIZE))
    if batch * _MAX_Q_SIZE > chunk:
        raise ValueError(
            f"max_batch_size {batch} needs a prefill chunk of at least {batch * _MAX_Q_SIZE} tokens "
            f"({_MAX_Q_SIZE} per sequence per step), and this one is {chunk} (at most the context rounded "
            f"down to {PAGE_SIZE}): lower max_batch_size to {chunk // _MAX_Q_SIZE} or raise context_length"
        )
    cache_tokens = _round_up(config.exllamav2.cache_tokens or max_seq_len * batch, PAGE_SIZE)
    return GeneratorSizes(max_seq_len, chunk, batch, cache_tokens, paged)


def speculation(config: EngineConfig, has_draft_model: bool) -> SpeculationParams:
    """What the generator drafts, for every job alike: the draft model when there is one, else n-gram
    drafting only when the server asks for it (see SpeculationSetting.AUTO). It checks at most
    max_q_size tokens of a job in one forward pass, drafts included (dynamic.py:338-341)."""
    mode = SpeculationMode.DRAFT_MODEL if has_draft_model else config.speculation_mode(SpeculationMode.OFF)
    return SpeculationParams(mode, min(config.max_draft_tokens, _MAX_Q_SIZE))


def generator_fields(sizes: GeneratorSizes, drafts: SpeculationParams) -> dict[str, object]:
    """Keyword arguments for ExLlamaV2DynamicGenerator beside model, cache, tokenizer and a draft
    model's model and cache (it takes **kwargs and ignores the ones it does not know, so each is
    checked against 0.3.2's in the tests)."""
    fields: dict[str, object] = {
        "max_batch_size": sizes.batch,
        "max_seq_len": sizes.max_seq_len,
        "max_chunk_size": sizes.chunk,
        "paged": sizes.paged,
        "filter_background_eval": True,
    }
    if drafts.mode is not SpeculationMode.OFF:
        fields["num_draft_tokens"] = drafts.max_draft_tokens
        fields["use_ngram_draft"] = drafts.mode is SpeculationMode.NGRAM
    return fields
