"""One request's state inside the llama.cpp engine, from arrival to its end.

Its tokens are the prompt, then every generated token; `cached` of them are in
its slot's cells (a llama.cpp sequence id while it holds one). The scheduler
moves it between waiting, running and preempted; the slots place its cells;
the batch feeds `tokens[cached:]`; its sampler picks what comes next.

Its state has one writer per part: `place` (where its cells are) only the slots
write, `turn` (its place in the batch and in its caller's queue, paused or not)
only the scheduler (tests/backend/llamacpp/test_sequence_owners.py holds them to it).
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.common.output import SequenceOutput
from backend.constraints import CompiledConstraint
from backend.events import EventSink, GeneratedToken
from backend.llamacpp.layout import PromptLayout
from backend.llamacpp.sampling import Sampler
from backend.types import GenerationRequest


@dataclass
class Placement:
    """Where a sequence's cells are. Written only by backend.llamacpp.slots."""

    slot: int = -1
    """The llama.cpp sequence id (cache stream) it holds; -1: none."""
    cached: int = 0
    """Its first `cached` tokens are in the slot's cells."""
    needs_prefix: bool = False
    """Placed in a slot, still to look for a cached prefix before its prefill starts."""


@dataclass
class Turn:
    """Its turn in the batch and in its caller's queue. Written only by backend.llamacpp.scheduler."""

    queue_turn: int = 0
    """Its place in its caller's queue (see Scheduler._candidates)."""
    prefill_turn: int = 0
    """The prompt whose turn is lowest gets the next prefill group (round robin)."""
    admissions: int = 0
    """Times it entered the batch: 1 its first, more back from preemption."""
    admitted_step: int = 0
    """The engine step it last entered the batch: it runs a time slice before it may give way."""
    paused_steps: int = 0
    """Steps it has spent paused in the batch since then."""
    reads_slowly: bool = False
    """Paused a third of those steps: it gives way as a paused one does (see Scheduler.account)."""
    replay_until: int = 0
    """Back from preemption: output tokens below this are fed again one a step, as first computed."""
    paused_since: float | None = None
    """Its caller is not reading: it is skipped in batches, and may be preempted."""


class Sequence:
    def __init__(
        self, request: GenerationRequest, sink: EventSink, sampler: Sampler, layout: PromptLayout,
        constraint: CompiledConstraint | None = None,
    ) -> None:
        self.request = request
        self.sink = sink
        self.sampler = sampler
        self.layout = layout
        self.output = SequenceOutput(request, constraint)
        self.tokens: list[int] = list(request.prompt_token_ids)
        self.prompt_length = len(request.prompt_token_ids)
        self.place = Placement()
        self.turn = Turn()
        self.prompt_scores: list[GeneratedToken] = []
        """With prompt logprobs asked for: the prompt tokens scored so far (see prompt_logprobs)."""

    @property
    def id(self) -> str:
        return self.request.request_id

    @property
    def group(self) -> str:
        return self.request.group

    @property
    def cache_salt(self) -> str:
        """Its cells are shared only with sequences of the same cache salt (see PrefixIndex)."""
        return self.request.cache_salt

    @property
    def slot(self) -> int:
        return self.place.slot

    @property
    def cached(self) -> int:
        return self.place.cached

    @property
    def placed(self) -> bool:
        return self.place.slot >= 0

    @property
    def prefilling(self) -> bool:
        return self.place.cached < self.prompt_length

    @property
    def paused(self) -> bool:
        return self.turn.paused_since is not None

    @property
    def gives_way(self) -> bool:
        """Its caller is not reading, or reads slowly: its slot goes to any request that waits for one."""
        return self.paused or self.turn.reads_slowly

    @property
    def decodes(self) -> bool:
        """Whether it has known tokens to feed in a decoding batch."""
        return not self.paused and not self.place.needs_prefix and not self.prefilling and self.cached < len(self.tokens)

    @property
    def ready_to_prefill(self) -> bool:
        return not self.paused and not self.place.needs_prefix and self.prefilling
