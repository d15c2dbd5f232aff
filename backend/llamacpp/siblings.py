"""n samples of one prompt: the first sample computes the prompt, the others fork from it.

A request for n samples enters the engine as its first sample (the leader); the
others wait here, outside the scheduler, until the leader's last prompt row is
computed. In that step each of them takes a slot holding a copy of the leader's
prompt cells (llama_memory_seq_cp, see Slots.fork) and picks its first token from
the leader's very row of logits with its own sampler: the prompt is computed once,
whatever n, and every sample sees the same numbers. From then on each sample is a
sequence of its own (its sampler, constraint state, stops, finish). A sample that
finds no batch place free then queues as any request does.

Every sample of a request is known by the request's id (`Sequence.group`), so one
cancel, pause or resume reaches them all.
"""

from __future__ import annotations

from backend.llamacpp.sequence import Sequence


class Siblings:
    def __init__(self) -> None:
        self._held: dict[str, list[Sequence]] = {}
        """The leader's id -> its other samples, until its prompt is computed."""

    def __len__(self) -> int:
        return sum(map(len, self._held.values()))

    def hold(self, leader: Sequence, others: list[Sequence]) -> None:
        if others:
            self._held[leader.id] = others

    def holds(self, leader: Sequence) -> bool:
        return leader.id in self._held

    def take(self, leader: Sequence) -> list[Sequence]:
        """The samples waiting for `leader`'s prompt (none once they have forked)."""
        return self._held.pop(leader.id, [])
