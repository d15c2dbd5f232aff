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

Only the engine thread calls into this class (see backend.worker); every
public method returns the events it produced, for the worker to deliver.
"""

from __future__ import annotations

import logging
import time

import llama_cpp

from backend.common.fairness import FairnessPolicy
from backend.common.ledger import Ledger
from backend.common.output import ConstraintFailed
from backend.common.stats import CancelOrder, EngineStats
from backend.config import EngineConfig
from backend.engine import EventSink
from backend.events import ErrorEvent, ErrorKind, Event, FinishReason, TokenEvent
from backend.llamacpp.admission import Admitter
from backend.llamacpp.batch import Batch
from backend.llamacpp.cache_events import LlamaCppCacheEvents
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
from backend.worker import Output

log = logging.getLogger(__name__)


class LlamaCppCore:
    def __init__(self, model: GgufModel, config: EngineConfig) -> None:
        self.model = model
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
        self._outputs: list[Output] = []
        self.steps = 0
        self.ledger = Ledger()
        self.siblings = Siblings()
        self.admitter = Admitter(self.scheduler, self.slots, self.ledger)
        self._cache_tokens_total = config.context_length * config.max_batch_size
        self._first_token_hold_s = own.first_token_hold_ms / 1000
        self.stats = EngineStats(cache_tokens_total=self._cache_tokens_total)
        self.cache_events = LlamaCppCacheEvents(
            self.slots, "GPU" if own.gpu_layers else "CPU", config.cache_events_replay_batches
        ) if config.cache_events else None

    # -- commands (each returns the events it produced) ------------------------

    def add(self, request: GenerationRequest, sink: EventSink) -> list[Output]:
        leader, *others = [self._sequence(sample, sink) for sample in request.samples()]
        self.siblings.hold(leader, others)  # they fork from the leader once its prompt is computed
        self._queue(leader)
        return self._done()

    def _sequence(self, request: GenerationRequest, sink: EventSink) -> Sequence:
        sampler = Sampler(request.sampling, self.model, self.context_length)
        sampler.start(request.prompt_token_ids)
        layout = PromptLayout.of(len(request.prompt_token_ids), request.last_message_start, self.scheduler.batch_tokens,
                                 self.slots.exact)
        return Sequence(request, sink, sampler, layout)

    def _queue(self, seq: Sequence) -> None:
        for shed in self.scheduler.add(seq):
            self._fail(shed, self.ledger.shed(shed))

    def _group(self, request_id: str, started: bool = False) -> list[Sequence]:
        """Every sample of a request (one, unless it asked for several): running or preempted, and waiting
        too unless `started`."""
        held = self.scheduler.started() if started else self.scheduler.all()
        return [seq for seq in held if seq.group == request_id]

    def cancel(self, order: CancelOrder) -> list[Output]:
        group = self._group(order.request_id)
        if not group:
            return []  # already finished: nothing to free
        for seq in group:
            self._end(seq, FinishReason.CANCELLED)
        self.ledger.cancelled(order, self.steps, time.monotonic())
        return self._done()

    def pause(self, request_id: str) -> list[Output]:
        for seq in self._group(request_id, started=True):
            seq.paused_since = seq.paused_since or time.monotonic()
        return self._done()

    def resume(self, request_id: str) -> list[Output]:
        for seq in self._group(request_id, started=True):
            seq.paused_since = None
            self.scheduler.resumed(seq)
        return self._done()

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.slots.prefixes.ended())

    def holds_sequences(self) -> bool:
        return self.scheduler.holds_sequences()

    def expire(self) -> list[Output]:
        self._expire()
        return self._done()

    # -- one step --------------------------------------------------------------

    def step(self) -> list[Output]:
        self.steps += 1
        self._expire()
        # Before admission (see retile for when): a sequence placed now finds the tails it continues complete.
        if which := to_retile(self.slots, not self.scheduler.has_work(), self.scheduler.waiting):
            self.ledger.retiled(retile_ended(self.slots, self.batch, self.ctx, self.scheduler.batch_tokens, which))
        self.admitter.admit(self.steps)
        self.slots.compact(self.scheduler.running.values())
        feeds = self.speculator.extend(self.scheduler.next_feeds())
        self.scheduler.account(feeds, self.steps)
        if feeds:
            self._decode_and_sample(feeds)
        return self._done()

    def _expire(self) -> None:
        expired = self.scheduler.expired(time.monotonic())
        for seq in [*expired.never_started, *expired.timed_out]:
            self._end(seq, FinishReason.TIME_LIMIT)
        for seq in expired.paused_too_long:
            message = f"the caller read nothing for {self.scheduler.max_pause_s:g} s (max_pause_s)"
            self._fail(seq, ErrorEvent(message, ErrorKind.PAUSED_TOO_LONG))
        for seq in expired.queue_timed_out:
            self._fail(seq, self.ledger.timed_out(seq))

    def _decode_and_sample(self, feeds: list[Feed]) -> None:
        to_sample, to_score = fill_batch(self.batch, feeds)
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
        self._emit(seq, event)

    # -- endings and outputs -------------------------------------------------------

    def _emit(self, seq: Sequence, event: Event) -> None:
        if isinstance(event, TokenEvent) and event.tokens:
            self.ledger.generated(seq, len(event.tokens))
        self._outputs.append((seq.sink, event))

    def _end(self, seq: Sequence, reason: FinishReason) -> None:
        for sample in (seq, *self.siblings.take(seq)):  # samples still waiting for its prompt end with it
            self._emit(sample, sample.output.end(reason))
            self._release(sample)

    def _fail(self, seq: Sequence, error: ErrorEvent) -> None:
        self._emit(seq, error)
        self._release(seq)
        for sample in self.siblings.take(seq):
            sample.sampler.free()

    def _release(self, seq: Sequence) -> None:
        if seq.admissions or seq in self.scheduler.waiting:  # not a sample still waiting for its leader
            self.scheduler.remove(seq)
        self.speculator.ended(seq)
        self.slots.release(seq)
        seq.sampler.free()

    settle_later = False

    def first_token_hold_s(self) -> float:
        """The first_token_hold_ms setting, unless another request still waits for its own first token: it would
        wait too. llama.cpp's threads take every core they are given: so held, a first token reached a caller on the
        same cores 1-5 ms sooner in seven rounds of eight (bench.first_token, docs/benchmarks.md)."""
        scheduler = self.scheduler
        if scheduler.waiting or any(seq.output.first_token_at is None for seq in scheduler.running.values()):
            return 0.0
        return self._first_token_hold_s

    def _done(self) -> list[Output]:
        """The outputs of the command or step just run, settled (see settle) unless settle_later."""
        if self.settle_later:
            outputs, self._outputs = self._outputs, []
            return outputs
        return self.settle()

    def settle(self) -> list[Output]:
        """Publishes the stats snapshot (one reference assignment: atomic for readers) and the cache events,
        and hands over the outputs."""
        if self.cache_events is not None:
            self.cache_events.step_done(self.scheduler.running.values())
        self.stats = self.ledger.snapshot(
            self.scheduler.running.values(), self.scheduler.waiting, self.scheduler.preempted.values(),
            steps=self.steps, cache_tokens_total=self._cache_tokens_total, prefix_cache_entries=len(self.slots.prefixes),
            prefix_cache_tokens=self.slots.prefixes.tokens_held, **self.scheduler.occupancy(),
        )
        outputs, self._outputs = self._outputs, []
        return outputs

    def close(self) -> list[Output]:
        for seq in list(self.scheduler.all()):
            self._end(seq, FinishReason.CANCELLED)
        if self.ctx:
            self.batch.free()
            llama_cpp.llama_free(self.ctx)
            self.ctx = llama_cpp.llama_context_p(0)  # NULL, as llama.cpp has it: closed
        return self._done()
