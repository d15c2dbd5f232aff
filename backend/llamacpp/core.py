"""Continuous batching on llama.cpp's multi-sequence batch API: the engine thread's core.

The commands (add, cancel, pause, resume) and `step()`. A step, in words:
expire what is past its time, admit what the scheduler lets in (the slots place
each one's cells, from a cached prefix where they can), ask the scheduler for
this step's rows, have the batch decode them once, pick every sequence's next
token (sampling), and end the sequences that are done. The rooms:

    scheduler  who runs, what each step computes      (pure Python)
    slots      where cells live, prefix reuse, moves  (every llama_memory_seq_* call)
    admission  what the scheduler lets in, placed and counted
    batch      the rows of one llama_decode
    rows       a sequence's feed into the batch, and its rows sampled (proposals checked)
    sampling   masks, sampler chains, logprobs
    sequence   one request's state
    speculation  the proposed tokens each feed checks, and what decodes and checks teach
    (and siblings, prompt_logprobs: see each)

Only the engine thread calls into this class (see backend.worker); what its
commands and steps produce leaves through `settle()` (backend.common.core).
"""

from __future__ import annotations

import logging
import time

import llama_cpp

from backend.common.core import CoreBase
from backend.common.fairness import FairnessPolicy
from backend.common.output import ConstraintFailed
from backend.common.stats import EngineStats
from backend.config import EngineConfig
from backend.constraints import CompiledConstraint
from backend.events import ErrorEvent, ErrorKind, Event, EventSink, FinishReason, TokenEvent
from backend.llamacpp.admission import Admitter
from backend.llamacpp.batch import Batch
from backend.llamacpp.cache_events import LlamaCppCacheEvents
from backend.llamacpp.first_token_hold import FirstTokenHold
from backend.llamacpp.layout import PromptLayout
from backend.llamacpp.model import GgufModel
from backend.llamacpp.prompt_logprobs import score_rows
from backend.llamacpp.retile import retile_ended, to_retile
from backend.llamacpp.rows import RowsToSample, fill_batch, sample_rows, take_forced_run
from backend.llamacpp.sampling import Sampler, TokenPicker
from backend.llamacpp.scheduler import Feed, Scheduler
from backend.llamacpp.sequence import Sequence
from backend.llamacpp.siblings import Siblings
from backend.llamacpp.slots import Slots
from backend.llamacpp.speculation import Speculator, ThreadTuner
from backend.types import GenerationRequest

log = logging.getLogger(__name__)


