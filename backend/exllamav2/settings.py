"""Sampler settings for one exllamav2 job, every field set explicitly.

`ExLlamaV2Sampler.Settings()` defaults are not neutral (top_k 50, top_p 0.8,
temperature 0.8, repetition penalty 1.025), so nothing is left to them.
"""

from __future__ import annotations

from typing import Callable

from backend.types import SamplingParams

SUPPORTED_SAMPLERS = (
    "temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "penalty_last_n", "seed", "logit_bias", "dry", "xtc", "mirostat", "top_a", "tfs", "skew",
    "smoothing_factor", "banned_strings", "token_healing",
)
_DRY_MAX_NGRAM = 20  # exllamav2's default longest repeat tracked


def settings_fields(params: SamplingParams, encode: Callable[[str], list[int]]) -> dict[str, object]:
    """Keyword values for a fresh `ExLlamaV2Sampler.Settings` (one per job: it carries DRY and mirostat state).

    `encode` tokenizes a DRY sequence breaker; its last token is the one that breaks a repeat.
    """
    greedy = params.greedy
    dry, xtc, mirostat = params.dry, params.xtc, params.mirostat
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
        "dry_multiplier": dry.multiplier,
        "dry_base": dry.base,
        "dry_allowed_length": dry.allowed_length,
        # exllamav2 asserts a search window longer than the longest repeat it tracks.
        "dry_range": dry.last_n,
        "dry_max_ngram": min(_DRY_MAX_NGRAM, dry.last_n - 1) if dry.last_n else _DRY_MAX_NGRAM,
        "dry_sequence_breakers": {encode(b)[-1] for b in dry.sequence_breakers if encode(b)} if params.dry_on else None,
        "xtc_probability": 0.0 if greedy else xtc.probability,
        "xtc_threshold": xtc.threshold,
        "cfg_scale": None,
    }


def padded_logit_width(vocab_size: int) -> int:
    """The length exllamav2 needs of a token_bias tensor: the logits are padded to a multiple of 32."""
    return -(-vocab_size // 32) * 32
