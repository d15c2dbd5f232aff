"""Continuous batching on llama.cpp's multi-sequence batch API.

Each step runs one `llama_decode`: the next group of rows of the first prompt
still to prefill (grouped by its PromptLayout, so its numbers never depend on
what else runs or is cached), or else the next token of every decoding
sequence, and samples every sequence that produced logits with its own sampler
chain. A new request joins at the next step; a burst is prefilled one prompt
group a step, the prompts taking turns in arrival order, and decoding waits at
most batch_tokens prompt rows.

Prefix reuse: a finished sequence leaves its cells in its slot (one llama.cpp
sequence id, one cache stream), indexed by token (see PrefixIndex). A new
request starts from the longest prefix of its prompt that any slot holds and
its layout can take as computed, copied across streams and trimmed, and
prefills only the rest; a request whose prefix a neighbour is computing right
now waits a step or two and copies it.
Idle prefixes live in free slots, so they never block a live request.

Preemption: when a request waits for a slot and a paused sequence (its caller
is not reading) holds one, that sequence gives up its slot, its cells staying
behind as a cached prefix; it keeps its tokens and sampler, and comes back,
recomputing what the cache no longer holds, once its caller reads again.

Only the engine thread calls into this class (see backend.worker); every
public method returns the events it produced, for the worker to deliver.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import heapq
import itertools
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Iterable

import llama_cpp
import llguidance
import llguidance.numpy
import numpy as np

from backend.constraints import apply_bitmask
from backend.engine import EngineStats, EventSink
from backend.llamacpp.layout import PromptLayout
from backend.llamacpp.model import GgufModel
from backend.llamacpp.prefix_cache import PrefixIndex
from backend.llamacpp.sampling import build_sampler_chain
from backend.logprobs import with_logprobs
from backend.sequence import ConstraintFailed, SequenceOutput
from backend.tokens import common_prefix
from backend.types import ErrorEvent, Event, FinishReason, GeneratedToken, GenerationRequest
from backend.worker import CancelOrder, Output

log = logging.getLogger(__name__)

# Shorter shared prefixes are computed again: copying a cache stream costs about as much.
MIN_REUSE_TOKENS = 16
# A sequence back from preemption takes its own cells as they are, but for its last 2 tokens:
# llama.cpp computes a token alone with other kernels than several (see backend.llamacpp.layout).
RECOMPUTED_TAIL = 2


def default_threads() -> int:
    """Every core but one: llama.cpp's threads wait for each other at every operation, so a
    core taken by the server's own gRPC work stalls them all (measured: docs/benchmarks.md)."""
    return max(1, (os.cpu_count() or 1) - 1)


@dataclass(frozen=True)
class LlamaCppConfig:
    context_length: int = 2048
    """Most tokens one sequence may hold (prompt and output)."""
    max_batch_size: int = 8
    """Sequences decoded together; each has its own slice of the KV cache."""
    threads: int = 0
    """CPU threads for llama.cpp; 0 means default_threads() (every core but one)."""
    batch_tokens: int = 512
    """Most tokens in one llama_decode call (bounds a prefill chunk)."""
    gpu_layers: int = 0
    prefix_cache: bool = True
    """Start each prompt from the longest cached prefix (greedy output is unchanged)."""
    prefix_cache_slots: int = 2
    """Cache streams beyond max_batch_size that only keep prefixes (context_length cells each)."""
    max_pause_s: float = 300.0
    """A sequence whose caller has not read for this long ends with an error."""
    fail_requests_with_prefix: str = ""
    """Test-only fault injection: sampling raises for request ids with this prefix."""


def _past(deadline: float | None, now: float) -> bool:
    return deadline is not None and now >= deadline


class _Sequence:
    def __init__(
        self, request: GenerationRequest, sink: EventSink, sampler: llama_cpp.llama_sampler_p, layout: PromptLayout
    ):
        self.request = request
        self.layout = layout
        self.sink = sink
        self.sampler = sampler
        self.output = SequenceOutput(request)
        self.tokens: list[int] = list(request.prompt_token_ids)  # the prompt, then every generated token
        self.prompt_length = len(request.prompt_token_ids)
        self.slot = -1  # its llama.cpp sequence id while it holds one
        self.cached = 0  # tokens[:cached] are in the slot's cache
        self.replay_until = 0  # back from preemption: output tokens to feed again, one a step, as first computed
        self.needs_prefix = False  # to look for a cached prefix before its prefill starts
        self.admissions = 0
        self.prefill_turn = 0  # the prompt waiting longest for a prefill group goes next (round robin)
        self.paused_since: float | None = None  # the caller is not reading: skip it in batches

    @property
    def prefilling(self) -> bool:
        return self.cached < self.prompt_length

    @property
    def paused(self) -> bool:
        return self.paused_since is not None

    @property
    def id(self) -> str:
        return self.request.request_id


