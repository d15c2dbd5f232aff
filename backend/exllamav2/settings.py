"""Sampler settings for one exllamav2 job, every field set explicitly.

`ExLlamaV2Sampler.Settings()` defaults are not neutral (top_k 50, top_p 0.8,
temperature 0.8, repetition penalty 1.025), so nothing is left to them.
"""

from __future__ import annotations

from backend.types import SamplingParams


def settings_fields(params: SamplingParams) -> dict[str, object]:
    """Keyword values for a fresh `ExLlamaV2Sampler.Settings` (one per job: it carries state)."""
    greedy = params.greedy
    return {
        # exllamav2 treats temperature < 0.01 as greedy; say it outright, as top_k = 1.
        "temperature": 1.0 if greedy else params.temperature,
        "top_k": 1 if greedy else params.top_k,
        "top_p": 0.0 if greedy or params.top_p >= 1.0 else params.top_p,
        "min_p": 0.0 if greedy else params.min_p,
        "typical": 0.0 if greedy or params.typical_p >= 1.0 else params.typical_p,
        "top_a": 0.0,
        "tfs": 0.0,
        "skew": 0.0,
        "smoothing_factor": 0.0,
        "min_temp": 0.0,
        "max_temp": 0.0,
        "temp_exponent": 1.0,
        "temperature_last": False,
        "mirostat": False,
        "token_repetition_penalty": params.repetition_penalty if params.penalty_last_n > 0 else 1.0,
        "token_frequency_penalty": params.frequency_penalty if params.penalty_last_n > 0 else 0.0,
        "token_presence_penalty": params.presence_penalty if params.penalty_last_n > 0 else 0.0,
        "token_repetition_range": params.penalty_last_n if params.penalty_last_n > 0 else 0,
        "token_repetition_decay": 0,
        "dry_multiplier": 0.0,
        "xtc_probability": 0.0,
        "cfg_scale": None,
    }
