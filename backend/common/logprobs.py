"""Log-probabilities of one step's logits, computed the same way for every engine: the
contract's log-softmax of the raw logits, after constraint masks and end-of-generation bans,
before temperature and truncation. (exllamav2 hands over its logits after it has applied logit
bias, penalties and DRY to them; llama.cpp's are from before.)"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from backend.events import GeneratedToken, TopLogprob


def with_logprobs(token: int, logits: np.ndarray, piece: Callable[[int], bytes], top_n: int) -> GeneratedToken:
    """`token` with its logprob and the `top_n` likeliest tokens of one step's `logits` (masked ones -inf)."""
    logprobs = logits - np.logaddexp.reduce(logits[np.isfinite(logits)])
    top: tuple[TopLogprob, ...] = ()
    if top_n:
        best = np.argpartition(-logprobs, top_n)[:top_n]
        best = best[np.argsort(-logprobs[best])]
        top = tuple(TopLogprob(int(t), piece(int(t)), float(logprobs[t])) for t in best)
    return GeneratedToken(token, piece(token), float(logprobs[token]), top)
