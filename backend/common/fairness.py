"""Who goes next when callers share one engine: the policy both engines' schedulers use.

Pure bookkeeping over the requests an engine holds (anything with a `.request`):

- **Service counters** (the VTC scheduler's, Sheng et al., OSDI '24): each caller's
  counter grows by the tokens the engine computes for it, divided by its weight; a
  slot held by a caller that is not reading is charged too. A caller that starts
  holding requests again starts at the least counter among the callers it competes
  with (those waiting, else those running), so an idle spell banks no credit.
- **Admission order**: the highest priority first; among callers, the least counter
  first; within a caller, sequences coming back from preemption, then arrival order.
  A caller at `max_running_per_caller` waits even when a slot is free.
- **Preemption** when every slot is held: a sequence of lower priority at once, or,
  after `time_slice_steps`, one of the caller furthest over its share, when a swap
  makes the shares more even (slots per weight), or when that caller's counter is
  more than a time slice ahead; and, unless the waiting caller holds no slot at all,
  only one that costs at most a time slice of tokens to bring back (the engine says
  what it would recompute), so time-slicing never throws away much work. A caller
  never preempts itself.
- **Shedding** when the engine holds more than its capacity (the service let a caller
  under its share in past a full server): the waiting request of the lowest priority,
  of the caller holding the most per weight, the newest, is refused.

With `scheduling = fifo` admission is in arrival order and nothing is preempted but
sequences whose callers are not reading, or shed: the baseline the policy is measured against.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Collection, Iterable, Sequence
from collections.abc import Set as AbstractSet  # any set-like view of callers
from typing import Protocol, TypeVar

from backend.config import EngineConfig
from backend.types import GenerationRequest


class Held(Protocol):
    @property
    def request(self) -> GenerationRequest: ...


H = TypeVar("H", bound=Held)


def caller_of(item: Held) -> str:
    return item.request.scheduling.caller


def _weight(item: Held) -> float:
    return item.request.scheduling.weight


def _priority(item: Held) -> int:
    return item.request.scheduling.priority


def _standing(item: Held) -> tuple[str, int, float]:
    """All the policy's admission decisions read of a candidate: its caller, priority and weight. Two
    candidates alike in these find a place, or none, alike (see FairnessPolicy.place)."""
    scheduling = item.request.scheduling
    return scheduling.caller, scheduling.priority, scheduling.weight


class ServiceCounters:
    """Weighted tokens served per caller; only their differences matter."""

    def __init__(self) -> None:
        self._served: dict[str, float] = {}

    def __getitem__(self, caller: str) -> float:
        return self._served.get(caller, 0.0)

    def __len__(self) -> int:
        return len(self._served)

    def charge(self, caller: str, tokens: float, weight: float) -> None:
        self._served[caller] = self[caller] + tokens / weight

    def lift(self, caller: str, competitors: Iterable[str]) -> None:
        """A caller that holds nothing yet starts at the least counter of those it competes with."""
        floor = min((self[other] for other in competitors if other != caller), default=None)
        if floor is not None:
            self._served[caller] = max(self[caller], floor)

    def forget_idle(self, holding: AbstractSet[str]) -> None:
        """Drops callers that hold nothing and would be lifted anyway (all of them when the engine is idle)."""
        floor = min((self[caller] for caller in holding), default=None)
        for caller in [c for c, served in self._served.items() if c not in holding]:
            if floor is None or self._served[caller] <= floor:
                del self._served[caller]


class HeldCallers:
    """The callers holding requests in an engine (waiting, running or preempted), counted as requests come
    and go rather than gathered anew for every arrival: hundreds may arrive at once."""

    def __init__(self) -> None:
        self._held: collections.Counter[str] = collections.Counter()

    def add(self, item: Held) -> None:
        self._held[caller_of(item)] += 1

    def remove(self, item: Held) -> bool:
        """Counts one of its caller's requests gone; True when it was the caller's last."""
        caller = caller_of(item)
        self._held[caller] -= 1
        if self._held[caller]:
            return False
        del self._held[caller]
        return True

    def callers(self) -> AbstractSet[str]:
        return self._held.keys()

    def clear(self) -> None:
        self._held.clear()


class FairnessPolicy:
    def __init__(self, config: EngineConfig) -> None:
        self.fair = config.fairness.fair
        self.time_slice_steps = config.fairness.time_slice_steps
        self.max_running_per_caller = config.max_running_per_caller
        self.capacity = config.capacity
        self.counters = ServiceCounters()

    # -- accounting ----------------------------------------------------------------

    def arrived(self, item: Held, waiting: Iterable[Held], running: Iterable[Held], holding: AbstractSet[str]) -> None:
        """A new request: its caller starts at the competitors' floor if it held nothing before."""
        caller = caller_of(item)
        if caller not in holding:
            competitors = {caller_of(w) for w in waiting} - {caller} or {caller_of(r) for r in running}
            self.counters.lift(caller, competitors)

    def charge(self, item: Held, tokens: int) -> None:
        """Tokens computed for it (prompt rows, decode rows, replayed rows), or a slot held while paused."""
        self.counters.charge(caller_of(item), tokens, _weight(item))

    def left(self, holding: AbstractSet[str]) -> None:
        """A request ended or was shed: forget the counters nobody needs."""
        self.counters.forget_idle(holding)

    # -- decisions -------------------------------------------------------------------

    def at_limit(self, candidate: Held, running: Iterable[Held]) -> bool:
        """Its caller has max_running_per_caller sequences in the batch (paused ones included)."""
        mine = caller_of(candidate)
        return sum(item.request.scheduling.caller == mine for item in running) >= self.max_running_per_caller

    def next(self, candidates: Sequence[H], running: Iterable[Held]) -> H | None:
        """Who is admitted next among the candidates (given in their callers' own order), or None."""
        return next(iter(self.ranked(candidates, running)), None)

    def ranked(self, candidates: Sequence[H], running: Iterable[Held]) -> list[H]:
        """The candidates that may start, in the order they should (see the module's doc). A caller at its
        limit may start one only in place of one of its own: one that gives way (its caller not reading, or
        reading slowly), or (fair) a less urgent one."""
        running = list(running)
        per_caller = collections.Counter(caller_of(item) for item in running)

        replaces: dict[tuple[str, int], bool] = {}  # by caller and priority: hundreds may wait

        def replaces_own(candidate: Held) -> bool:
            key = caller_of(candidate), _priority(candidate)
            if key not in replaces:
                replaces[key] = any(
                    caller_of(item) == key[0]
                    and (getattr(item, "gives_way", False) or self.fair and _priority(item) < key[1])
                    for item in running
                )
            return replaces[key]

        eligible = [c for c in candidates if per_caller[caller_of(c)] < self.max_running_per_caller or replaces_own(c)]
        if not self.fair:
            return eligible
        order = sorted(
            enumerate(eligible), key=lambda pair: (-_priority(pair[1]), self.counters[caller_of(pair[1])], pair[0])
        )
        return [candidate for _, candidate in order]

    def fill(self, candidates: Sequence[H], running: Collection[Held], batch_size: int) -> list[H]:
        """The candidates, in ranked order, that take the free places of a batch of `batch_size`, each caller
        within its limit, from one ranking: a burst of hundreds arriving at a batch of hundreds was ranked again
        for every place. A candidate at its caller's limit is left to `place` (it may take one of its own)."""
        free = batch_size - len(running)
        if free <= 0:
            return []
        per_caller = collections.Counter(caller_of(item) for item in running)
        chosen: list[H] = []
        for candidate in self.ranked(candidates, running):
            caller = caller_of(candidate)
            if per_caller[caller] < self.max_running_per_caller:
                per_caller[caller] += 1
                chosen.append(candidate)
                if len(chosen) == free:
                    break
        return chosen

    def place(
        self, candidates: Sequence[H], running: Collection[Held], batch_size: int, victim_for: Callable[[H], H | None],
    ) -> tuple[H, H | None] | None:
        """The first candidate, in ranked order, that can start: in a free place of a batch of `batch_size`,
        or in the place of the running one `victim_for` names (asked when the batch is full or the candidate's
        caller is at its limit); with that victim, or None. None when no candidate can start. Once a candidate
        found no place, those alike in caller, priority and weight are skipped: hundreds may wait while the
        batch is full, and each look goes over the batch."""
        placeless: set[tuple[str, int, float]] = set()
        for candidate in self.ranked(candidates, running):
            if _standing(candidate) in placeless:
                continue
            if len(running) < batch_size and not self.at_limit(candidate, running):
                return candidate, None
            victim = victim_for(candidate)
            if victim is not None:
                return candidate, victim
            placeless.add(_standing(candidate))
        return None

    def displaced(
        self, candidate: Held, running: Iterable[Held], willing: Sequence[H], steps_run: Callable[[H], int],
        comeback_cost: Callable[[H], int],
    ) -> H | None:
        """Who among the `willing` running gives its place to `candidate`: at its caller's limit one of its
        own (less urgent, or past its share: no time slice asked), else the policy's pick (see victim)."""
        if self.at_limit(candidate, running):
            own = [item for item in willing if caller_of(item) == caller_of(candidate)]
            return self.victim(candidate, own, lambda item: 0, comeback_cost)
        return self.victim(candidate, willing, steps_run, comeback_cost)

    def victim(
        self, candidate: Held, running: Sequence[H], steps_run: Callable[[H], int], comeback_cost: Callable[[H], int]
    ) -> H | None:
        """The running sequence (its caller not paused) that gives its slot to `candidate`, or None; among
        equals, the one holding the fewest tokens (the least to compute again should its cells be lost).
        `comeback_cost`: the tokens a sequence would compute again, as the engine expects it now."""
        if not self.fair or not running:
            return None
        mine, priority, my_weight = _standing(candidate)
        # One pass, attributes read inline: it runs for each caller waiting while a batch of hundreds is full.
        groups: dict[tuple[str, float], list[H]] = {}  # alike in caller and weight: a batch has a few
        lower: list[H] = []
        for item in running:
            scheduling = item.request.scheduling
            if scheduling.priority < priority:
                lower.append(item)
            groups.setdefault((scheduling.caller, scheduling.weight), []).append(item)
        if lower:  # a more urgent request never waits for a time slice
            return min(lower, key=lambda item: (_priority(item), -self.counters[caller_of(item)], tokens_held(item)))
        slots: collections.Counter[str] = collections.Counter()
        for (caller, _), items in groups.items():
            slots[caller] += len(items)
        after = (slots[mine] + 1) / my_weight  # the candidate's slots per weight once admitted
        eligible = []
        for (caller, weight), items in groups.items():
            if caller == mine:
                continue
            theirs = slots[caller] / weight
            ahead = self.counters[caller] - self.counters[mine] > self.time_slice_steps
            if not (theirs > after or (ahead and theirs >= after)):  # a swap would not even the shares
                continue
            eligible += [
                item for item in items
                if _priority(item) == priority and steps_run(item) >= self.time_slice_steps
                # a caller holding no slot gets one whatever it costs
                and (slots[mine] == 0 or comeback_cost(item) <= self.time_slice_steps)
            ]
        if not eligible:
            return None
        return max(eligible, key=lambda item: (slots[caller_of(item)] / _weight(item), self.counters[caller_of(item)],
                                               -tokens_held(item)))

    def to_shed(self, waiting: Sequence[H], held: Iterable[Held]) -> H | None:
        """The waiting request to refuse when the engine holds more than its capacity, or None."""
        if not self.fair or not waiting:
            return None
        per_caller = collections.Counter(caller_of(item) for item in held)

        def entitlement(pair: tuple[int, H]) -> tuple[int, float, int]:
            arrival, item = pair
            return _priority(item), -per_caller[caller_of(item)] / _weight(item), -arrival

        return min(enumerate(waiting), key=entitlement)[1]


def tokens_held(item: Held) -> int:
    """The tokens an item holds (prompt and output so far) where it tracks them; else its prompt's."""
    tokens = getattr(item, "tokens", None)
    return len(tokens) if tokens is not None else len(item.request.prompt_token_ids)