class LlamaCppCore(CoreBase[Sequence]):
    def __init__(self, model: GgufModel, config: EngineConfig) -> None:
        self.model = model
        self._cache_tokens_total = config.context_length * config.max_batch_size
        super().__init__(EngineStats(cache_tokens_total=self._cache_tokens_total))
        own = config.llamacpp
        slots = config.max_batch_size + (own.prefix_cache_slots if own.prefix_cache else 0)
        tuner = ThreadTuner(own.threads, plain_row_share=model.plain_row_share)
        self.ctx = model.new_context(slots, config.context_length, own.batch_tokens, tuner.threads)
        self.context_length: int = llama_cpp.llama_n_ctx_seq(self.ctx)
        self.slots = Slots(llama_cpp.llama_get_memory(self.ctx), slots, own, self.context_length)
        self.scheduler = Scheduler(
            config.max_batch_size, own.batch_tokens, own.max_pause_s, self.context_length, FairnessPolicy(config),
            self.slots.comeback_cost,
        )
        self.batch = Batch(own.batch_tokens)
        self.speculator = Speculator(tuner, self.scheduler.max_forced)
        self.picker = TokenPicker(model, slots, max(tuner.candidates))
        self.siblings = Siblings()
        self.admitter = Admitter(self.scheduler, self.slots, self.ledger)
        self.first_token_hold = FirstTokenHold(own.first_token_hold_ms)
        self.cache_events = LlamaCppCacheEvents(
            self.slots, "GPU" if own.gpu_layers else "CPU", config.cache_events_replay_batches
        ) if config.cache_events else None

    # -- commands ----------------------------------------------------------------

    def add(self, request: GenerationRequest, sink: EventSink, constraint: CompiledConstraint | None = None) -> None:
        self.end_leftovers(request.request_id)
        leader, *others = [self._sequence(sample, sink, constraint) for sample in request.samples()]
        self.siblings.hold(leader, others)  # they fork from the leader once its prompt is computed
        self._queue(leader)

    def _sequence(self, request: GenerationRequest, sink: EventSink, constraint: CompiledConstraint | None) -> Sequence:
        sampler = Sampler(request.sampling, self.model, self.context_length)
        sampler.start(request.prompt_token_ids)
        layout = PromptLayout.of(len(request.prompt_token_ids), request.last_message_start, self.scheduler.batch_tokens,
                                 self.slots.exact)
        return Sequence(request, sink, sampler, layout, constraint)

    def _queue(self, seq: Sequence) -> None:
        for shed in self.scheduler.add(seq):
            self._fail(shed, self.ledger.shed(shed))

    def _group(self, request_id: str, started: bool = False) -> list[Sequence]:
        """Every sample of a request (one, unless it asked for several): running or preempted, and waiting
        too unless `started`."""
        held = self.scheduler.started() if started else self.scheduler.all()
        return [seq for seq in held if seq.group == request_id]

    def pause(self, request_id: str) -> None:
        now = time.monotonic()
        for seq in self._group(request_id, started=True):
            self.scheduler.pause(seq, now)

    def resume(self, request_id: str) -> None:
        for seq in self._group(request_id, started=True):
            self.scheduler.resume(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.slots.prefixes.ended())

    def holds_sequences(self) -> bool:
        return self.scheduler.holds_sequences()

    # -- one step --------------------------------------------------------------

    def step(self) -> None:
        self.first_token_hold.before_step(self.scheduler)
        self.steps += 1
        self.expire()
        # Before admission (see retile for when): a sequence placed now finds the tails it continues complete.
        if which := to_retile(self.slots, not self.scheduler.has_work(), self.scheduler.waiting):
            self.ledger.retiled(retile_ended(self.slots, self.batch, self.ctx, self.scheduler.batch_tokens, which))
        self.admitter.admit(self.steps)
        self.slots.compact(self.scheduler.running.values())
        feeds = self.speculator.extend(self.scheduler.next_feeds())
        self.scheduler.account(feeds, self.steps)
        if feeds:
            self._decode_and_sample(feeds)

    def expire(self) -> None:
        """Ends what is past its time: waiting, running and paused sequences."""
        expired = self.scheduler.expired(time.monotonic())
        for seq in [*expired.never_started, *expired.timed_out]:
            self._end(seq, FinishReason.TIME_LIMIT)
        for seq in expired.paused_too_long:
            message = f"the caller read nothing for {self.scheduler.max_pause_s:g} s (max_pause_s)"
            self._fail(seq, ErrorEvent(message, ErrorKind.PAUSED_TOO_LONG))
        for seq in expired.queue_timed_out:
            self._fail(seq, self.ledger.timed_out(seq))

    def _decode_and_sample(self, feeds: list[Feed]) -> None:
        to_sample, to_score = fill_batch(self.batch, self.slots, feeds)
        start = time.perf_counter()
        rc = self.batch.decode(self.ctx)
        if rc != 0:
            for feed in feeds:
                self._fail(feed.sequence, ErrorEvent(f"llama_decode failed with status {rc}"))
            return
        for seq, start, rows in to_score:  # before sampling: the scores go out with the first token
            score_rows(self.ctx, self.model, seq, start, rows)
        seconds, threads = time.perf_counter() - start, self.speculator.threads
        self.picker.fill_masks([(c, e.sequence.slot) for e in to_sample if (c := e.sequence.output.constraint) is not None])
        checks: list[tuple[RowsToSample, int]] = []
        for entry in to_sample:
            self._sample_guarded(entry, checks)
        self.speculator.learn(feeds, self.batch.logit_rows, seconds, checks)
        if self.speculator.threads != threads:
            llama_cpp.llama_set_n_threads(self.ctx, self.speculator.threads, self.speculator.threads)

    def _sample_guarded(self, entry: RowsToSample, checks: list[tuple[RowsToSample, int]]) -> None:
        """Samples the entry's rows, its proposals checked (added to `checks`); a fault ends it alone."""
        seq = entry.sequence
        try:
            self._sample(entry, checks)
        except ConstraintFailed as exc:  # the caller's constraint, not the engine, failed
            self._fail(seq, ErrorEvent(str(exc), ErrorKind.CONSTRAINT_FAILED))
        except Exception as exc:  # one sequence's fault must not end the others
            log.exception("sampling failed for %s", seq.id)
            self._fail(seq, ErrorEvent(f"sampling failed: {exc}"))

    def _sample(self, entry: RowsToSample, checks: list[tuple[RowsToSample, int]]) -> None:
        seq, output = entry.sequence, entry.sequence.output
        output.step = self.steps
        if self.siblings.holds(seq):  # its prompt is computed: its other samples fork from this row
            self._fork(seq, entry.rows[0])
        accepted = sample_rows(entry, self.ctx, self.picker, self.slots, self.model.eos_token_set, self._take)
        if entry.proposed:
            self.ledger.checked(len(entry.proposed), accepted)
            checks.append((entry, accepted))
        take_forced_run(seq, self.scheduler.max_forced, self.picker, self.model.eos_token_set, self._take)
        if output.finished:
            self._release(seq)
        elif len(seq.tokens) >= self.context_length:  # prompt + output now fill the context
            self._end(seq, FinishReason.CONTEXT_LIMIT)

    def _fork(self, leader: Sequence, row: int) -> None:
        """Starts the leader's other samples from its prompt cells and this row's logits (see
        backend.llamacpp.siblings); one finding no free batch place queues instead."""
        for seq in self.siblings.take(leader):
            if len(self.scheduler.running) >= self.scheduler.max_batch_size:
                self._queue(seq)
                continue
            self.admitter.fork(leader, seq, self.steps)
            if seq.output.constraint is not None:
                self.picker.fill_masks([(seq.output.constraint, seq.slot)])
            self._sample_guarded(RowsToSample(seq, [row], ()), [])

    def _take(self, seq: Sequence, token: int, event: Event) -> None:
        seq.tokens.append(token)
        self._emit_for(seq, event)

    # -- endings and outputs -------------------------------------------------------

    def _emit_for(self, seq: Sequence, event: Event) -> None:
        if isinstance(event, TokenEvent) and event.tokens:
            self.ledger.generated(seq, len(event.tokens))
        self.first_token_hold.note(event)
        self._emit(seq.sink, event)

    def _end(self, seq: Sequence, reason: FinishReason) -> None:
        for sample in (seq, *self.siblings.take(seq)):  # samples still waiting for its prompt end with it
            self._emit_for(sample, sample.output.end(reason))
            self._release(sample)

    def _fail(self, seq: Sequence, error: ErrorEvent) -> None:
        self._emit_for(seq, error)
        self._release(seq)
        for sample in self.siblings.take(seq):
            sample.sampler.free()

    def _release(self, seq: Sequence) -> None:
        if seq.turn.admissions or seq in self.scheduler.waiting:  # not a sample still waiting for its leader
            self.scheduler.remove(seq)
        self.speculator.ended(seq)
        self.slots.release(seq)
        seq.sampler.free()

    def _settle(self) -> None:
        """Publishes the stats snapshot and the cache events."""
        if self.cache_events is not None:
            self.cache_events.step_done(self.scheduler.running.values())
        self.stats = self.ledger.snapshot(
            self.scheduler.running.values(), self.scheduler.waiting, self.scheduler.preempted.values(),
            steps=self.steps, cache_tokens_total=self._cache_tokens_total, prefix_cache_entries=len(self.slots.prefixes),
            prefix_cache_tokens=self.slots.prefixes.tokens_held, **self.scheduler.occupancy(),
            cache_events_sequence=self.cache_events.hub.last_sequence if self.cache_events is not None else 0,
        )

    def close(self) -> None:
        for seq in list(self.scheduler.all()):
            self._end(seq, FinishReason.CANCELLED)
        if self.ctx:
            self.batch.free()
            llama_cpp.llama_free(self.ctx)
            self.ctx = llama_cpp.llama_context_p(0)  # NULL, as llama.cpp has it: closed
