"""Who runs: waiting, running and preempted sequences, and what each engine step computes.

Pure bookkeeping, no llama.cpp call: the core asks for decisions and carries
them out (the slots place cells, the batch feeds rows).

- Admission: oldest first, a preempted sequence whose caller reads again before
  a new request. When every batch place is taken, the sequence paused longest
  (its caller is not reading) is preempted to make room: it gives up its slot,
  keeps its tokens and sampler, and comes back once its caller reads again.
- Expiry: requests past their deadline or time limit, and sequences whose
  caller has read nothing for max_pause_s.
- The step's work: the next group of rows of the prompt waiting longest for
  one, each group a llama_decode of its own (its layout says how rows group, so
  its numbers never depend on what else runs), unless decoding sequences have
  waited batch_tokens prompt rows already; else the next token of every
  decoding sequence. A CPU prefills a token at the same cost batched or not
  (docs/benchmarks.md), so a burst of arrivals gets first tokens one after
  another instead of all at the end.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from backend.llamacpp.sequence import Sequence
from backend.llamacpp.speculation import Candidate, DecodeCosts, plan_drafts, proposal


@dataclass(frozen=True)
class Admission:
    sequence: Sequence
    """A new request, or a preempted sequence coming back."""
    preempting: Sequence | None = None
    """The paused sequence that gives up its slot for it, if the batch is full."""


@dataclass(frozen=True)
class Feed:
    """Tokens of one sequence for this step's decode: `tokens[cached : cached + count]`, then the
    `proposed` tokens to check (see backend.llamacpp.speculation)."""

    sequence: Sequence
    count: int
    proposed: tuple[int, ...] = ()
    prefill: bool = False


@dataclass(frozen=True)
class Expired:
    never_started: list[Sequence]
    timed_out: list[Sequence]
    paused_too_long: list[Sequence]


class Scheduler:
    def __init__(self, max_batch_size: int, batch_tokens: int, max_pause_s: float, context_length: int) -> None:
        self.max_batch_size = max_batch_size
        self.batch_tokens = batch_tokens
        self.context_length = context_length
        self.max_pause_s = max_pause_s
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: dict[str, Sequence] = {}
        self.preempted: dict[str, Sequence] = {}
        """In preemption order: the first comes back first."""
        self._turns = itertools.count()
        self._prompt_rows_since_decode = 0
        self.costs = DecodeCosts()
        """What decoding rows costs on this machine, as the core measures it."""

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def find(self, request_id: str) -> Sequence | None:
        """A request that has started (running or preempted)."""
        return self.running.get(request_id) or self.preempted.get(request_id)

    def find_waiting(self, request_id: str) -> Sequence | None:
        return next((seq for seq in self.waiting if seq.id == request_id), None)

    def remove(self, seq: Sequence) -> None:
        """Forgets a sequence, wherever it is."""
        if self.running.pop(seq.id, None) is None and self.preempted.pop(seq.id, None) is None:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        """Whether a step would do anything: something to admit, or a running sequence not paused."""
        return self._has_candidate() or any(not seq.paused for seq in self.running.values())

    def holds_sequences(self) -> bool:
        return bool(self.waiting or self.running or self.preempted)

    def all(self) -> Iterator[Sequence]:
        yield from self.running.values()
        yield from self.preempted.values()
        yield from self.waiting

    # -- decisions ------------------------------------------------------------------

    def expired(self, now: float) -> Expired:
        started = [*self.running.values(), *self.preempted.values()]
        timed_out = [seq for seq in started if seq.output.deadline_passed(now)]
        return Expired(
            never_started=[seq for seq in self.waiting if seq.output.deadline_passed(now)],
            timed_out=timed_out,
            paused_too_long=[
                seq for seq in started
                if seq not in timed_out and seq.paused and now - seq.paused_since >= self.max_pause_s
            ],
        )

    def admit(self) -> Iterator[Admission]:
        """Starts waiting work while there is room or a paused sequence to preempt; each admission is in
        `running` when yielded, each preempted one in `preempted` (the caller moves their cells)."""
        while self._has_candidate():
            victim = None
            if len(self.running) >= self.max_batch_size:
                victim = self._longest_paused()
                if victim is None:
                    return
                del self.running[victim.id]
                self.preempted[victim.id] = victim
            back = next((seq for seq in self.preempted.values() if not seq.paused), None)
            if back is not None:
                del self.preempted[back.id]
            seq = back or self.waiting.popleft()
            seq.admissions += 1
            seq.replay_until = len(seq.tokens)
            seq.prefill_turn = next(self._turns)
            self.running[seq.id] = seq
            yield Admission(seq, victim)

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
        seq = min(ready, key=lambda s: s.prefill_turn)
        rows = seq.layout.next_group(seq.cached, self.batch_tokens)
        waited = self._prompt_rows_since_decode
        if waited and waited + rows > self.batch_tokens and any(s.decodes for s in self.running.values()):
            return None  # decoding sequences have waited long enough
        seq.prefill_turn = next(self._turns)
        return Feed(seq, rows, prefill=True)

    def _decoding_feeds(self) -> list[Feed]:
        """The known tokens of every decoding sequence (its last token and any its grammar forced), and
        the proposed tokens worth checking, in slot order.

        Tokens in ascending sequence order: llama.cpp's per-sequence cache takes a much slower path
        (measured: 1.7x per step at 8 sequences) when a batch lists sequences out of order.
        """
        decoding = [seq for seq in sorted(self.running.values(), key=lambda seq: seq.slot) if seq.decodes]
        rows_each = self.batch_tokens // max(1, len(decoding))  # every sequence's rows fit one batch
        candidates = []
        for seq in decoding:
            replaying = seq.cached < seq.replay_until - 1  # fed again one a step, as first computed
            known = 1 if replaying else min(rows_each, len(seq.tokens) - seq.cached)
            complete = seq.cached + known == len(seq.tokens)
            room = min(rows_each - known, self.context_length - len(seq.tokens), seq.output.tokens_left - 1)
            speculates = seq.draft is not None and complete and room > 0
            proposed = proposal(seq.tokens, seq.draft, seq.output.constraint, room) if speculates else []
            candidates.append(Candidate(known, proposed, seq.draft))
        checked = plan_drafts(candidates, self.costs)
        for candidate, n in zip(candidates, checked):
            if candidate.draft is not None and not n:
                candidate.draft.checked(0, 0)  # a step without a check
        return [Feed(seq, c.known_rows, tuple(c.proposed[:n])) for seq, c, n in zip(decoding, candidates, checked)]

    def _has_candidate(self) -> bool:
        return bool(self.waiting) or any(not seq.paused for seq in self.preempted.values())

    def _longest_paused(self) -> Sequence | None:
        paused = [seq for seq in self.running.values() if seq.paused]
        return min(paused, key=lambda s: s.paused_since) if paused else None
