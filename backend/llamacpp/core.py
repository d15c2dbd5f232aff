"""Continuous batching on llama.cpp's multi-sequence batch API: the engine thread's core.

The commands (add, cancel, pause, resume) and `step()`. A step, in words:
expire what is past its time, admit what the scheduler lets in (the slots place
each one's cells, from a cached prefix where they can), ask the scheduler for
this step's rows, have the batch decode them once, pick every sequence's next
token (sampling), and end the sequences that are done. The rooms:

    scheduler  who runs, what each step computes      (pure Python)
    slots      where cells live, prefix reuse, moves  (every llama_memory_seq_* call)
    batch      the rows of one llama_decode
    sampling   masks, sampler chains, logprobs
    sequence   one request's state

Only the engine thread calls into this class (see backend.worker); every
public method returns the events it produced, for the worker to deliver.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import llama_cpp

from backend.config import EngineConfig
from backend.engine import CancelOrder, EngineCounters, EngineStats, EventSink
from backend.fairness import FairnessPolicy
from backend.llamacpp.batch import Batch
from backend.llamacpp.layout import PromptLayout
from backend.llamacpp.model import GgufModel
from backend.llamacpp.prompt_logprobs import score_rows, wants_prompt_logprobs
from backend.llamacpp.sampling import Sampler, TokenPicker
from backend.llamacpp.scheduler import Feed, Scheduler
from backend.llamacpp.sequence import Sequence
from backend.llamacpp.siblings import Siblings
from backend.llamacpp.slots import Slots
from backend.llamacpp.speculation import passes_for
from backend.llamacpp.threads import ThreadTuner
from backend.sequence import ConstraintFailed
from backend.types import ErrorEvent, ErrorKind, Event, FinishReason, GenerationRequest, TokenEvent
from backend.worker import Output

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _ToSample:
    sequence: Sequence
    rows: list[int]
    """The batch rows with logits: after its last known token, then after each proposed one."""
    proposed: tuple[int, ...]


class LlamaCppCore:
    def __init__(self, model: GgufModel, config: EngineConfig) -> None:
        self.model = model
        self.config = config
        own = config.llamacpp
        slots = config.max_batch_size + (own.prefix_cache_slots if own.prefix_cache else 0)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = config.context_length * slots
        params.n_batch = params.n_ubatch = own.batch_tokens
        params.n_seq_max = slots
        self.threads = ThreadTuner(own.threads)
        params.n_threads = params.n_threads_batch = self.threads.threads
        # A cache per sequence keeps each sequence's attention separate, so greedy output does
        # not depend on what else is in the batch. llama.cpp is fast with it only while a batch's
        # sequences have ascending, contiguous ids (see Slots and docs/benchmarks.md).
        params.kv_unified = False
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(model.ptr, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.context_length: int = llama_cpp.llama_n_ctx_seq(self.ctx)
        self.slots = Slots(llama_cpp.llama_get_memory(self.ctx), slots, own.prefix_cache)
        self.scheduler = Scheduler(
            config.max_batch_size, own.batch_tokens, own.max_pause_s, self.context_length, FairnessPolicy(config),
            self.slots.comeback_cost,
        )
        self.batch = Batch(own.batch_tokens)
        self.picker = TokenPicker(model, slots, max(self.threads.candidates))
        self.scheduler.costs = self.threads.current_costs
        # Cap the forced tokens taken at once, so every sequence's feed fits a batch.
        self._max_forced = max(0, min(16, own.batch_tokens // config.max_batch_size - 1))
        self._outputs: list[Output] = []
        self.steps = 0
        self.counters = EngineCounters()
        self.siblings = Siblings()
        self._cache_tokens_total = config.context_length * config.max_batch_size
        self.stats = EngineStats(cache_tokens_total=self._cache_tokens_total)

    # -- commands (each returns the events it produced) ------------------------

    def add(self, request: GenerationRequest, sink: EventSink) -> list[Output]:
        leader, *others = [self._sequence(sample, sink) for sample in request.samples()]
        self.siblings.hold(leader, others)  # they fork from the leader once its prompt is computed
        self._queue(leader)
        return self._done()

    def _sequence(self, request: GenerationRequest, sink: EventSink) -> Sequence:
        sampler = Sampler(request.sampling, self.model, self.context_length)
        sampler.start(request.prompt_token_ids)
        layout = PromptLayout.of(len(request.prompt_token_ids), request.last_message_start, self.scheduler.batch_tokens)
        return Sequence(request, sink, sampler, layout)

    def _queue(self, seq: Sequence) -> None:
        for shed in self.scheduler.add(seq):
            self.scheduler.policy.tallies.of(shed).shed_total += 1
            self._fail(shed, "the server is full and this request gave its queue place to a caller under its share "
                       "or of higher priority; retry later or elsewhere", ErrorKind.SHED)

    def _group(self, request_id: str) -> list[Sequence]:
        """Every started or waiting sample of a request (one, unless it asked for several)."""
        return [seq for seq in self.scheduler.all() if seq.group == request_id]

    def cancel(self, order: CancelOrder) -> list[Output]:
        group = self._group(order.request_id)
        if not group:
            return []  # already finished: nothing to free
        for seq in group:
            self._end(seq, FinishReason.CANCELLED)
        self.counters.cancelled(order, self.steps, time.monotonic())
        return self._done()

    def pause(self, request_id: str) -> list[Output]:
        for seq in self._group(request_id):
            if seq.id in self.scheduler.running or seq.id in self.scheduler.preempted:
                if not seq.paused:
                    seq.paused_since = time.monotonic()
        return self._done()

    def resume(self, request_id: str) -> list[Output]:
        for seq in self._group(request_id):
            if seq.id in self.scheduler.running or seq.id in self.scheduler.preempted:
                seq.paused_since = None
                self.scheduler.resumed(seq)
        return self._done()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def holds_sequences(self) -> bool:
        return self.scheduler.holds_sequences()

    def expire(self) -> list[Output]:
        self._expire()
        return self._done()

    # -- one step --------------------------------------------------------------

    def step(self) -> list[Output]:
        self.steps += 1
        self._expire()
        self._admit()
        self._take_prefixes()
        self.slots.compact(self.scheduler.running.values())
        feeds = self.scheduler.next_feeds()
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
            self._fail(seq, message, ErrorKind.PAUSED_TOO_LONG)
        for seq in expired.queue_timed_out:
            self.scheduler.policy.tallies.of(seq).queue_timeouts_total += 1
            message = f"not started within its queue_timeout_ms ({seq.request.scheduling.queue_timeout_s * 1000:g} ms)"
            self._fail(seq, message, ErrorKind.QUEUE_TIMEOUT)

    def _admit(self) -> None:
        tallies = self.scheduler.policy.tallies
        for admission in self.scheduler.admit(self.steps):
            victim, seq = admission.preempting, admission.sequence
            if victim is not None:
                self.slots.vacate(victim, returning=True)
                self.counters.preempted_total += 1
                tallies.of(victim).preempted_total += 1
                why = "paused" if victim.paused else f"caller {victim.request.scheduling.caller!r} over its share"
                if victim.request.scheduling.priority < seq.request.scheduling.priority:
                    why = f"priority {victim.request.scheduling.priority} < {seq.request.scheduling.priority}"
                log.info("preempted %s (%s, %d tokens) for %s", victim.id, why, len(victim.tokens), seq.id)
            if seq.admissions == 1:
                seq.output.mark_admitted()
                self.counters.started(seq.prompt_length)
                tallies.of(seq).prompt_tokens_total += seq.prompt_length
            shared = self.slots.place(seq, self.scheduler.running.values())
            if shared is not None:
                self._count_prefix(seq, shared)

    def _take_prefixes(self) -> None:
        for seq, shared in self.slots.take_prefixes(self.scheduler.running.values()):
            self._count_prefix(seq, shared)

    def _count_prefix(self, seq: Sequence, shared: int) -> None:
        """A placed sequence took `shared` cached tokens and computes the rest."""
        if seq.admissions == 1:
            seq.output.cached_tokens = min(shared, seq.prompt_length)
            self.counters.cached_prompt_tokens_total += seq.output.cached_tokens
        else:  # back from preemption: what the cache no longer held is computed again
            self.counters.recomputed_tokens_total += len(seq.tokens) - shared

    def _decode_and_sample(self, feeds: list[Feed]) -> None:
        self.batch.clear()
        to_sample = []
        to_score = []  # (sequence, first position, rows): prompt rows whose logits score the prompt
        for feed in feeds:
            seq = feed.sequence
            tokens = [*seq.tokens[seq.cached : seq.cached + feed.count], *feed.proposed]
            complete = seq.cached + feed.count == len(seq.tokens)  # sample only once every known token is in
            logit_rows = 1 + len(feed.proposed) if complete else 0
            scores = feed.prefill and wants_prompt_logprobs(seq)
            rows = self.batch.add(seq.slot, seq.cached, tokens, logit_rows=len(tokens) if scores else logit_rows)
            if scores:
                to_score.append((seq, seq.cached, rows))
                rows = rows[len(rows) - logit_rows :]
            seq.cached += feed.count  # the proposed tokens' cells count once accepted
            if rows:
                to_sample.append(_ToSample(seq, rows, feed.proposed))
        start = time.perf_counter()
        rc = self.batch.decode(self.ctx)
        if rc != 0:
            for feed in feeds:
                self._fail(feed.sequence, f"llama_decode failed with status {rc}")
            return
        for seq, start, rows in to_score:  # before sampling: the scores go out with the first token
            score_rows(self.ctx, self.model, seq, start, rows)
        if not feeds[0].prefill:
            rows = [feed.count + len(feed.proposed) for feed in feeds]
            self._decoded(passes_for(rows), sum(rows), time.perf_counter() - start)
        constrained = [entry.sequence for entry in to_sample if entry.sequence.output.constraint is not None]
        self.picker.fill_masks([(seq.output.constraint, seq.slot) for seq in constrained])
        for entry in to_sample:
            self._sample_guarded(entry)

    def _sample_guarded(self, entry: _ToSample) -> None:
        seq = entry.sequence
        try:
            self._sample(entry)
        except ConstraintFailed as exc:  # the caller's constraint, not the engine, failed
            self._fail(seq, str(exc), ErrorKind.CONSTRAINT_FAILED)
        except Exception as exc:  # one sequence's fault must not end the others
            log.exception("sampling failed for %s", seq.id)
            self._fail(seq, f"sampling failed: {exc}")

    def _sample(self, entry: _ToSample) -> None:
        seq, output = entry.sequence, entry.sequence.output
        output.step = self.steps
        if self.siblings.holds(seq):  # its prompt is computed: its other samples fork from this row
            self._fork(seq, entry.rows[0])
        accepted = self._check_proposals(entry)
        if entry.proposed:
            self.counters.draft_tokens_total += len(entry.proposed)
            self.counters.accepted_draft_tokens_total += accepted
        if not output.finished and output.constraint is not None:
            for forced in output.constraint.forced_tokens(self._max_forced):  # no choice left: skip sampling
                seq.sampler.accept(forced)
                self._take(seq, forced, output.on_token(self.picker.forced(forced), self._is_eos(forced)))
                if output.finished:
                    break
        if output.finished:
            self._release(seq)
        elif len(seq.tokens) >= self.context_length:  # prompt + output now fill the context
            self._end(seq, FinishReason.CONTEXT_LIMIT)

    def _fork(self, leader: Sequence, row: int) -> None:
        """Starts the leader's other samples from its prompt cells and this row's logits (see
        backend.llamacpp.siblings); one finding no free batch place queues instead."""
        tallies = self.scheduler.policy.tallies
        for seq in self.siblings.take(leader):
            if len(self.scheduler.running) >= self.scheduler.max_batch_size:
                self._queue(seq)
                continue
            self.slots.fork(leader, seq, self.scheduler.running.values())
            self.scheduler.join(seq, self.steps)
            seq.paused_since = leader.paused_since
            seq.output.mark_admitted()
            self.counters.started(seq.prompt_length)
            tallies.of(seq).prompt_tokens_total += seq.prompt_length
            seq.output.cached_tokens = seq.prompt_length
            self.counters.cached_prompt_tokens_total += seq.prompt_length
            if seq.output.constraint is not None:
                self.picker.fill_masks([(seq.output.constraint, seq.slot)])
            self._sample_guarded(_ToSample(seq, [row], ()))

    def _decoded(self, passes: int, rows: int, seconds: float) -> None:
        """A decode step's time, for the thread count and the cost model the planner weighs."""
        before = self.threads.threads
        after = self.threads.record(passes, rows, seconds)
        if after != before:
            llama_cpp.llama_set_n_threads(self.ctx, after, after)
        self.scheduler.costs = self.threads.current_costs

    def _check_proposals(self, entry: _ToSample) -> int:
        """Samples row after row, accepting each proposed token while it is what sampling picks there
        (the token picked at the first row that disagrees, or after the last, is output too); the cells
        of proposals not accepted are dropped. Returns how many proposals were accepted."""
        seq, output, proposed = entry.sequence, entry.sequence.output, entry.proposed
        output.draft_tokens += len(proposed)
        accepted = 0
        try:
            for i, row in enumerate(entry.rows):
                if i and output.constraint is not None:  # its matcher has taken the row before's token
                    self.picker.fill_masks([(output.constraint, seq.slot)])
                token = self.picker.pick(self.ctx, row, seq.slot, seq.sampler, output)
                is_proposal = i < len(proposed) and token.token_id == proposed[i]
                self._take(seq, token.token_id, output.on_token(token, self._is_eos(token.token_id), is_proposal))
                if output.finished or not is_proposal:
                    break
                accepted += 1
        finally:
            if proposed:
                self.slots.keep_cells(seq, seq.cached + accepted)
                seq.draft.checked(len(proposed), accepted)
        return accepted

    def _take(self, seq: Sequence, token: int, event: Event) -> None:
        seq.tokens.append(token)
        self._emit(seq, event)

    def _is_eos(self, token: int) -> bool:
        return token in self.model.eos_token_set

    # -- endings and outputs -------------------------------------------------------

    def _emit(self, seq: Sequence, event: Event) -> None:
        if isinstance(event, TokenEvent) and event.tokens:
            self.scheduler.policy.tallies.of(seq).generated_tokens_total += len(event.tokens)
        self._outputs.append((seq.sink, event))

    def _end(self, seq: Sequence, reason: FinishReason) -> None:
        for sample in (seq, *self.siblings.take(seq)):  # samples still waiting for its prompt end with it
            self._emit(sample, sample.output.end(reason))
            self._release(sample)

    def _fail(self, seq: Sequence, message: str, kind: ErrorKind = ErrorKind.ENGINE_FAILURE) -> None:
        self._emit(seq, ErrorEvent(message, kind))
        self._release(seq)
        for sample in self.siblings.take(seq):
            sample.sampler.free()

    def _release(self, seq: Sequence) -> None:
        if seq.admissions or seq in self.scheduler.waiting:  # not a sample still waiting for its leader
            self.scheduler.remove(seq)
        if seq.placed:
            self.slots.vacate(seq)
        elif seq.admissions:  # preempted: its kept cells need not wait for it
            self.slots.prefixes.settle(seq.id)
        seq.sampler.free()

    def _done(self) -> list[Output]:
        """Publishes the stats snapshot (one reference assignment: atomic for readers) and hands over
        the outputs of the command or step just run."""
        scheduler = self.scheduler
        self.stats = self.counters.snapshot(
            steps=self.steps,
            running_sequences=len(scheduler.running),
            preempted_sequences=len(scheduler.preempted),
            paused_sequences=sum(seq.paused for seq in (*scheduler.running.values(), *scheduler.preempted.values())),
            queued_requests=len(scheduler.waiting),
            cache_tokens_used=sum(seq.cached for seq in scheduler.running.values()),
            cache_tokens_total=self._cache_tokens_total,
            prefix_cache_entries=len(self.slots.prefixes),
            prefix_cache_tokens=self.slots.prefixes.tokens_held,
            callers=scheduler.policy.tallies.snapshot(scheduler.running.values(), scheduler.waiting,
                                                      scheduler.preempted.values()),
        )
        outputs, self._outputs = self._outputs, []
        return outputs

    def close(self) -> list[Output]:
        for seq in list(self.scheduler.all()):
            self._end(seq, FinishReason.CANCELLED)
        if self.ctx:
            self.batch.free()
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        return self._done()
