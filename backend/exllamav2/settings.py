"""Sampler settings for one exllamav2 job, every field set explicitly.

`ExLlamaV2Sampler.Settings()` defaults are not neutral (top_k 50, top_p 0.8,
temperature 0.8, repetition penalty 1.025), so nothing is left to them.
"""

from __future__ import annotations

from backend.exllama.job_fields import heals
from backend.exllama.sampling import BreakerIds
from backend.types import COMMON_SAMPLERS, GenerationRequest

EXLLAMAV2_ONLY_SAMPLERS = ("top_a", "tfs", "skew", "smoothing_factor", "banned_strings", "token_healing")
SUPPORTED_SAMPLERS = COMMON_SAMPLERS + EXLLAMAV2_ONLY_SAMPLERS
_DRY_MAX_NGRAM = 20  # exllamav2's default longest repeat tracked


def settings_fields(request: GenerationRequest, breaker_ids: BreakerIds) -> dict[str, object]:
    """Keyword values for a fresh `ExLlamaV2Sampler.Settings` (one per job: it carries DRY and mirostat state)."""
    params = request.sampling
    greedy = params.greedy
    xtc, mirostat = params.xtc, params.mirostat
    penalize = params.penalty_last_n > 0
    return {
        # exllamav2 treats temperature < 0.01 as greedy; say it outright, as top_k = 1.
        "temperature": 1.0 if greedy else params.temperature,
        "top_k": 1 if greedy else params.top_k,
        "top_p": 0.0 if greedy or params.top_p >= 1.0 else params.top_p,
        "min_p": 0.0 if greedy else params.min_p,
        "typical": 0.0 if greedy or params.typical_p >= 1.0 else params.typical_p,
        "top_a": 0.0 if greedy else params.top_a,
        "tfs": 0.0 if greedy or params.tfs >= 1.0 else params.tfs,
        "skew": 0.0 if greedy else params.skew,
        "smoothing_factor": 0.0 if greedy else params.smoothing_factor,
        "min_temp": 0.0,
        "max_temp": 0.0,
        "temp_exponent": 1.0,
        "temperature_last": False,
        "mirostat": mirostat is not None and not greedy,
        "mirostat_tau": mirostat.tau if mirostat else 1.5,
        "mirostat_eta": mirostat.eta if mirostat else 0.1,
        "token_repetition_penalty": params.repetition_penalty if penalize else 1.0,
        "token_frequency_penalty": params.frequency_penalty if penalize else 0.0,
        "token_presence_penalty": params.presence_penalty if penalize else 0.0,
        "token_repetition_range": params.penalty_last_n if penalize else 0,
        "token_repetition_decay": 0,
        **_dry_fields(request, breaker_ids),
        "xtc_probability": 0.0 if greedy else xtc.probability,
        "xtc_threshold": xtc.threshold,
        "cfg_scale": None,
    }


def _dry_fields(request: GenerationRequest, breaker_ids: BreakerIds) -> dict[str, object]:
    dry = request.sampling.dry
    if dry.multiplier == 0.0:
        return {"dry_multiplier": 0.0}
    # exllamav2 penalizes only repeats shorter than dry_max_ngram, so it must exceed allowed_length,
    # and it asserts a search window longer than dry_max_ngram.
    max_ngram = max(_DRY_MAX_NGRAM, dry.allowed_length + 1)
    window = max(dry.last_n, max_ngram + 1) if dry.last_n else 0
    first_sequence = len(request.prompt_token_ids) - heals(request)
    if window >= first_sequence + request.stopping.max_new_tokens or first_sequence < 2:
        # The window holds the whole job anyway; and 0.3.2 fails a windowed DRY on a 1-token sequence.
        window = 0
    return {
        "dry_multiplier": dry.multiplier,
        "dry_base": dry.base,
        "dry_allowed_length": dry.allowed_length,
        "dry_range": window,
        "dry_max_ngram": max_ngram,
        "dry_sequence_breakers": breaker_ids(dry.sequence_breakers),
    }


def padded_logit_width(vocab_size: int) -> int:
    """The length exllamav2 needs of a token_bias tensor: the logits are padded to a multiple of 32."""
    return -(-vocab_size // 32) * 32
