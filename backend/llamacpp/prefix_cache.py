"""Which idle cache streams hold which tokens, and which one to give up first.

A llama.cpp sequence id (a "slot", one cache stream each) that no live sequence
holds keeps the cells of the last sequence that used it. This index remembers
their tokens, so a new prompt can start from the longest cached prefix, and
names the least recently used entry when a stream has to be overwritten.
Bookkeeping only: the slots move the cells (backend.llamacpp.slots).

Each entry says how many of its leading tokens other requests may take
(`shared`); the sequence that left it (one preempted, coming back) may take all
of it. By default (prefix_cache_exact off) that is every cell, decoded answers
included, taken to the token as llama-server, vLLM and SGLang take theirs.

With prefix_cache_exact, only cells computed as part of a prompt are shared, as
far as the new prompt's layout allows (see backend.llamacpp.layout): llama.cpp
computes a token decoded alone with other kernels than the same token inside a
prompt, so a later prompt that resent an earlier answer would see slightly
different numbers, and greedy output could change. Generated tokens are kept
all the same: a sequence that ends leaves its entry with the tokens it ended
with (`ended_with`), and a later engine step computes its generated tail again
as prompt rows (backend.llamacpp.retile, which says when), before anything is
admitted. The entry is then put again, every cell prompt-computed and shared.

Entries carry a salt (the request's cache_salt mixed with the server's cache
scope, see service.cache_scope): a prompt matches only entries of its own salt,
so one caller's first-token time says nothing about another's prompts.

`put`, `drop` and `move` are the only calls that change which tokens the index
holds (`touch` and `settle` change only the eviction order).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from backend.common.tokens import common_prefix


@dataclass
class CachedPrefix:
    tokens: tuple[int, ...]
    last_used: int
    owner: str = ""
    """The request whose cells these are."""
    shared: int = 0
    """How many leading tokens other requests may reuse (every one, or with prefix_cache_exact those computed
    as prompt)."""
    tiled_until: int = 0
    """The layout its prompt rows were computed with (see PromptLayout; 0 for a free layout)."""
    returning: bool = False
    """Its owner was preempted and will come back for these cells: given up last."""
    cache_salt: str = ""
    """Only prompts of the same cache salt match it ("": the unsalted, shared scope)."""
    ended_with: tuple[int, ...] = ()
    """Its sequence ended with these tokens (`tokens` and more): their tail awaits computing as prompt rows."""

    @property
    def offered(self) -> tuple[int, ...]:
        """The tokens another request of its salt may start from."""
        return self.tokens[: self.shared]


class PrefixIndex:
    def __init__(self) -> None:
        self._entries: dict[int, CachedPrefix] = {}
        self._clock = 0
        self.changed: set[int] | None = None
        """Slots put, dropped or moved since the cache events last looked (None: no one looks)."""

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, slot: int) -> bool:
        return slot in self._entries

    @property
    def returning(self) -> int:
        """Entries whose preempted owners will come back for them."""
        return sum(entry.returning for entry in self._entries.values())

    @property
    def tokens_held(self) -> int:
        return sum(len(entry.tokens) for entry in self._entries.values())

    def get(self, slot: int) -> CachedPrefix | None:
        return self._entries.get(slot)

    def put(self, slot: int, tokens: Sequence[int], owner: str, shared: int, tiled_until: int,
            returning: bool = False, cache_salt: str = "", ended_with: Sequence[int] = ()) -> None:
        self._clock += 1
        self._entries[slot] = CachedPrefix(
            tuple(tokens), self._clock, owner, min(shared, len(tokens)), tiled_until, returning, cache_salt, tuple(ended_with),
        )
        if self.changed is not None:
            self.changed.add(slot)

    def ended(self) -> list[int]:
        """The slots whose entries still wait for their generated tail to be computed as prompt rows."""
        return [slot for slot, entry in self._entries.items() if entry.ended_with]

    def settle(self, owner: str) -> None:
        """A preempted owner came back (or ended): its cells are an ordinary prefix now."""
        for entry in self._entries.values():
            if entry.owner == owner:
                entry.returning = False

    def drop(self, slot: int) -> CachedPrefix | None:
        if self.changed is not None and slot in self._entries:
            self.changed.add(slot)
        return self._entries.pop(slot, None)

    def move(self, source: int, target: int) -> None:
        self._entries[target] = self._entries.pop(source)
        if self.changed is not None:
            self.changed.update((source, target))

    def touch(self, slot: int) -> None:
        self._clock += 1
        self._entries[slot].last_used = self._clock

    def matches(self, tokens: Sequence[int], owner: str, cache_salt: str = "") -> Iterator[tuple[int, int, int | None]]:
        """(slot, tokens in common, the layout's tiled_until) for every entry of `cache_salt` sharing a prefix with
        `tokens`; the layout is None where it may take the cells as they are: the entries of `owner`."""
        for slot, entry in self._entries.items():
            if entry.cache_salt != cache_salt:
                continue
            own = entry.owner == owner
            common = common_prefix(entry.tokens if own else entry.offered, tokens)
            if common:
                yield slot, common, None if own else entry.tiled_until

    def victim(self, free_slots: Iterable[int], keep_newer_than: int | None = None) -> int | None:
        """A free slot to overwrite: an empty one first, else the least recently used entry's, those of
        preempted owners last and the shortest of them first (only if it ranks below `keep_newer_than`'s
        entry, when given)."""
        candidates = list(free_slots)
        empty = [slot for slot in candidates if slot not in self._entries]
        if empty:
            return min(empty)
        held = [slot for slot in candidates if slot in self._entries]
        if not held:
            return None
        oldest = min(held, key=self._rank)
        if keep_newer_than is not None and self._rank(oldest) >= self._rank(keep_newer_than):
            return None
        return oldest

    def _rank(self, slot: int) -> tuple[bool, int]:
        """Lower goes first: ordinary entries by last use, then preempted owners' by how much they would
        recompute without them."""
        entry = self._entries[slot]
        return entry.returning, len(entry.tokens) if entry.returning else entry.last_used
