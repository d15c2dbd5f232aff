"""Sampling helpers both exllama bindings use: the token bias a request asks for, and the ids of the tokens
that break a DRY repeat."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence, Set

from backend.types import GenerationRequest

BreakerIds = Callable[[tuple[str, ...]], Set[int]]
"""The ids of every token whose text holds one of the given DRY sequence breakers."""


def token_bias_values(request: GenerationRequest, eos_token_ids: tuple[int, ...]) -> dict[int, float]:
    """The bias a job's sampler adds, by token id (empty: none). With ignore_eos every
    EOS id is -inf, whatever the caller's bias, as the llama.cpp path masks them: leaving them out of
    the stop conditions alone would let one be sampled and streamed as text."""
    values = dict(request.sampling.logit_bias)
    if request.stopping.ignore_eos:
        values.update(dict.fromkeys(eos_token_ids, -math.inf))
    return values


def sequence_breaker_ids(pieces: Sequence[str], breakers: tuple[str, ...]) -> set[int]:
    """Ids of the tokens whose text holds a breaker, as llama.cpp's DRY treats them (":" breaks at '":' too)."""
    return {token for token, piece in enumerate(pieces) if any(breaker in piece for breaker in breakers)}
