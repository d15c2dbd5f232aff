"""Who runs: waiting, running and preempted sequences, and what each engine step computes.

Pure bookkeeping, no llama.cpp call: the core asks for decisions and carries
them out (the slots place cells, the batch feeds rows).

- Admission: who goes next, and whom a full batch gives up, is the fairness
  policy's choice (backend.common.fairness): priority first, then the caller served
  least, a preempted sequence of a caller before its new requests. When every
  batch place is taken, the sequence paused longest (its caller is not reading)
  gives up its slot, or one paused a third of its steps of a time slice or more
  (its caller reads a little now and then); else, under the fair policy, one
  of lower priority, or of a caller over its share that has run a time slice. A preempted sequence keeps its
  tokens and sampler (its cells stay as a cached prefix where a free slot holds
  them) and comes back, its caller reading, when its turn comes again.
- Shedding: a request still waiting when the engine holds more than its capacity.
- Expiry: requests past their deadline or time limit, requests not started within
  their queue timeout, and sequences whose caller has read nothing for max_pause_s.
- The step's work: the next group of rows of the most urgent prompt waiting
  longest for one, each group a llama_decode of its own (its layout says how
  rows group, so its numbers never depend on what else runs), unless decoding sequences have
  waited batch_tokens prompt rows already; else the next token of every
  decoding sequence. A CPU prefills a token at the same cost batched or not
  (docs/benchmarks.md), so a burst of arrivals gets first tokens one after
  another instead of all at the end.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypedDict

from backend.common.fairness import FairnessPolicy, HeldCallers, caller_of
from backend.llamacpp.sequence import Sequence


@dataclass(frozen=True)
class Admission:
    sequence: Sequence
    """A new request, or a preempted sequence coming back."""
    preempting: Sequence | None = None
    """The sequence that gives up its slot for it, if the batch is full."""


@dataclass(frozen=True)
class Feed:
    """Tokens of one sequence for this step's decode: `tokens[cached : cached + count]`, then the
    `proposed` tokens to check, which the speculator adds (see backend.llamacpp.speculation)."""

    sequence: Sequence
    count: int
    room: int = 0
    """Rows it may add for proposed tokens this step (0 until every known token is in)."""
    proposed: tuple[int, ...] = ()
    source: str = ""
    """Where the proposed tokens came from (see backend.llamacpp.speculation.drafts.SOURCES)."""
    prefill: bool = False
    forced: tuple[bool, ...] = ()
    """Per proposed token: forced by the grammar once the ones before it are in (taken unsampled; empty: none is)."""


class Occupancy(TypedDict):
    """Who is where now, as EngineStats fields."""

    running_sequences: int
    preempted_sequences: int
    paused_sequences: int
    queued_requests: int
    cache_tokens_used: int


@dataclass(frozen=True)
class Expired:
    never_started: list[Sequence]
    timed_out: list[Sequence]
    paused_too_long: list[Sequence]
    queue_timed_out: list[Sequence]


class Scheduler:
    def __init__(
        self, max_batch_size: int, batch_tokens: int, max_pause_s: float, context_length: int, policy: FairnessPolicy,
        comeback_cost: Callable[[Sequence], int],
    ) -> None:
        self.max_batch_size = max_batch_size
        self.policy = policy
        self._comeback_cost = comeback_cost
        """Tokens a sequence would compute again if preempted now (the slots know what they keep)."""
        self.batch_tokens = batch_tokens
        self.max_forced = max(0, min(16, batch_tokens // max_batch_size - 1))
        """Most forced tokens a sequence takes at once, so every sequence's feed fits a batch."""
        self.context_length = context_length
        self.max_pause_s = max_pause_s
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: dict[str, Sequence] = {}
        self.preempted: dict[str, Sequence] = {}
        """In preemption order: the first comes back first."""
        self._turns = itertools.count()
        self._queue_turns = itertools.count()
        self._prompt_rows_since_decode = 0
        self._holders = HeldCallers()

    def add(self, seq: Sequence) -> list[Sequence]:
        """Queues a new request; returns the waiting ones to shed (the core ends them) to stay within
        capacity: the new one, or one that gives way to it."""
        self.policy.arrived(seq, self.waiting, self.running.values(), self._holders.callers())
        seq.turn.queue_turn = next(self._queue_turns)
        self.waiting.append(seq)
        self._holders.add(seq)
        if len(self.waiting) + len(self.running) + len(self.preempted) <= self.policy.capacity:
            return []
        waiting, held = list(self.waiting), list(self.all())
        shed = []
        while len(held) > self.policy.capacity:
            victim = self.policy.to_shed(waiting, held)
            if victim is None:
                break
            waiting.remove(victim)
            held.remove(victim)
            shed.append(victim)
        return shed

    def remove(self, seq: Sequence) -> None:
        """Forgets a sequence, wherever it is."""
        if self.running.pop(seq.id, None) is None and self.preempted.pop(seq.id, None) is None:
            self.waiting.remove(seq)
        if self._holders.remove(seq):
            self.policy.left(self._holders.callers())

    def account(self, feeds: list[Feed], step: int) -> None:
        """Charges each caller for this step: the rows computed for it (proposed ones too), and a slot held while
        paused; and notes
        who reads slowly: paused a third of its steps since it entered the batch, over a time slice at least."""
        for feed in feeds:
            self.policy.charge(feed.sequence, feed.count + len(feed.proposed))
        for seq in self.running.values():
            turn = seq.turn
            if seq.paused:
                self.policy.charge(seq, 1)
                turn.paused_steps += 1
            ran = step - turn.admitted_step + 1
            turn.reads_slowly = ran >= self.policy.time_slice_steps and 3 * turn.paused_steps >= ran

    def has_work(self) -> bool:
        """Whether a step would do anything: a running sequence not paused, or something the policy would admit
        (into a free slot, or one a paused sequence gives up)."""
        if any(not seq.paused for seq in self.running.values()):
            return True
        return self.policy.next(self._candidates(), self.running.values()) is not None

    def holds_sequences(self) -> bool:
        return bool(self.waiting or self.running or self.preempted)

    def started(self) -> Iterator[Sequence]:
        """Running and preempted sequences: those that have been admitted."""
        yield from self.running.values()
        yield from self.preempted.values()

    def all(self) -> Iterator[Sequence]:
        yield from self.started()
        yield from self.waiting

    def occupancy(self) -> Occupancy:
        """Who is where now, as EngineStats fields."""
        return Occupancy(
            running_sequences=len(self.running), preempted_sequences=len(self.preempted),
            paused_sequences=sum(seq.paused for seq in self.started()), queued_requests=len(self.waiting),
            cache_tokens_used=sum(seq.cached for seq in self.running.values()),
        )

    # -- decisions ------------------------------------------------------------------

    def expired(self, now: float) -> Expired:
        started = list(self.started())
        timed_out = [seq for seq in started if seq.output.deadline_passed(now)]
        never_started = [seq for seq in self.waiting if seq.output.deadline_passed(now)]
        return Expired(
            never_started=never_started,
            timed_out=timed_out,
            paused_too_long=[
                seq for seq in started
                if seq not in timed_out and (since := seq.turn.paused_since) is not None and now - since >= self.max_pause_s
            ],
            queue_timed_out=[
                seq for seq in self.waiting
                if seq not in never_started and seq.request.queue_deadline is not None
                and now >= seq.request.queue_deadline
            ],
        )

    def admit(self, step: int) -> Iterator[Admission]:
        """Starts waiting work while there is room or a sequence to preempt (see backend.common.fairness); each
        admission is in `running` when yielded, each preempted one in `preempted` (the caller moves their
        cells). `step` is the engine step about to run: a sequence runs a time slice before it may give way."""
        while True:
            placed = self.policy.place(self._candidates(), self.running.values(), self.max_batch_size,
                                       lambda seq: self._victim_for(seq, step))
            if placed is None:
                return
            seq, victim = placed
            if victim is not None:
                del self.running[victim.id]
                self.preempted[victim.id] = victim
            if self.preempted.pop(seq.id, None) is None:
                self.waiting.remove(seq)
            self._enter(seq, step)
            yield Admission(seq, victim)

    def join(self, leader: Sequence, seq: Sequence, step: int) -> None:
        """A sample forked from its request's first (backend.llamacpp.siblings) starts at once, in the batch,
        paused if its leader is."""
        seq.turn.queue_turn = next(self._queue_turns)
        seq.turn.paused_since = leader.turn.paused_since
        self._enter(seq, step)
        self._holders.add(seq)

    def _enter(self, seq: Sequence, step: int) -> None:
        """Into the batch at `step`: a time slice starts, and the output it has (back from preemption) is fed
        again one token a step."""
        turn = seq.turn
        turn.admissions += 1
        turn.admitted_step, turn.paused_steps, turn.reads_slowly = step, 0, False
        turn.replay_until = len(seq.tokens)
        turn.prefill_turn = next(self._turns)
        self.running[seq.id] = seq

    def next_feeds(self) -> list[Feed]:
        """This step's rows: one prompt's next group, or every decoding sequence's next token."""
        prefill = self._prefill_feed()
        if prefill is not None:
            self._prompt_rows_since_decode += prefill.count
            return [prefill]
        self._prompt_rows_since_decode = 0
        return self._decoding_feeds()

    def _prefill_feed(self) -> Feed | None:
        ready = [seq for seq in self.running.values() if seq.ready_to_prefill]
        if not ready:
            return None
        seq = min(ready, key=lambda s: (-s.request.scheduling.priority, s.turn.prefill_turn))  # the most urgent first
        rows = seq.layout.next_group(seq.cached, self.batch_tokens)
        waited = self._prompt_rows_since_decode
        if waited and waited + rows > self.batch_tokens and any(s.decodes for s in self.running.values()):
            return None  # decoding sequences have waited long enough
        seq.turn.prefill_turn = next(self._turns)
        return Feed(seq, rows, prefill=True)

    def _decoding_feeds(self) -> list[Feed]:
        """The known tokens of every decoding sequence (its last token and any its grammar forced), and
        the room each has left for proposed tokens, in slot order.

        Tokens in ascending sequence order: llama.cpp's per-sequence cache takes a much slower path
        (measured: 1.7x per step at 8 sequences) when a batch lists sequences out of order.
        """
        decoding = [seq for seq in sorted(self.running.values(), key=lambda seq: seq.slot) if seq.decodes]
        rows_each = self.batch_tokens // max(1, len(decoding))  # every sequence's rows fit one batch
        feeds = []
        for seq in decoding:
            replaying = seq.cached < seq.turn.replay_until - 1  # fed again one a step, as first computed
            known = 1 if replaying else min(rows_each, len(seq.tokens) - seq.cached)
            complete = seq.cached + known == len(seq.tokens)
            room = min(rows_each - known, self.context_length - len(seq.tokens), seq.output.tokens_left - 1)
            feeds.append(Feed(seq, known, room=max(0, room) if complete else 0))
        return feeds

    def pause(self, seq: Sequence, now: float) -> None:
        """Its caller stopped reading (at `now`, unless it had already): it is skipped in batches, and may be
        preempted or expire (max_pause_s)."""
        if seq.turn.paused_since is None:
            seq.turn.paused_since = now

    def resume(self, seq: Sequence) -> None:
        """Its caller reads again. Preempted while not reading, it queues from now on: a slow reader coming
        back and forth never overtakes a request that waited meanwhile."""
        seq.turn.paused_since = None
        if seq.id in self.preempted:
            seq.turn.queue_turn = next(self._queue_turns)

    def _candidates(self) -> list[Sequence]:
        """Who may start, each caller's in its own order: queue turns, which a sequence preempted for another's
        turn keeps from its arrival (so it comes back before later arrivals) and a slow reader takes anew."""
        candidates = [*(seq for seq in self.preempted.values() if not seq.paused), *self.waiting]
        return sorted(candidates, key=lambda seq: seq.turn.queue_turn)

    def _victim_for(self, seq: Sequence, step: int) -> Sequence | None:
        """Who gives its slot to `seq`: at its caller's limit one of its own (paused, or less urgent); else the
        sequence paused longest, or the one the policy names (which has run a time slice, unless less urgent)."""
        decoding = [s for s in self.running.values() if not s.gives_way]
        mine = caller_of(seq) if self.policy.at_limit(seq, self.running.values()) else None
        return self._longest_paused(mine) or self._slow_reader(mine) or self.policy.displaced(
            seq, self.running.values(), decoding, lambda s: step - s.turn.admitted_step, self._comeback_cost
        )

    def _slow_reader(self, caller: str | None = None) -> Sequence | None:
        """A sequence not paused this moment whose caller reads slowly (see account): it holds its slot as one
        that is paused does."""
        slow = [s for s in self.running.values() if s.turn.reads_slowly and not s.paused and caller in (None, caller_of(s))]
        return max(slow, key=lambda s: s.turn.paused_steps) if slow else None

    def _longest_paused(self, caller: str | None = None) -> Sequence | None:
        paused = [(since, seq) for seq in self.running.values()
                  if (since := seq.turn.paused_since) is not None and caller in (None, caller_of(seq))]
        return min(paused, key=lambda pair: pair[0])[1] if paused else None
