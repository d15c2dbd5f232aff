"""Bringing into the batch what the scheduler lets in: its victims' cells moved out,
each newcomer's cells placed (from a cached prefix where one serves, or copied from
its first sample's prompt), and what was reused counted."""

from __future__ import annotations

import logging

from backend.common.ledger import Ledger
from backend.llamacpp.scheduler import Scheduler
from backend.llamacpp.sequence import Sequence
from backend.llamacpp.slots import Slots

log = logging.getLogger(__name__)


class Admitter:
    def __init__(self, scheduler: Scheduler, slots: Slots, ledger: Ledger) -> None:
        self.scheduler = scheduler
        self.slots = slots
        self.ledger = ledger

    def admit(self, step: int) -> None:
        """Admits what the scheduler lets in this step, then gives a cached prefix to any sequence that can
        now take one."""
        for admission in self.scheduler.admit(step):
            victim, seq = admission.preempting, admission.sequence
            if victim is not None:
                self.slots.vacate(victim, returning=True)
                self.ledger.preempted(victim)
                log.info("preempted %s (%s, %d tokens) for %s", victim.id, _why(victim, seq), len(victim.tokens), seq.id)
            if seq.turn.admissions == 1:
                self._started(seq)
            shared = self.slots.place(seq, self.scheduler.running.values())
            if shared is not None:
                self._count_prefix(seq, shared)
        for seq, shared in self.slots.take_prefixes(self.scheduler.running.values()):
            self._count_prefix(seq, shared)

    def fork(self, leader: Sequence, seq: Sequence, step: int) -> None:
        """Starts one of the leader's other samples in the batch on a copy of the leader's prompt cells
        (the caller has checked that there is a batch place)."""
        self.slots.fork(leader, seq, self.scheduler.running.values())
        self.scheduler.join(leader, seq, step)
        self._started(seq)
        seq.output.cached_tokens = seq.prompt_length
        self.ledger.cached(seq.prompt_length)

    def _started(self, seq: Sequence) -> None:
        seq.output.mark_admitted()
        self.ledger.started(seq, seq.prompt_length)

    def _count_prefix(self, seq: Sequence, shared: int) -> None:
        """A placed sequence took `shared` cached tokens and computes the rest."""
        if seq.turn.admissions == 1:
            seq.output.cached_tokens = min(shared, seq.prompt_length)
            self.ledger.cached(seq.output.cached_tokens)
        else:  # back from preemption: what the cache no longer held is computed again
            self.ledger.recomputed(len(seq.tokens) - shared)


def _why(victim: Sequence, newcomer: Sequence) -> str:
    """Why the victim gave its slot to the newcomer, for the log."""
    if victim.request.scheduling.priority < newcomer.request.scheduling.priority:
        return f"priority {victim.request.scheduling.priority} < {newcomer.request.scheduling.priority}"
    return "paused" if victim.paused else f"caller {victim.request.scheduling.caller!r} over its share"
