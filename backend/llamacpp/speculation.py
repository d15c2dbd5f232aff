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
sequence's proposal is cut where its grammar would reject it, and its tokens the
grammar forces are marked: plain decoding takes them without sampling, so the
check does too (no logits on the row before one, and no guess: a key after a
value comes with the value).

How likely a proposal is to be accepted depends on where it came from: a long
match in a passage being copied is right nearly every time, a two-token match
in free prose seldom. Each sequence keeps its acceptance per source, starting
from what the engine has seen of that source in every sequence lately
(AcceptanceRates). What checking costs depends on the machine and the batch
(backend.llamacpp.costs). Each step the planner picks the draft length that
gives the most tokens per second by those estimates, and none at all when no
length beats plain decoding.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field

from backend.constraints import ConstraintState
from backend.llamacpp.costs import DecodeCosts, passes_for

MATCH_LENGTHS = (4, 3, 2)
"""n-gram lengths matched, longest first."""
DRAFT_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16)
"""Common draft lengths the planner weighs each step (up to the request's max_draft_tokens)."""
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
_MIN_GAIN = 1.02
"""Checking must promise this much more than plain decoding: the estimates are noisy."""


class NgramIndex:
    """Where each n-gram of a sequence's tokens last ended, kept up to date as tokens are appended."""

    def __init__(self) -> None:
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in _ends

    def propose(self, tokens: Tokens[int], limit: int) -> tuple[list[int], int, int]:
        """Up to `limit` tokens that followed the longest earlier occurrence of the tokens' last n-gram,
        that n-gram's length and where that occurrence ended (0, 0: none matched)."""
        self._index(tokens, len(tokens) - 1)  # not the suffix itself: it would find only itself
        for n in MATCH_LENGTHS:
            if len(tokens) > n:
                end = self._ends.get(tuple(tokens[-n:]))
                if end is not None:
                    return list(tokens[end : end + limit]), n, end
        return [], 0, 0

    def _index(self, tokens: Tokens[int], upto: int) -> None:
        for end in range(self._indexed + 1, upto + 1):
            for n in MATCH_LENGTHS:
                if end >= n:
                    self._ends[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, upto)


class CopyCursor:
    """Where in its earlier tokens a sequence is copying from, followed across small departures. A model
    copying a passage adds a comma or leaves out a word; no recent 4-gram then matches for a few tokens,
    while the copy goes on where it left off."""

    MAX_MISSES = 2
    """Tokens in a row that follow neither the next source token nor the one after it: the copy is over."""

    def __init__(self) -> None:
        self.at: int | None = None
        """The index of the token the copy comes to next (None: no copy is followed)."""
        self._followed = 0  # tokens up to here are accounted for
        self._misses = 0

    def sync(self, at: int) -> None:
        """A 4-gram matched: the copy continues from `at`."""
        self.at, self._misses = at, 0

    def follow(self, tokens: Tokens[int]) -> None:
        """Moves along the tokens appended since the last call: one that is the next source token (or the
        one after it, a token left out) moves the cursor past it; another is taken as added, up to
        MAX_MISSES in a row."""
        for j in range(self._followed, len(tokens)):
            at = self.at
            if at is None:
                break
            if at < j and tokens[at] == tokens[j]:
                self.at, self._misses = at + 1, 0
            elif at + 1 < j and tokens[at + 1] == tokens[j]:
                self.at, self._misses = at + 2, 0
            else:
                self._misses += 1
                if self._misses > self.MAX_MISSES:
                    self.at = None
        self._followed = len(tokens)

    def propose(self, tokens: Tokens[int], limit: int) -> list[int]:
        return [] if self.at is None else list(tokens[self.at : min(self.at + limit, len(tokens))])


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
        return estimate + (1 - estimate) * _CURIOSITY / (1 + self.seen(source, engine)) ** 0.5

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
