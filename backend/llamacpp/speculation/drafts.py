"""A sequence's draft: what it proposes each step, and how well the proposals of each source fare.

How likely a proposal is to be accepted depends on where it came from: a long match in a passage
being copied is right nearly every time, a two-token match in free prose seldom. Each sequence keeps
its acceptance per source (DraftState), starting from what the engine has seen of that source in
every sequence lately (AcceptanceRates). A constrained sequence's proposal is cut where its grammar
would reject it, and its tokens the grammar forces are marked: plain decoding takes them without
sampling, so the check does too (no logits on the row before one, and no guess: a key after a value
comes with the value).
"""

from __future__ import annotations

from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field

from backend.constraints import ConstraintState
from backend.llamacpp.speculation.proposers import MATCH_LENGTHS, CopyCursor, NgramIndex, PastNgrams

SOURCES = ("prompt4+", "prompt4", "prompt3", "prompt2", "output4+", "output4", "output3", "output2", "follow", "past")
"""Where a proposal comes from: a match in the sequence's prompt or its output so far, by the length of
the n-gram matched (+: a 4-gram in a long agreement, see _DEEP); where a copy left off (CopyCursor); or
its caller's finished sequences. They fare very differently (docs/benchmarks.md: a 4-gram in the prompt
is accepted most of the time, a 2-gram in the output seldom)."""
_EXPLORED = 8.0
"""Until a sequence and the engine together have seen this many proposals of a source, a draft of it is
at most _PROBE_TOKENS long: a guess costs a few rows, not sixteen."""
_PROBE_TOKENS = 4
_FIRST_GUESS = 0.6
"""The acceptance assumed of a source the engine has not seen checked yet ..."""
_CURIOSITY = 0.7
"""... and the planner's benefit of the doubt: this share of the estimate's distance from certainty,
shrinking as 1/sqrt(1 + proposals seen). A source never tried would never be learned, so it is worth a
probe (0.6 is planned as 0.88); a share, not a sum, so that a source known to be right 95 times in 100
is not planned as certain, which drafts 16 tokens where 8 pay more (measured: docs/benchmarks.md)."""
_PRIOR_WEIGHT = 6.0
"""A sequence starts from the engine's rate for a source as if it had seen this many of its proposals (a
streak of accepted ones in a copy is no promise that the next will be: the model departs every few dozen
tokens)."""
_ACCEPTANCE_MEMORY = 0.9
"""What a check taught a sequence weighs this much less after each proposed token checked later ..."""
_IDLE_MEMORY = 0.98
"""... and after each step without a check, so a sequence that stopped paying is tried again."""
_ENGINE_MEMORY = 0.995
"""The engine's rates remember the last few hundred proposed tokens checked."""
_DEEP = 8
"""A 4-gram match where the sequence's last _DEEP tokens or more repeat the text the match is in is a source
of its own ("prompt4+", "output4+"): measured (docs/benchmarks.md), an edit's or a quote's copy departs
less often once it has run a while (0.81 against 0.97 per token in edits); apart, the planner learns each."""


class AcceptanceRates:
    """How often the proposals of each source were accepted lately, over every sequence: where a new
    sequence's own estimates start. An acceptance is the chance that a proposed token is accepted when
    every one before it in its draft was (a geometric model: a check counts its accepted tokens, and one
    rejection if it stopped short)."""

    def __init__(self) -> None:
        self._weights = {source: [0.0, 0.0] for source in SOURCES}  # accepted, rejected

    def rate(self, source: str) -> float:
        accepted, rejected = self._weights[source]
        return (accepted + _FIRST_GUESS) / (accepted + rejected + 1.0)

    def seen(self, source: str) -> float:
        """How many proposals of the source have taught it (decayed)."""
        return sum(self._weights[source])

    def checked(self, source: str, proposed: int, accepted: int) -> None:
        _learn(self._weights[source], _ENGINE_MEMORY**proposed, proposed, accepted)


