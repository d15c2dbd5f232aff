"""The sampler for one exllamav3 job, as the steps of a CustomSampler, every one asked for on purpose.

exllamav3 1.6.5 samples through a list of steps (generator/sampler/custom.py); its DefaultSampler
(min_p 0.08, temperature 0.8) is not neutral, so a job always gets its own list. The steps follow
llama.cpp's order, as the llama.cpp engine builds its chain: logit bias, penalties, DRY, then top-k,
top-p, min-p, XTC, temperature last, and the draw (greedy: the most likely token after the penalties).
CustomSampler adds the sorting and normalizing steps each one needs, and drops those that change
nothing (temperature 1, top_p 1, ...).

What it has no step for is not offered: typical_p and mirostat are refused for this engine
(GetModelInfo.samplers), as exllamav2's own samplers are. Differences to llama.cpp's, from the source:
its XTC scales the excluded tokens by the average of both outcomes rather than drawing once, and keeps
tokens holding a newline and special tokens out of it, as exllamav2 does; its DRY breakers are single
tokens (each whose text holds a breaker, as exllamav2's are here). Repetition penalties look back over
the prompt and the output, the last penalty_last_n tokens of them.
"""

from __future__ import annotations

from backend.exllama.sampling import BreakerIds, token_bias_values
from backend.types import COMMON_SAMPLERS, GenerationRequest

SUPPORTED_SAMPLERS = tuple(name for name in COMMON_SAMPLERS if name not in ("typical_p", "mirostat")) + (
    "banned_strings", "token_healing",
)

Step = tuple[str, dict[str, object]]
"""A sampling step's class name in exllamav3.generator.sampler, and its keyword arguments."""


def sampler_steps(
    request: GenerationRequest, eos_token_ids: tuple[int, ...], breaker_ids: BreakerIds, tokenizer: object
) -> list[Step]:
    """The steps of the request's sampler; `tokenizer` is exllamav3's, which XTC takes its protected tokens from."""
    params = request.sampling
    steps: list[Step] = []
    bias = token_bias_values(request, eos_token_ids)
    if bias:
        steps.append(("SS_LogitBias", {"logit_bias": bias}))
    if params.penalized:
        window = {"sustain_range": params.penalty_last_n, "decay_range": 0}
        steps.append(("SS_RepP", {"rep_p": params.repetition_penalty, **window}))
        steps.append(("SS_PresFreqP", {"pres_p": params.presence_penalty, "freq_p": params.frequency_penalty, **window}))
    if params.dry_on:
        dry = params.dry
        steps.append(("SS_DRY", {
            "dry_multiplier": dry.multiplier, "dry_base": dry.base, "dry_allowed_length": dry.allowed_length,
            "dry_range": dry.last_n,  # 0 is the whole context in both
            "dry_sequence_breakers": frozenset(breaker_ids(dry.sequence_breakers)),
        }))
    if params.greedy:
        return [*steps, ("SS_Argmax", {})]
    if params.top_k > 0:
        steps.append(("SS_TopK", {"top_k": params.top_k}))
    if params.top_p < 1.0:
        steps.append(("SS_TopP", {"top_p": params.top_p}))
    if params.min_p > 0.0:
        steps.append(("SS_MinP", {"min_p": params.min_p}))
    if params.xtc.probability > 0.0:
        xtc = params.xtc
        steps.append(("SS_XTC", {"probability": xtc.probability, "threshold": xtc.threshold, "tokenizer": tokenizer}))
    steps.append(("SS_Temperature", {"temperature": params.temperature}))
    steps.append(("SS_Sample", {}))
    return steps
