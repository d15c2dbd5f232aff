"""Where proposed tokens come from: continuations of n-grams. Each finder is pure bookkeeping over
token ids; drafts.proposal picks among them for a sequence.

    NgramIndex   the longest recent n-gram of a sequence's own tokens that occurred before
    CopyCursor   where in its earlier tokens a sequence is copying from, across small departures
    PastNgrams   what followed a 4-gram in the finished sequences of the same caller
"""

from __future__ import annotations

import collections
from collections.abc import Sequence as Tokens

from backend.llamacpp.speculation.planner import DRAFT_LENGTHS

MATCH_LENGTHS = (4, 3, 2)
"""n-gram lengths matched, longest first."""


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
        self._continuations: collections.OrderedDict[tuple[object, ...], tuple[int, ...]] = collections.OrderedDict()

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