@dataclass
class DraftState:
    """One sequence's speculation: its n-gram index and how well its proposals of each source have fared."""

    max_draft_tokens: int
    index: NgramIndex = field(default_factory=NgramIndex)
    cursor: CopyCursor = field(default_factory=CopyCursor)
    weights: dict[str, list[float]] = field(default_factory=lambda: {source: [0.0, 0.0] for source in SOURCES})

    def acceptance(self, source: str, engine: AcceptanceRates) -> float:
        """The acceptance to plan with: what this sequence and the engine have seen, and the benefit of the
        doubt while they have seen little."""
        accepted, rejected = self.weights[source]
        estimate = (accepted + _PRIOR_WEIGHT * engine.rate(source)) / (accepted + rejected + _PRIOR_WEIGHT)
        doubt: float = (1 + self.seen(source, engine)) ** 0.5
        return estimate + (1 - estimate) * _CURIOSITY / doubt

    def seen(self, source: str, engine: AcceptanceRates) -> float:
        return sum(self.weights[source]) + engine.seen(source)

    def checked(self, source: str, proposed: int, accepted: int) -> None:
        """`accepted` of `proposed` tokens from `source` were."""
        _learn(self.weights[source], _ACCEPTANCE_MEMORY**proposed, proposed, accepted)

    def idle(self) -> None:
        """A step without a check: what the checks taught fades a little."""
        for weights in self.weights.values():
            _learn(weights, _IDLE_MEMORY, 0, 0)


def _learn(weights: list[float], memory: float, proposed: int, accepted: int) -> None:
    weights[0] = weights[0] * memory + accepted
    weights[1] = weights[1] * memory + (accepted < proposed)


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    source: str = ""
    """One of SOURCES ("" when there are no tokens)."""
    forced: list[bool] = field(default_factory=list)
    """Per token, whether the grammar forces it once the tokens before it are in (constrained sequences;
    empty: none is): certain then, so it is taken without sampling (and the row before it needs no logits)."""


def proposal(
    tokens: Tokens[int], prompt_length: int, draft: DraftState, constraint: ConstraintState | None, limit: int,
    past: tuple[PastNgrams, str] | None = None, engine: AcceptanceRates | None = None, max_forced: int = 16,
) -> Proposal:
    """What a sequence proposes to check this step: the continuation of a 4-gram match in its own tokens;
    else of the copy it was following; else of a shorter match; else from its caller's past sequences
    (`past`: the pool and the caller). Short while its source is little known (`engine`: what the engine
    has seen); for a constrained sequence, cut to what its grammar allows, the forced runs it enters
    completed (up to `max_forced` tokens, as the engine takes them) but never past `limit`."""
    limit = min(limit, draft.max_draft_tokens)
    draft.cursor.follow(tokens)
    proposed, matched, end = draft.index.propose(tokens, limit)
    source = f"{'prompt' if end < prompt_length else 'output'}{matched}"  # where the continuation starts
    if matched == MATCH_LENGTHS[0]:
        draft.cursor.sync(end)
        if _agreement(tokens, end) >= _DEEP:
            source += "+"
    elif following := draft.cursor.propose(tokens, limit):
        proposed, source = following, "follow"
    if not proposed and past is not None:
        proposed, source = past[0].propose(past[1], tokens, limit), "past"
    if proposed and engine is not None and draft.seen(source, engine) < _EXPLORED:
        proposed = proposed[:_PROBE_TOKENS]
    if not proposed:
        return Proposal([])
    if constraint is None:
        return Proposal(proposed, source)
    proposed, forced = constraint.split_forced(proposed, max_forced)
    cut = min(limit, len(proposed))
    while cut < len(proposed) and forced[cut]:  # a check never ends inside a forced run (see Candidate.cut)
        cut -= 1
    return Proposal(proposed[:cut], source, forced[:cut]) if cut else Proposal([])


def _agreement(tokens: Tokens[int], end: int) -> int:
    """How many of the tokens before `end` the sequence's last tokens repeat (up to _DEEP)."""
    n = 0
    while n < _DEEP and n < end and tokens[end - 1 - n] == tokens[-1 - n]:
        n += 1
    return n
