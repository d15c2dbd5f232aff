"""How many proposed tokens each decoding sequence checks this step: the common draft length that
gives the most expected tokens per second, by what each sequence's proposals are expected to get
accepted and what the decode's shape costs (costs.DecodeCosts), or none when no length beats plain
decoding."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.llamacpp.speculation.costs import DecodeCosts, passes_for

DRAFT_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16)
"""Common draft lengths the planner weighs each step (up to the request's max_draft_tokens)."""
_MIN_GAIN = 1.02
"""Checking must promise this much more than plain decoding: the estimates are noisy."""


@dataclass(frozen=True)
class Candidate:
    known_rows: int
    """Rows the sequence feeds anyway: its last token and any forced ones."""
    proposed: list[int]
    acceptance: float = 0.0
    """The chance that each proposed token that is sampled is accepted when the ones before it were."""
    forced: list[bool] = field(default_factory=list)
    """Per proposed token: forced by the grammar (see Proposal.forced); empty means none is."""

    def cut(self, k: int) -> int:
        """How many proposed tokens a draft of `k` checks: `k` or all, and on to the end of a forced run it
        stops in, so the token after the check is one plain decoding samples too (it would force it)."""
        n = min(k, len(self.proposed))
        while n < len(self.forced) and self.forced[n]:
            n += 1
        return n

    def sampled(self, n: int) -> int:
        """How many of the first `n` proposed tokens are sampled: rows with logits, and guesses."""
        return n - sum(self.forced[:n])

    def expected_accepted(self, n: int) -> float:
        """How many of the first `n` proposed tokens are expected to be accepted (a forced one is, when
        every one before it was)."""
        expected, chance = 0.0, 1.0
        for i in range(n):
            if i >= len(self.forced) or not self.forced[i]:
                chance *= self.acceptance
            expected += chance
        return expected


def plan_drafts(candidates: list[Candidate], costs: DecodeCosts) -> list[int]:
    """How many proposed tokens each candidate checks this step: the common draft length (each
    candidate capped at what it has) that gives the most expected tokens per second, or none."""
    if not costs.known or not any(c.proposed for c in candidates):
        return [0] * len(candidates)
    known = [c.known_rows for c in candidates]
    plain_time = costs.estimate(passes_for(known), sum(known), len(candidates))
    best, best_rate = [0] * len(candidates), _MIN_GAIN * len(candidates) / plain_time
    longest = max(len(c.proposed) for c in candidates)
    for k in DRAFT_LENGTHS:
        if k > longest:
            break
        checked = [c.cut(k) for c in candidates]
        rows = [r + n for r, n in zip(known, checked)]
        tokens = len(candidates) + sum(c.expected_accepted(n) for c, n in zip(candidates, checked))
        logit_rows = len(candidates) + sum(c.sampled(n) for c, n in zip(candidates, checked))
        rate = tokens / costs.estimate(passes_for(rows), sum(rows), logit_rows)
        if rate > best_rate:
            best, best_rate = checked, rate
    return best
