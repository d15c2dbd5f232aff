"""Several tokens a step: which tokens to propose, and how many are worth checking.

A decoding sequence feeds its last sampled token and the tokens its constraint
forced (output already, never checked), then up to k proposed tokens; the
decode gives logits after every row, and the core samples each row in turn
with the sequence's own chain, accepting a proposal while it equals the token
sampled before it. A proposal is deterministic, so the output's distribution
is exactly that of plain decoding (and llama.cpp computes a row of a small
group bit for bit as it computes one alone: docs/benchmarks.md).

Proposals come from n-gram lookup in the sequence's own prompt and output: the
longest recent n-gram (MATCH_LENGTHS) that occurred before is continued by what
followed it then, as llama.cpp's ngram modes do; failing that, from what followed
its last 4-gram in its caller's finished sequences (PastNgrams). A constrained
sequence's proposal is cut where its grammar would reject it.

Whether checking pays depends on the machine and the batch: every extra row
costs compute, and llama.cpp splits a batch into equal pieces per sequence, so
sequences feeding different row counts cost extra forward passes. DecodeCosts
fits each decode's time as `passes * pass_s + rows * row_s` from the decodes
so far, and the planner picks, each step, the draft length that gives the most
tokens per second by that estimate and each sequence's acceptance so far
(none at all when no length beats plain decoding).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field

from backend.constraints import ConstraintState

MATCH_LENGTHS = (4, 3, 2)
"""n-gram lengths matched, longest first."""
DRAFT_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16)
"""Common draft lengths the planner weighs each step (up to the request's max_draft_tokens)."""
_ACCEPTANCE_PRIOR = (2.0, 1.0)
"""Pseudo-counts of accepted and rejected proposals: an untried sequence is expected to accept 2 in 3,
enough for the planner to try it where checking is cheap."""
_ACCEPTANCE_MEMORY = 0.9
"""What a check taught weighs this much less after each proposed token checked later ..."""
_IDLE_MEMORY = 0.98
"""... and after each step without a check, so a sequence that stopped paying is tried again."""
_MIN_GAIN = 1.02
"""Checking must promise this much more than plain decoding: the estimates are noisy."""
_COST_MEMORY = 0.98
_COST_PRIOR_WEIGHT = 1.0
"""The cost model's prior (a pass and a row cost the same) weighs as much as this many decodes."""


class NgramIndex:
    """Where each n-gram of a sequence's tokens last ended, kept up to date as tokens are appended."""

    def __init__(self) -> None:
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in _ends

    def propose(self, tokens: Tokens[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest earlier occurrence of the tokens' last n-gram."""
        self._index(tokens, len(tokens) - 1)  # not the suffix itself: it would find only itself
        for n in MATCH_LENGTHS:
            if len(tokens) > n:
                end = self._ends.get(tuple(tokens[-n:]))
                if end is not None:
                    return list(tokens[end : end + limit])
        return []

    def _index(self, tokens: Tokens[int], upto: int) -> None:
        for end in range(self._indexed + 1, upto + 1):
            for n in MATCH_LENGTHS:
                if end >= n:
                    self._ends[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, upto)


@dataclass
class DraftState:
    """One sequence's speculation: its n-gram index and how well its proposals have fared."""

    max_draft_tokens: int
    index: NgramIndex = field(default_factory=NgramIndex)
    accepted_weight: float = 0.0
    rejected_weight: float = 0.0

    @property
    def acceptance(self) -> float:
        """The chance that a proposal is accepted when every one before it was (a geometric model)."""
        accepted, rejected = _ACCEPTANCE_PRIOR
        return (self.accepted_weight + accepted) / (self.accepted_weight + self.rejected_weight + accepted + rejected)

    def expected_accepted(self, k: int) -> float:
        a = self.acceptance
        return sum(a**i for i in range(1, k + 1))

    def checked(self, proposed: int, accepted: int) -> None:
        """`accepted` of `proposed` tokens were; 0 proposed is a step without a check."""
        memory = _ACCEPTANCE_MEMORY**proposed if proposed else _IDLE_MEMORY
        self.accepted_weight = self.accepted_weight * memory + accepted
        self.rejected_weight = self.rejected_weight * memory + (accepted < proposed)


class PastNgrams:
    """What followed each 4-gram in the finished sequences of each caller: proposals for text that a
    caller's requests repeat (the same document quoted, a question asked again), which a sequence's own
    tokens cannot offer before it has seen that text once.

    Kept per caller: a proposal changes no token, but how fast tokens come would tell one caller what
    another's requests said. Bounded: least recently learned n-grams go first.
    """

    MATCH = MATCH_LENGTHS[0]
    CONTINUATION = DRAFT_LENGTHS[-1]
    LEARNED = 4096
    """Most output tokens learned from one finished sequence (its last ones)."""

    def __init__(self, capacity: int = 50_000) -> None:
        self.capacity = capacity
        self._continuations: collections.OrderedDict[tuple, tuple[int, ...]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._continuations)

    def learn(self, caller: str, tokens: Tokens[int], output_from: int = 0) -> None:
        """Learns what followed each 4-gram among the tokens from `output_from` on (a sequence's output:
        its prompt is in a later request's own tokens when that request repeats it, so it is not stored)."""
        n, table = self.MATCH, self._continuations
        for end in range(max(n, output_from, len(tokens) - self.LEARNED), len(tokens)):
            key = (caller, *tokens[end - n : end])
            table[key] = tuple(tokens[end : end + self.CONTINUATION])
            table.move_to_end(key)
        while len(table) > self.capacity:
            table.popitem(last=False)

    def propose(self, caller: str, tokens: Tokens[int], limit: int) -> list[int]:
        if len(tokens) < self.MATCH:
            return []
        return list(self._continuations.get((caller, *tokens[-self.MATCH :]), ())[:limit])


def proposal(
    tokens: Tokens[int], draft: DraftState, constraint: ConstraintState | None, limit: int,
    past: tuple[PastNgrams, str] | None = None,
) -> list[int]:
    """What a sequence proposes to check this step: n-gram continuation from its own tokens, else from its
    caller's past sequences (`past`: the pool and the caller), cut to what its grammar allows."""
    limit = min(limit, draft.max_draft_tokens)
    proposed = draft.index.propose(tokens, limit)
    if not proposed and past is not None:
        proposed = past[0].propose(past[1], tokens, limit)
    if proposed and constraint is not None:
        proposed = proposed[: constraint.matcher.validate_tokens(proposed)]
    return proposed


class DecodeCosts:
    """A decode's time as `passes * pass_s + rows * row_s`, fitted by least squares to the decodes so
    far (recent ones weigh more) and to a prior, from the first decode, that a pass and a row cost the same.
    Every decode step records one: plain arithmetic, no arrays (numpy's overhead was a third of a
    millisecond a step)."""

    def __init__(self) -> None:
        self._pp = self._pr = self._rr = 0.0  # decayed sums of passes^2, passes * rows, rows^2
        self._pt = self._rt = 0.0  # ... and of passes * seconds, rows * seconds
        self._prior: float | None = None
        self.pass_s = self.row_s = 0.0

    @property
    def known(self) -> bool:
        return self._prior is not None

    def record(self, passes: int, rows: int, seconds: float) -> None:
        if self._prior is None:
            self._prior = seconds / (passes + rows)
        m, w, prior = _COST_MEMORY, _COST_PRIOR_WEIGHT, self._prior
        self._pp = m * self._pp + passes * passes
        self._pr = m * self._pr + passes * rows
        self._rr = m * self._rr + rows * rows
        self._pt = m * self._pt + passes * seconds
        self._rt = m * self._rt + rows * seconds
        # Solve [[pp + w, pr], [pr, rr + w]] (pass_s, row_s) = (pt + w prior, rt + w prior).
        a, b, d = self._pp + w, self._pr, self._rr + w
        u, v = self._pt + w * prior, self._rt + w * prior
        determinant = a * d - b * b
        self.pass_s = max((u * d - b * v) / determinant, 0.0)
        self.row_s = max((a * v - b * u) / determinant, 0.0)

    def estimate(self, passes: int, rows: int) -> float:
        return passes * self.pass_s + rows * self.row_s


def passes_for(rows_per_sequence: Tokens[int]) -> int:
    """Forward passes llama.cpp makes for a batch of these per-sequence row counts: it splits a batch
    into pieces taking the same number of rows from every sequence still in it."""
    return len(set(rows_per_sequence))


@dataclass(frozen=True)
class Candidate:
    known_rows: int
    """Rows the sequence feeds anyway: its last token and any forced ones."""
    proposed: list[int]
    draft: DraftState | None


def plan_drafts(candidates: list[Candidate], costs: DecodeCosts) -> list[int]:
    """How many proposed tokens each candidate checks this step: the common draft length (each
    candidate capped at what it has) that gives the most expected tokens per second, or none."""
    known = [c.known_rows for c in candidates]
    if not costs.known or not any(c.proposed for c in candidates):
        return [0] * len(candidates)
    plain_time = costs.estimate(passes_for(known), sum(known))
    best, best_rate = [0] * len(candidates), _MIN_GAIN * len(candidates) / plain_time
    longest = max(len(c.proposed) for c in candidates)
    for k in DRAFT_LENGTHS:
        if k > longest:
            break
        checked = [min(k, len(c.proposed)) for c in candidates]
        rows = [r + n for r, n in zip(known, checked)]
        tokens = len(candidates) + sum(c.draft.expected_accepted(n) for c, n in zip(candidates, checked) if n)
        rate = tokens / costs.estimate(passes_for(rows), sum(rows))
        if rate > best_rate:
            best, best_rate = checked, rate
    return best
