"""One sequence's constraint state, and applying a bitmask row to logits."""

from __future__ import annotations

import numpy as np

import llguidance

from backend.constraints.compiler import CompiledConstraint, llguidance_message


class ConstraintState:
    def __init__(self, compiled: CompiledConstraint) -> None:
        self.compiled = compiled
        self.matcher: llguidance.LLMatcher = compiled.new_matcher()
        self.mask_s = 0.0

    def consume(self, token: int) -> bool:
        """Feeds a sampled token; False if the grammar rejects it (the matcher is then in error)."""
        return self.matcher.consume_token(token)

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar allows no alternative to (not consumed yet)."""
        return self.matcher.compute_ff_tokens()[:limit]

    @property
    def complete(self) -> bool:
        """The output is a whole sentence of the grammar and nothing more can follow.

        llguidance also reports an errored matcher as stopped: that is never complete.
        """
        return self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def satisfied(self) -> bool:
        """The output so far is a whole sentence of the grammar."""
        return not self.matcher.is_error() and (self.matcher.is_accepting() or self.matcher.is_stopped())

    def failure(self) -> str:
        """The matcher's error, or "". A failed matcher's compiled constraint leaves the cache."""
        if not self.matcher.is_error():
            return ""
        self.compiled.mark_failed()
        return llguidance_message(self.matcher.get_error()) or "the constraint failed"


def apply_bitmask(logits: np.ndarray, row: np.ndarray) -> None:
    """Sets to -inf the logits of tokens whose bit in the int32 bitmask row is 0."""
    allowed = np.unpackbits(row.view(np.uint8), bitorder="little", count=logits.shape[0]).view(bool)
    np.copyto(logits, -np.inf, where=~allowed)
