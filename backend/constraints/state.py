"""One sequence's constraint state, and applying a bitmask row to logits."""

from __future__ import annotations

import llguidance
import numpy as np

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

    def split_forced(self, proposed: list[int], max_forced: int) -> tuple[list[int], list[bool]]:
        """Proposed tokens as plain decoding would produce them, each marked forced or sampled: after each
        sampled token the engine takes the grammar's forced tokens (up to `max_forced`) without sampling.

        The proposal is cut where the grammar rejects it or has stopped; where it enters a forced run, the
        run replaces it to its end, so the token after the last one is always sampled. The matcher is left
        as it was.
        """
        matcher = self.matcher
        proposed = proposed[: matcher.validate_tokens(proposed)]
        tokens: list[int] = []
        forced: list[bool] = []
        run: list[int] = []  # what the grammar forces next
        # A stopped matcher takes an end-of-generation token (an answer proposed again from the caller's past
        # or the chat's history ends with one) without counting it for rollback: rolling back len(tokens)
        # would then undo a real token. Nothing past that point is output anyway: the sequence ends at the
        # token that completes the grammar.
        while (run or len(tokens) < len(proposed)) and not matcher.is_stopped():
            is_forced = bool(run)
            token = run.pop(0) if is_forced else proposed[len(tokens)]
            if is_forced and len(tokens) < len(proposed) and proposed[len(tokens)] != token:
                proposed = proposed[: len(tokens)]  # departs from what is forced: it cannot be accepted
            matcher.consume_token(token)  # accepted: validated above, or forced
            tokens.append(token)
            forced.append(is_forced)
            if not is_forced:
                run = matcher.compute_ff_tokens()[:max_forced]
        matcher.rollback(len(tokens))
        return tokens, forced

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