class LlamaCppCore:
    def __init__(self, model: GgufModel, config: LlamaCppConfig) -> None:
        if config.max_batch_size > config.batch_tokens:
            raise ValueError("batch_tokens must be at least max_batch_size")
        self.model = model
        self.config = config
        self.slots = config.max_batch_size + (config.prefix_cache_slots if config.prefix_cache else 0)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = config.context_length * self.slots
        params.n_batch = params.n_ubatch = config.batch_tokens
        params.n_seq_max = self.slots
        params.n_threads = params.n_threads_batch = config.threads or default_threads()
        # A cache per sequence keeps each sequence's attention separate, so greedy output does
        # not depend on what else is in the batch. llama.cpp is fast with it only while a batch's
        # sequences have ascending, contiguous ids (see _decoding_batch and docs/benchmarks.md).
        params.kv_unified = False
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(model.ptr, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.context_length: int = llama_cpp.llama_n_ctx_seq(self.ctx)
        self._memory = llama_cpp.llama_get_memory(self.ctx)
        self._batch = llama_cpp.llama_batch_init(config.batch_tokens, 0, 1)
        self._free_slots = list(range(self.slots))  # a heap: the lowest slot goes first
        self._prefixes = PrefixIndex()  # what free slots still hold
        self._waiting: collections.deque[tuple[GenerationRequest, EventSink]] = collections.deque()
        self._running: dict[str, _Sequence] = {}
        self._preempted: dict[str, _Sequence] = {}  # in preemption order: the first comes back first
        self._outputs: list[Output] = []
        self.steps = 0
        self._prompt_rows_since_decode = 0
        self._turns = itertools.count()
        self.stats = EngineStats(cache_tokens_total=config.context_length * config.max_batch_size)
        # One bitmask row per slot, filled for every constrained sequence about to be sampled.
        self._bitmask = llguidance.numpy.allocate_token_bitmask(self.slots, model.vocab_size)
        # Mask threads must not compete with llama.cpp's: only cores it leaves free fill in parallel.
        spare_cores = (os.cpu_count() or 1) - params.n_threads
        self._mask_executor = llguidance.LLExecutor(spare_cores) if spare_cores >= 2 else None
        # Cap the forced tokens taken at once, so every sequence's feed fits a batch.
        self._max_forced = max(0, min(16, config.batch_tokens // config.max_batch_size - 1))

    # -- commands (each returns the events it produced) ------------------------

    def add(self, request: GenerationRequest, sink: EventSink) -> list[Output]:
        self._waiting.append((request, sink))
        self._publish()
        return self._take_outputs()

    def cancel(self, order: CancelOrder | str) -> list[Output]:
        if isinstance(order, str):
            order = CancelOrder(order, time.monotonic(), self.steps)
        seq = self._running.get(order.request_id) or self._preempted.get(order.request_id)
        if seq is not None:
            self._end(seq, FinishReason.CANCELLED)
        elif not self._end_waiting(order.request_id, FinishReason.CANCELLED):
            return []  # already finished: nothing to free
        latency_steps = self.steps - order.issued_at_step
        self.stats = dataclasses.replace(
            self.stats,
            cancelled_total=self.stats.cancelled_total + 1,
            last_cancel_latency_steps=latency_steps,
            last_cancel_latency_s=time.monotonic() - order.issued_at,
            max_cancel_latency_steps=max(self.stats.max_cancel_latency_steps, latency_steps),
        )
        self._publish()
        return self._take_outputs()

    def pause(self, request_id: str) -> list[Output]:
        seq = self._running.get(request_id) or self._preempted.get(request_id)
        if seq is not None and not seq.paused:
            seq.paused_since = time.monotonic()
        self._publish()
        return []

    def resume(self, request_id: str) -> list[Output]:
        seq = self._running.get(request_id) or self._preempted.get(request_id)
        if seq is not None:
            seq.paused_since = None
        self._publish()
        return []

    def has_work(self) -> bool:
        return self._has_candidate() or any(not seq.paused for seq in self._running.values())

    def holds_sequences(self) -> bool:
        return bool(self._waiting or self._running or self._preempted)

    def expire(self) -> list[Output]:
        self._expire(time.monotonic())
        self._publish()
        return self._take_outputs()

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def cache_cells_used(self) -> int:
        return sum(seq.cached for seq in self._running.values())

    # -- one step --------------------------------------------------------------

    def step(self) -> list[Output]:
        self.steps += 1
        self._expire(time.monotonic())
        self._admit()
        self._take_prefixes()
        self._compact()
        scheduled = self._prompt_batch()
        if scheduled:
            self._prompt_rows_since_decode += self._batch.n_tokens
        else:
            scheduled = self._decoding_batch()
            self._prompt_rows_since_decode = 0
        if scheduled:
            self._decode_and_sample(scheduled)
        self._publish()
        return self._take_outputs()

    def _decode_and_sample(self, scheduled: list[tuple[_Sequence, int | None]]) -> None:
        rc = llama_cpp.llama_decode(self.ctx, self._batch)
        if rc != 0:
            for seq, _ in scheduled:
                self._fail(seq, f"llama_decode failed with status {rc}")
            return
        self._fill_constraint_masks(seq for seq, index in scheduled if index is not None)
        for seq, logits_index in scheduled:
            if logits_index is None or seq.id not in self._running:
                continue
            try:
                self._sample(seq, logits_index)
            except ConstraintFailed as exc:  # the caller's constraint, not the engine, failed
                self._fail(seq, str(exc), constraint_failed=True)
            except Exception as exc:  # one sequence's fault must not end the others
                log.exception("sampling failed for %s", seq.id)
                self._fail(seq, f"sampling failed: {exc}")

    def _expire(self, now: float) -> None:
        for request, _ in [entry for entry in self._waiting if _past(entry[0].end_by, now)]:
            self._end_waiting(request.request_id, FinishReason.TIME_LIMIT)  # never started
        for seq in [*self._running.values(), *self._preempted.values()]:
            if seq.output.deadline_passed(now):
                self._end(seq, FinishReason.TIME_LIMIT)
            elif seq.paused and now - seq.paused_since >= self.config.max_pause_s:
                message = f"the caller read nothing for {self.config.max_pause_s:g} s (max_pause_s)"
                self._fail(seq, message, paused_too_long=True)

    # -- admission and preemption ------------------------------------------------

    def _has_candidate(self) -> bool:
        return bool(self._waiting) or any(not seq.paused for seq in self._preempted.values())

    def _admit(self) -> None:
        """Starts waiting work, oldest first: preempted sequences whose callers read again, then new requests."""
        while self._has_candidate():
            if len(self._running) >= self.config.max_batch_size and not self._preempt_a_paused_sequence():
                return
            back = next((seq for seq in self._preempted.values() if not seq.paused), None)
            if back is not None:
                del self._preempted[back.id]
                self._start(back)
            else:
                self._start(self._new_sequence(*self._waiting.popleft()))

    def _new_sequence(self, request: GenerationRequest, sink: EventSink) -> _Sequence:
        chain = build_sampler_chain(request.sampling, self.model.vocab, self.model.vocab_size, self.context_length)
        layout = PromptLayout.of(len(request.prompt_token_ids), request.last_message_start, self.config.batch_tokens)
        seq = _Sequence(request, sink, chain, layout)
        if request.sampling.penalized or request.sampling.dry_on:  # they look back into the prompt too
            for token in request.prompt_token_ids:
                llama_cpp.llama_sampler_accept(seq.sampler, token)
        seq.output.mark_admitted()
        self.stats = dataclasses.replace(
            self.stats,
            started_total=self.stats.started_total + 1,
            prompt_tokens_total=self.stats.prompt_tokens_total + len(request.prompt_token_ids),
        )
        return seq

    def _preempt_a_paused_sequence(self) -> bool:
        """Frees the slot of the sequence paused longest; its cells stay behind as a cached prefix."""
        paused = [seq for seq in self._running.values() if seq.paused]
        if not paused:
            return False
        seq = min(paused, key=lambda s: s.paused_since)
        self._vacate(seq)
        self._preempted[seq.id] = seq
        self.stats = dataclasses.replace(self.stats, preempted_total=self.stats.preempted_total + 1)
        log.info("preempted %s (paused, %d tokens) for a waiting request", seq.id, len(seq.tokens))
        return True

    def _start(self, seq: _Sequence) -> None:
        """Gives a sequence a free slot (see _pick_slot), using in place the prefix that slot holds if it is the best."""
        source, shared = self._best_prefix(seq)
        slot = self._pick_slot(source)
        self._free_slots.remove(slot)
        heapq.heapify(self._free_slots)
        seq.slot, seq.cached, seq.needs_prefix, seq.replay_until = slot, 0, True, len(seq.tokens)
        seq.admissions += 1
        seq.prefill_turn = next(self._turns)
        self._running[seq.id] = seq
        if source == slot:
            self._prefixes.drop(slot)
            self._reuse(seq, slot, shared)
        elif slot in self._prefixes:
            self._clear_for_reuse(slot)
            llama_cpp.llama_memory_seq_rm(self._memory, slot, -1, -1)

    def _pick_slot(self, source: int | None) -> int:
        """A free slot that keeps the live sequences contiguous (a hole between them, else one beside
        them); among those, the one holding the best prefix, else an empty one, else the least
        recently used prefix's."""
        live = [seq.slot for seq in self._running.values()]
        candidates = self._free_slots
        if live:
            low, high = min(live), max(live)
            holes = [slot for slot in self._free_slots if low < slot < high]
            beside = [slot for slot in self._free_slots if slot in (low - 1, high + 1)]
            candidates = holes or beside or self._free_slots
        if source in candidates and source in self._prefixes:
            return source
        return self._prefixes.victim(candidates)

    def _take_prefixes(self) -> None:
        """Each new sequence starts from the best cached prefix, unless a neighbour is computing a longer one."""
        for seq in sorted((s for s in self._running.values() if s.needs_prefix), key=lambda s: s.slot):
            source, shared = self._best_prefix(seq)
            if self._computing_longer_prefix(seq, shared):
                continue  # copy it once computed, a step or two from now
            if source is None:
                self._prefix_taken(seq, 0)
            else:
                self._reuse(seq, source, shared)

    def _best_prefix(self, seq: _Sequence) -> tuple[int | None, int]:
        """The slot holding the most reusable computed prefix of the sequence's tokens (idle or live), and its length."""
        if not self.config.prefix_cache:
            return None, 0
        candidates = list(self._prefixes.matches(seq.tokens, seq.id))
        for other in self._running.values():  # a live sequence's prompt cells (see PrefixIndex)
            computed = min(other.cached, other.prompt_length)
            if other is not seq and not other.needs_prefix and computed >= MIN_REUSE_TOKENS:
                common = common_prefix(other.tokens[:computed], seq.tokens)
                candidates.append((other.slot, common, other.layout.tiled_until))
        best: tuple[int | None, int] = (None, 0)
        for slot, common, tiled_until in candidates:
            rows = self._reusable(seq, common, tiled_until)
            if rows > best[1]:
                best = (slot, rows)
        return best if best[1] >= MIN_REUSE_TOKENS else (None, 0)

    @staticmethod
    def _reusable(seq: _Sequence, common: int, tiled_until: int | None) -> int:
        """Rows of `common` cached ones the sequence takes: its own (tiled_until None) as they
        are but for the last RECOMPUTED_TAIL, others' as far as its prompt layout allows."""
        if tiled_until is not None:
            return seq.layout.reusable(common, tiled_until)
        rows = min(common, len(seq.tokens) - RECOMPUTED_TAIL)
        return seq.layout.reusable(rows, seq.layout.tiled_until) if rows < seq.prompt_length else rows

    def _computing_longer_prefix(self, seq: _Sequence, available: int) -> bool:
        if not self.config.prefix_cache:
            return False
        for other in self._running.values():
            if other is seq or other.needs_prefix or other.paused or not other.prefilling:
                continue
            common = common_prefix(other.tokens[: other.prompt_length], seq.tokens)
            if self._reusable(seq, common, other.layout.tiled_until) >= available + MIN_REUSE_TOKENS:
                return True
        return False

    def _reuse(self, seq: _Sequence, source: int, shared: int) -> None:
        """Copies `source`'s cache stream into the sequence's slot (llama.cpp copies it before the next
        decode) and trims it to the shared prefix."""
        if source != seq.slot:
            llama_cpp.llama_memory_seq_cp(self._memory, source, seq.slot, -1, -1)
        llama_cpp.llama_memory_seq_rm(self._memory, seq.slot, shared, -1)
        if source in self._prefixes:
            self._prefixes.touch(source)
        seq.cached = shared
        self._prefix_taken(seq, shared)

    def _prefix_taken(self, seq: _Sequence, shared: int) -> None:
        seq.needs_prefix = False
        if seq.admissions == 1:
            seq.output.cached_tokens = min(shared, len(seq.request.prompt_token_ids))
            total = self.stats.cached_prompt_tokens_total + seq.output.cached_tokens
            self.stats = dataclasses.replace(self.stats, cached_prompt_tokens_total=total)
        else:  # back from preemption: what the cache no longer held is computed again
            total = self.stats.recomputed_tokens_total + len(seq.tokens) - shared
            self.stats = dataclasses.replace(self.stats, recomputed_tokens_total=total)

    # -- slots -------------------------------------------------------------------

    def _compact(self) -> None:
        """Keeps the decoding sequences on contiguous slots, one move per step.

        llama.cpp's per-sequence cache decodes a batch whose ids have a gap (left by a finished
        or paused sequence) 22% slower at 8 sequences. Moving the highest decoding sequence into
        the lowest hole copies one cache stream (a few milliseconds) and removes the gap. Where
        the run starts does not matter: slots below it may hold cached prefixes.
        """
        decoding = sorted((seq for seq in self._running.values() if not seq.paused), key=lambda seq: seq.slot)
        if not decoding:
            return
        top = decoding[-1]
        taken = {seq.slot for seq in decoding}
        hole = next((slot for slot in range(decoding[0].slot, top.slot) if slot not in taken), None)
        if hole is None:
            return
        parked = next((seq for seq in self._running.values() if seq.slot == hole), None)
        if parked is None:
            self._move(top, hole)
        elif self._free_slots and max(self._free_slots) > top.slot:
            self._move(parked, max(self._free_slots))  # a paused sequence waits above the decoding ones

    def _move(self, seq: _Sequence, slot: int) -> None:
        """Moves a sequence's cache to a free slot; llama.cpp copies the stream before the next decode."""
        self._free_slots.remove(slot)
        self._clear_for_reuse(slot)
        llama_cpp.llama_memory_seq_cp(self._memory, seq.slot, slot, -1, -1)
        llama_cpp.llama_memory_seq_rm(self._memory, seq.slot, -1, -1)
        self._free_slots.append(seq.slot)
        heapq.heapify(self._free_slots)
        seq.slot = slot

    def _clear_for_reuse(self, slot: int) -> None:
        """A slot taken out of the free list is about to be overwritten: its cached prefix, if any,
        moves to a free slot holding nothing or an older prefix, or is given up."""
        if slot not in self._prefixes:
            return
        target = self._prefixes.victim(self._free_slots, keep_newer_than=slot)
        if target is None:
            self._prefixes.drop(slot)
            return
        self._prefixes.drop(target)
        llama_cpp.llama_memory_seq_cp(self._memory, slot, target, -1, -1)
        self._prefixes.move(slot, target)

    def _vacate(self, seq: _Sequence) -> None:
        """Takes a sequence off its slot, leaving its cells there as a cached prefix when worth keeping."""
        del self._running[seq.id]
        if self.config.prefix_cache and seq.cached >= MIN_REUSE_TOKENS:
            self._prefixes.put(seq.slot, seq.tokens[: seq.cached], seq.id, seq.prompt_length, seq.layout.tiled_until)
        else:
            llama_cpp.llama_memory_seq_rm(self._memory, seq.slot, -1, -1)
        heapq.heappush(self._free_slots, seq.slot)
        seq.slot, seq.cached = -1, 0

    # -- the batch -----------------------------------------------------------------

    def _decoding_batch(self) -> list[tuple[_Sequence, int | None]]:
        """The next token of every decoding sequence, in slot order."""
        self._batch.n_tokens = 0
        scheduled: list[tuple[_Sequence, int | None]] = []
        # With a cache per sequence, llama.cpp splits a batch into equal-length pieces per
        # sequence, so several tokens of one sequence beside others would cost extra forward
        # passes. Forced tokens therefore go all at once only when a sequence runs alone.
        per_sequence = self.config.batch_tokens if len(self._running) == 1 else 1
        # Tokens in ascending sequence order: llama.cpp's per-sequence cache takes a much slower
        # path (measured: 1.7x per step at 8 sequences) when a batch lists sequences out of order.
        # Lowest-slot-first admission keeps the ids contiguous, which it also needs.
        for seq in sorted(self._running.values(), key=lambda seq: seq.slot):
            if self._decodes(seq):
                # Output tokens fed again after a preemption go one a step, as they were computed.
                replaying = seq.cached < seq.replay_until - 1
                self._put(seq, 1 if replaying else min(per_sequence, len(seq.tokens) - seq.cached), scheduled)
        return scheduled

    def _prompt_batch(self) -> list[tuple[_Sequence, int | None]]:
        """The next group of rows of the prompt waiting longest for one, unless decoding sequences
        have waited for batch_tokens prompt rows already.

        Prompts go first, each group in a llama_decode of its own (its rows grouped as its layout
        says, whatever else runs), so a burst of arrivals gets its first tokens one after another
        instead of all at the end: a CPU prefills a token at the same cost batched or not
        (measured: docs/benchmarks.md). Prompts take turns a group at a time, so a short prompt
        waits for one group of a long one, not all of it; decoding sequences wait at most
        batch_tokens prompt rows.
        """
        self._batch.n_tokens = 0
        scheduled: list[tuple[_Sequence, int | None]] = []
        waiting = [s for s in self._running.values() if not s.paused and not s.needs_prefix and s.prefilling]
        if not waiting:
            return scheduled
        seq = min(waiting, key=lambda s: s.prefill_turn)
        rows = seq.layout.next_group(seq.cached, self.config.batch_tokens)
        waited = self._prompt_rows_since_decode
        if waited and waited + rows > self.config.batch_tokens and self._decoding_batch_ready():
            return scheduled
        self._put(seq, rows, scheduled)
        seq.prefill_turn = next(self._turns)
        return scheduled

    def _decoding_batch_ready(self) -> bool:
        return any(map(self._decodes, self._running.values()))

    @staticmethod
    def _decodes(seq: _Sequence) -> bool:
        """Whether the sequence has tokens to feed in the decoding batch."""
        return not seq.paused and not seq.needs_prefix and not seq.prefilling and seq.cached < len(seq.tokens)

    def _put(self, seq: _Sequence, count: int, scheduled: list[tuple[_Sequence, int | None]]) -> None:
        batch, n = self._batch, self._batch.n_tokens
        for token in seq.tokens[seq.cached : seq.cached + count]:
            batch.token[n] = token
            batch.pos[n] = seq.cached
            batch.n_seq_id[n] = 1
            batch.seq_id[n][0] = seq.slot
            batch.logits[n] = False
            seq.cached += 1
            n += 1
        complete = seq.cached == len(seq.tokens)
        batch.logits[n - 1] = complete  # sample only once every known token is in
        batch.n_tokens = n
        scheduled.append((seq, n - 1 if complete else None))

    def _fill_constraint_masks(self, sampling: Iterable[_Sequence]) -> None:
        """Fills the bitmask row of every constrained sequence about to be sampled (llguidance drops the GIL)."""
        rows = [(seq.output.constraint, seq.slot) for seq in sampling if seq.output.constraint is not None]
        if not rows:
            return
        start = time.perf_counter()
        if self._mask_executor is not None:
            llguidance.numpy.fill_next_token_bitmask_par(
                self._mask_executor, [(state.matcher, slot) for state, slot in rows], self._bitmask
            )
        else:  # measured on 2 cores: a parallel fill costs more than it saves
            for state, slot in rows:
                llguidance.numpy.fill_next_token_bitmask(state.matcher, self._bitmask, slot)
        share = (time.perf_counter() - start) / len(rows)
        for state, _ in rows:
            state.mask_s += share

    def _sample(self, seq: _Sequence, logits_index: int) -> None:
        output = seq.output
        output.step = self.steps
        fault_prefix = self.config.fail_requests_with_prefix
        if fault_prefix and seq.id.startswith(fault_prefix):
            raise RuntimeError("injected fault (fail_requests_with_prefix)")
        logits = llama_cpp.llama_get_logits_ith(self.ctx, logits_index)
        if output.constraint is not None:
            output.check_constraint()  # the mask computation may have failed
            start = time.perf_counter()
            apply_bitmask(np.ctypeslib.as_array(logits, shape=(self.model.vocab_size,)), self._bitmask[seq.slot])
            output.constraint.mask_s += time.perf_counter() - start
        if not output.eos_allowed():
            for token in self.model.eos_token_ids:
                logits[token] = -math.inf
        token = llama_cpp.llama_sampler_sample(seq.sampler, self.ctx, logits_index)
        seq.tokens.append(token)
        self._emit(seq, output.on_token(self._describe(token, logits, seq.request), self._is_eos(token)))
        if not output.finished and output.constraint is not None:
            for forced in output.constraint.forced_tokens(self._max_forced):  # no choice left: skip sampling
                llama_cpp.llama_sampler_accept(seq.sampler, forced)  # penalties and DRY still see it
                seq.tokens.append(forced)
                piece = GeneratedToken(forced, self.model.pieces[forced])
                self._emit(seq, output.on_token(piece, self._is_eos(forced)))
                if output.finished:
                    break
        if output.finished:
            self._release(seq)
        elif len(seq.tokens) >= self.context_length:  # prompt + output now fill the context
            self._end(seq, FinishReason.CONTEXT_LIMIT)

    def _is_eos(self, token: int) -> bool:
        return token in self.model.eos_token_set

    def _describe(self, token: int, logits: ctypes.POINTER(ctypes.c_float), request: GenerationRequest) -> GeneratedToken:
        piece = self.model.pieces[token]
        wanted = request.output
        if not wanted.return_logprobs and not wanted.top_logprobs:
            return GeneratedToken(token, piece)
        row = np.ctypeslib.as_array(logits, shape=(self.model.vocab_size,))
        return with_logprobs(token, row, self.model.pieces.__getitem__, wanted.top_logprobs)

    # -- endings and outputs -------------------------------------------------------

    def _emit(self, seq: _Sequence, event: Event) -> None:
        self._outputs.append((seq.sink, event))

    def _take_outputs(self) -> list[Output]:
        outputs, self._outputs = self._outputs, []
        return outputs

    def _end_waiting(self, request_id: str, reason: FinishReason) -> bool:
        for i, (request, sink) in enumerate(self._waiting):
            if request.request_id == request_id:
                del self._waiting[i]
                self._outputs.append((sink, SequenceOutput(request).end(reason)))
                return True
        return False

    def _end(self, seq: _Sequence, reason: FinishReason) -> None:
        self._emit(seq, seq.output.end(reason))
        self._release(seq)

    def _fail(self, seq: _Sequence, message: str, constraint_failed: bool = False, paused_too_long: bool = False) -> None:
        self._emit(seq, ErrorEvent(message, constraint_failed, paused_too_long))
        self._release(seq)

    def _release(self, seq: _Sequence) -> None:
        if seq.id in self._running:
            self._vacate(seq)
        else:
            del self._preempted[seq.id]
        llama_cpp.llama_sampler_free(seq.sampler)

    def _publish(self) -> None:
        """Replaces the stats snapshot (one reference assignment: atomic for readers)."""
        self.stats = dataclasses.replace(
            self.stats,
            steps=self.steps,
            running_sequences=len(self._running),
            preempted_sequences=len(self._preempted),
            paused_sequences=sum(seq.paused for seq in (*self._running.values(), *self._preempted.values())),
            queued_requests=len(self._waiting),
            cache_tokens_used=self.cache_cells_used,
            prefix_cache_entries=len(self._prefixes),
            prefix_cache_tokens=self._prefixes.tokens_held,
        )

    def close(self) -> list[Output]:
        for seq in [*self._running.values(), *self._preempted.values()]:
            self._end(seq, FinishReason.CANCELLED)
        while self._waiting:
            request, sink = self._waiting.popleft()
            self._outputs.append((sink, SequenceOutput(request).end(FinishReason.CANCELLED)))
        if self.ctx:
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        return self._take_outputs()
