"""The speculation room's one object, owned by the core: each step it hands the scheduler's feeds in and
gets them back with the proposed tokens worth checking (`extend`), and after the decode says what it
took and what the checks accepted (`learn`). The scheduler decides who decodes and how many rows each
may add; the speculator decides what fills them, and keeps everything that learns from the checks."""

from __future__ import annotations

import dataclasses

from backend.common.fairness import caller_of
from backend.llamacpp.rows import RowsToSample
from backend.llamacpp.scheduler import Feed
from backend.llamacpp.sequence import Sequence
from backend.llamacpp.speculation.costs import passes_for
from backend.llamacpp.speculation.drafts import AcceptanceRates, DraftState, Proposal, proposal
from backend.llamacpp.speculation.planner import Candidate, plan_drafts
from backend.llamacpp.speculation.proposers import PastNgrams
from backend.llamacpp.speculation.threads import ThreadTuner
from backend.types import SpeculationMode


class Speculator:
    def __init__(self, tuner: ThreadTuner, max_forced: int) -> None:
        self.tuner = tuner
        """The thread count that decodes fastest; each count keeps the DecodeCosts the planner weighs."""
        self.max_forced = max_forced
        """Most forced tokens a proposal completes (as the core takes them)."""
        self.acceptance = AcceptanceRates()
        """How often each source's proposals were accepted lately, over every sequence."""
        self.past_ngrams = PastNgrams()
        """N-grams of finished sequences, per caller."""
        self._drafts: dict[Sequence, DraftState] = {}
        """Each speculating sequence's index and acceptance, from its first decoding step to its end."""

    @property
    def threads(self) -> int:
        """The thread count the next decode should run with."""
        return self.tuner.threads

    def extend(self, feeds: list[Feed]) -> list[Feed]:
        """The step's feeds, each decoding sequence's with the proposed tokens worth checking (a prompt's
        as they are): its proposal where it speculates and has room, as many of them as the planner finds
        pay by the current costs."""
        if not feeds or feeds[0].prefill:
            return feeds
        candidates, sources = [], []
        for feed in feeds:
            seq, draft = feed.sequence, self._draft(feed.sequence)
            offer = Proposal([])
            if draft is not None and feed.room > 0:
                past = (self.past_ngrams, caller_of(seq))
                offer = proposal(seq.tokens, seq.prompt_length, draft, seq.output.constraint, feed.room, past,
                                 self.acceptance, self.max_forced)
            acceptance = draft.acceptance(offer.source, self.acceptance) if draft is not None and offer.tokens else 0.0
            candidates.append(Candidate(feed.count, offer.tokens, acceptance, offer.forced))
            sources.append(offer.source)
        checked = plan_drafts(candidates, self.tuner.current_costs)
        for feed, n in zip(feeds, checked):
            draft = self._drafts.get(feed.sequence)
            if draft is not None and not n:
                draft.idle()
        return [dataclasses.replace(feed, proposed=tuple(c.proposed[:n]), source=source if n else "",
                                    forced=tuple(c.forced[:n]))
                for feed, c, source, n in zip(feeds, candidates, sources, checked)]

    def learn(self, feeds: list[Feed], logit_rows: int, seconds: float, checks: list[tuple[RowsToSample, int]]) -> None:
        """What one decode of `feeds` taught: its time (the cost model and the thread count), and each check's
        accepted proposals (`checks`: rows sampled, proposals accepted), the sequence's and the engine's
        acceptance of their source. A sequence that ended meanwhile teaches the engine only."""
        rows = [feed.count + len(feed.proposed) for feed in feeds]
        self.tuner.record(passes_for(rows), sum(rows), logit_rows, seconds)
        for entry, accepted in checks:
            proposed, agreed = entry.sampled(accepted)
            draft = self._drafts.get(entry.sequence)
            if draft is not None:
                draft.checked(entry.source, proposed, agreed)
            self.acceptance.checked(entry.source, proposed, agreed)

    def ended(self, seq: Sequence) -> None:
        """A sequence is done: its output is what its caller's later requests may repeat."""
        self._drafts.pop(seq, None)
        if len(seq.tokens) > seq.prompt_length:
            self.past_ngrams.learn(caller_of(seq), seq.tokens, seq.prompt_length)

    def _draft(self, seq: Sequence) -> DraftState | None:
        """The sequence's draft, begun at its first decoding step; None when it does not speculate: not asked
        to, or under a constraint whose matcher cannot take back the proposed tokens it checks (a grammar
        with stop= or max_tokens=, a reasoning block's among them): that sequence decodes plainly."""
        draft = self._drafts.get(seq)
        speculation, constraint = seq.request.speculation, seq.output.constraint
        if draft is None and speculation.mode is SpeculationMode.NGRAM and (constraint is None or constraint.compiled.rolls_back):
            draft = self._drafts[seq] = DraftState(speculation.max_draft_tokens)
        return draft
